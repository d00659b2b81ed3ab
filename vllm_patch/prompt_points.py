"""Prompt budgets at the charge point (``prompt_budget``): a prefill chunk
cut to what its user's prompt budget allows (or put off), its prompt tokens
reported (every user's) and charged, and each prompt put off reported once
per reason.

``PromptPointsMixin`` is mixed under ``core.OutputRateCore`` (the charge
point, ``_orl_charge``, and the refusal call these; residency's admission
puts prompts off too); it reads and calls what ``host.SchedulerHost``
declares, and keeps its state in the host's ``output_rate``
(``ledger.OutputRateState``): the step's ledger and report.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.request import RequestStatus

from vllm_output_rate.host import SchedulerHost
from vllm_output_rate.observers import PROMPT_DEFER_REASONS
from vllm_output_rate.prompt_budget import prompt_work

Request = Any

_RUNNING = RequestStatus.RUNNING
#: The reasons a prompt is put off, as bits of ``Request.output_rate_deferred``.
DEFER_BITS = {reason: 1 << i for i, reason in enumerate(PROMPT_DEFER_REASONS)}


class PromptPointsMixin(SchedulerHost):
    """The prompt budgets' part of the charge point (see the module)."""

    def _orl_prompt_cut(self, request: Request, num_computed_tokens: int,
                        num_new_tokens: int) -> int:
        """The chunk's tokens within its user's prompt budget: cut to it
        (chunked prefill), or all or none (without); 0 puts it off."""
        st = self.output_rate
        user = request.output_rate_user
        prompts = st.prompts
        if not prompts.budgeted(user):
            return num_new_tokens
        step = st.step
        work = prompt_work(request.num_prompt_tokens, num_computed_tokens, num_new_tokens)
        available = prompts.available(user, step.now)
        short = work - available if st.chunked else (work if available < 1 else 0)
        if short <= 0:
            return num_new_tokens
        if not st.chunked:
            short = num_new_tokens  # (whole or not at all)
        self._orl_prompt_put_off(request, "prompt_budget",
                                 num_computed_tokens + num_new_tokens - short)
        step.prompt_waits[user] = 0  # ready time filled in when the step ends
        if short >= num_new_tokens and request.status == _RUNNING:
            step.throttled_running += 1
        return num_new_tokens - short

    def _orl_prompt_take(self, request: Request, num_computed_tokens: int,
                         num_new_tokens: int) -> None:
        """A prefill chunk dispatched: its prompt tokens reported (every
        user's) and, with a prompt budget, charged (within
        ``_orl_prompt_cut``'s cut); both kept until the refund point."""
        st = self.output_rate
        num_prompt = request.num_prompt_tokens
        work = prompt_work(num_prompt, num_computed_tokens, num_new_tokens)
        if work <= 0:
            return
        user = request.output_rate_user
        step = st.step
        req_id = request.request_id
        chunks = step.report.prompt_chunks
        old = chunks.get(req_id)
        chunks[req_id] = (user, work + (old[1] if old else 0),
                          num_computed_tokens + num_new_tokens >= num_prompt)
        prompts = st.prompts
        if prompts is None or not prompts.budgeted(user):
            return
        if st.chunked:
            work = prompts.grant(user, step.now, work)
        elif not prompts.grant_whole(user, step.now, work):
            return
        old = step.prompt_charged.get(req_id)
        step.prompt_charged[req_id] = (user, work + (old[1] if old else 0))

    def _orl_prompt_put_off(self, request: Request, reason: str, done: int) -> None:
        """``request``'s prompt is put off (``reason``: one of
        ``PROMPT_DEFER_REASONS``) with ``done`` of its tokens computed by the
        end of this step: reported the first time for that reason."""
        bit = DEFER_BITS[reason]
        if request.output_rate_deferred & bit:
            return
        left = request.num_prompt_tokens - done
        if left > 0:
            request.output_rate_deferred |= bit
            self.output_rate.step.report.prompt_deferred.append(
                (request.request_id, request.output_rate_user, reason, left))
