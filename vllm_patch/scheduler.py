"""The output-rate limit inside vLLM's V1 scheduler: vLLM's hook points.

``OutputRateScheduler`` and ``OutputRateAsyncScheduler`` put
``OutputRateSchedulerMixin`` over vLLM's ``Scheduler`` and
``AsyncScheduler``. vLLM's own ``schedule()`` does the scheduling; the mixin
overrides only vLLM's hook points (the register: ``internals``), each
delegating in a few lines to the limiter's step (``core``), residency's
admission (``residency``) and the PRIORITY policy's victim
(``preemption``); the state is one attribute, ``output_rate``
(``ledger.OutputRateState``). Where a token is charged: ``core._orl_charge``
(with ``charges``); where a step's room is decided: the planners
(``planners``, ``lending``), applied by ``core._orl_before_schedule``.

What the limiter did in a step is kept as plain data
(``output_rate.last_step``, an ``observers.StepReport``) and reported to the
registered observers (``vllm_output_rate.observers``: telemetry registers
itself there; this module imports none of it). The engine loop asks
``output_rate_idle_wait_s()`` how long it may wait when no model ran.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from vllm_output_rate.core import OutputRateCore
from vllm_output_rate.ledger import OutputRateState
from vllm_output_rate.preemption import PriorityPreemptionMixin
from vllm_output_rate.residency import ResidencyMixin


class OutputRateSchedulerMixin(OutputRateCore, ResidencyMixin, PriorityPreemptionMixin):
    """Per-user output-token rate limit over vLLM's V1 scheduler.

    The policy, at vLLM's hook points (``internals``: at most five that
    change what vLLM does):

    - ``schedule()`` (hook 1), before vLLM's: read the clock once and begin
      the step's ledger; put reloaded limits in force; keep resident slots
      for waiting requests with budget, preempting throttled ones for them
      when every slot is taken, and give a user's first waiting request its
      turn; with borrowing, keep the room of waiting requests with budget
      and choose the borrowers; rotate each user's streams, move requests
      whose user has no budget behind the others, longest-waiting user
      first when the active cap binds; then hold the throttled tail out of
      ``running`` while vLLM schedules (vllm-spyre's way) when the KV cache
      has room for the step, else leave it at the tail, where vLLM's own
      preemption looks first.
    - ``schedule()``, after vLLM's: the single refund point (charged, not
      dispatched), the step's charges settled, the step reported.
    - ``_reserve_prefill_lookahead`` (hook 2, per request, right before KV
      allocation): charge one token when the step samples, lend one (a
      borrower, within its ceiling and the step's room), shrink a final
      prefill chunk one position short (chunked prefill), or skip the
      request (it stays in ``running`` with its KV).
    - ``_handle_blocked_waiting_request`` (hook 3): skip waiting requests
      of users without budget whose prefill cannot advance or who may not
      borrow, beside the resident slots kept for others.
    - ``max_num_active_reqs`` (hook 4): throttled requests do not count
      against the active cap; held-back ones still count against the
      resident cap.
    - With ``--scheduling-policy priority``, the KV cache manager's
      ``allocate_slots`` is wrapped once: a borrower, else a throttled
      request of the lowest priority, is preempted first.
    - The engine loop (hook 5, ``engine_loop``) waits on its input queue for
      the next budget when a step ran no model.
    - With the feature off none of this is installed: vLLM is upstream.
    """

    output_rate: OutputRateState

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # (made before vLLM's __init__ runs: it sets the active cap, which the state keeps)
        self.output_rate = OutputRateState()
        super().__init__(*args, **kwargs)
        self._orl_start()

    # -- hook 4: the admission cap ----------------------------------------------

    @property
    def max_num_active_reqs(self) -> int:
        return self.output_rate.active_cap(self.max_num_running_reqs)

    @max_num_active_reqs.setter
    def max_num_active_reqs(self, value: int) -> None:
        self.output_rate.base_active = value

    # -- hook 1: the step -----------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any):
        t0 = time.perf_counter()
        held = self._orl_before_schedule()
        t1 = time.perf_counter()
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            if held:  # (back in ``running``, after the others)
                self.running.extend(held)
                self.output_rate.step.held = 0
        self._orl_after_schedule(output, t0, t1)
        return output

    # -- hook 2: the charge point ---------------------------------------------------

    #: (vLLM calls it for every request it is about to give tokens to: the
    #: charge point is the hook itself, vLLM's own reservation inside it)
    _reserve_prefill_lookahead = OutputRateCore._orl_charge

    # -- hook 3: admission ------------------------------------------------------------

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        return super()._handle_blocked_waiting_request(request) and self._orl_admit(request)

    # -- observed only (nothing vLLM decides changes) ------------------------------

    def add_request(self, request: Request) -> None:
        self._orl_add(request)
        super().add_request(request)
        observer = self.output_rate.observer
        if observer is not None:
            observer.on_request(request.request_id)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        observer = self.output_rate.observer
        if observer is not None:
            observer.on_outputs(outputs)
        return outputs

    def finish_requests(self, request_ids: Any, finished_status: Any) -> list[Request]:
        finished = super().finish_requests(request_ids, finished_status)
        st = self.output_rate
        if st.observer is not None and finished:
            st.observer.on_aborted([(r.request_id, r.output_rate_user) for r in finished],
                                   st.clock())
        return finished

    def shutdown(self) -> None:
        self.output_rate.close()
        super().shutdown()

    # -- the engine loop's questions (``engine_loop``) -------------------------------

    def output_rate_idle_wait_s(self) -> float | None:
        """How long the engine loop may wait after a step that ran nothing
        (``OutputRateState.idle_wait_s``)."""
        return self.output_rate.idle_wait_s()

    def output_rate_wake_target_ns(self) -> int | None:
        """The earliest ready_at among users refused in the last step."""
        return self.output_rate.wake_target_ns()


class OutputRateScheduler(OutputRateSchedulerMixin, Scheduler):
    """vLLM's synchronous ``Scheduler`` with per-user output-rate limits."""


class OutputRateAsyncScheduler(OutputRateSchedulerMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with per-user output-rate limits."""
