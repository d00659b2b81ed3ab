"""Residency in the scheduler: the residency plan applied (``planners``:
resident slots kept for waiting requests with budget, the preemptions that
free them, the turns of waiting requests) and admission (``_orl_admit``,
behind hook 3 of ``internals``, ``_handle_blocked_waiting_request``): a
waiting request of a user with budget passes (within its prompt budget,
if it has one); one of a user without budget is admitted to borrow
(``lending.admit_borrower``), or, with ``--output-rate-prefill-ahead`` or
borrowing, to compute its prefill short of its last position (chunked
prefill) beside the resident slots kept for others, else skipped for the
step (just in time: its prompt waits for its budget). vLLM's waiting loop then admits the
requests with budget in its own order.

``ResidencyMixin`` is mixed by ``scheduler`` over vLLM's ``Scheduler``; it
reads and calls what ``host.SchedulerHost`` declares, and keeps its state in
the host's ``output_rate``.
"""

from __future__ import annotations

import time
from typing import Any

from vllm_output_rate import lending
from vllm_output_rate.host import SchedulerHost
from vllm_output_rate.planners import ResidencyPlan, samples_now

Request = Any


class ResidencyMixin(SchedulerHost):
    """The residency plan applied, and admission (see the module)."""

    def _orl_apply_residency(self, plan: ResidencyPlan) -> None:
        """Before vLLM schedules: ``waiting`` reordered, the resident
        requests preempted (vLLM's ``_preempt_request``, as its own loop
        does: off ``running`` first), the slots kept, the turns given."""
        step = self.output_rate.step
        if plan.waiting is not None:
            self.waiting.clear()
            self.waiting.extend(plan.waiting)
        if plan.evict:
            streams, record = step.streams, step.report
            for victim in plan.evict:
                self.running.remove(victim)
                self._preempt_request(victim, time.monotonic())
                user = victim.output_rate_user
                streams[user] -= 1  # (the step's count of ``running``)
                if not streams[user]:
                    del streams[user]
                record.preempted_throttled.append(victim.request_id)
                record.preempted_for_slot += 1
        step.resident_kept = plan.kept
        step.kept_ids = plan.kept_ids
        if plan.turns:
            self._orl_give_turns(plan.turns)

    def _orl_give_turns(self, requests: list[Request]) -> None:
        """These waiting requests, each with a resident slot in this step,
        take their users' next token: their users' resident streams are
        a token short in the running order (``planners.plan_running_order``),
        and with borrowing the step keeps their room (``lending.keep``) and
        sets the token aside (``charges.CeilingCharges.set_aside``)."""
        st = self.output_rate
        step = st.step
        step.turns = {r.output_rate_user for r in requests}
        book = step.lending
        if book is not None:
            # (the running order reads the budgets from before, less the turn)
            step.budgets_of(self.running)
            set_aside = step.charges.set_aside
            for request in requests:
                lending.keep(book, request, st)
                set_aside(request.request_id, request.output_rate_user)
            turns = step.turn_ids
            # (not among the waiting borrowers)
            book.waiting_borrowers = [r for r in book.waiting_borrowers
                                      if r.request_id not in turns]

    def _orl_take_kept(self, request: Request, any_slot: bool = False) -> bool:
        """vLLM's waiting loop admits ``request``: the slot kept for it (or,
        ``any_slot``, one kept slot) is taken. Whether one was kept for it."""
        step = self.output_rate.step
        mine = request.request_id in step.kept_ids
        if mine:
            step.kept_ids.discard(request.request_id)
        if (mine or any_slot) and step.resident_kept:
            step.resident_kept -= 1
        return mine

    # -- admission (hook 3 of ``internals``) --------------------------------

    def _orl_admit(self, request: Request) -> bool:
        """Whether vLLM's waiting loop may admit ``request`` in this step
        (vLLM's own checks passed: see the module)."""
        st = self.output_rate
        step = st.step
        if step.block_admission:
            # We preempted a throttled request in this step; like vLLM after
            # its own preemptions, admit nothing new in this step.
            return False
        user = request.output_rate_user
        charges = step.charges
        if step.turn_ids:
            charges.put_back(request.request_id)  # its turn: the token set aside for it
        prompts = st.prompts
        if prompts is not None and request.num_computed_tokens < request.num_prompt_tokens \
                and prompts.available(user, step.now) < 1:
            # its prompt budget is spent: nothing of its prompt may be computed now
            step.prompt_waits[user] = 0
            step.report.waiting_skipped += 1
            self._orl_prompt_put_off(request, "prompt_budget", request.num_computed_tokens)
            return False
        if charges.left(user) > 0:
            self._orl_take_kept(request, any_slot=True)
            return True
        # out of budget: to borrow, or to compute its prefill ahead, in a
        # slot kept for it (to borrow), or beside the kept ones
        # (beside the resident slots kept for requests with budget)
        n_running = len(self.running)
        if self._orl_take_kept(request) or st.resident_fits(n_running, step.resident_kept):
            if st.lender is not None and lending.admit_borrower(request, n_running, st, step):
                return True
            step.refused[user] = 0
            # (just in time, the default without borrowing: not before its budget)
            ahead = st.prefill_ahead or st.lender is not None
            if ahead and st.chunked and self._orl_can_hold_prefill(request) and (
                    st.lender is None or lending.admit_room(request, n_running, st, step)):
                return True
            if not ahead and st.chunked and user not in step.in_time \
                    and self._orl_can_hold_prefill(request) \
                    and lending.jit_room(step, request, 1) > 0:  # (within the room not kept)
                # its user's next token returns by the time its prompt is
                # computed; with requests of its user running, the token
                # after those they may still take, and only for a prompt no
                # turn can serve (``planners.samples_now``: one that takes
                # more than a step; a shorter one waits for its turn)
                claimed = 0
                if step.streams_of(self.running).get(user):
                    claimed = -1 if samples_now(request, st) else \
                        step.claimed_of(self.running).get(user, 0)
                if claimed >= 0 and self._orl_in_time(
                        request, request.num_tokens - request.num_computed_tokens,
                        st.token_budget, claimed):
                    step.in_time.add(user)
                    return True
        else:
            step.refused[user] = 0
        step.report.waiting_skipped += 1
        if not st.prefill_ahead and st.lender is None:  # (just in time: its budget first)
            self._orl_prompt_put_off(request, "just_in_time", request.num_computed_tokens)
        return False

    def _orl_can_hold_prefill(self, request: Request) -> bool:
        """Whether this waiting request's prefill surely has a position to
        compute short of its last one, whatever its prefix-cache hit (hits
        are whole blocks of at most ``num_tokens - 1`` tokens)."""
        if request.num_tokens - 1 - request.num_computed_tokens <= 0:
            return False
        return not (
            self.output_rate.prefix_caching
            and request.num_computed_tokens == 0
            and (request.num_tokens - 1) % self.block_size == 0
        )
