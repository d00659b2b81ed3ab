"""With ``--scheduling-policy priority``: throttled requests are preempted
first, and before them a request borrowing in this step (``borrowing``).
vLLM's PRIORITY policy preempts by priority and arrival, so when a request
finds no KV blocks, a borrower (any priority), else a throttled request of
the lowest priority (``ordering.throttled_victim``), is preempted in place
of vLLM's choice. The wrap (``_orl_allocate_slots`` over the KV cache
manager's ``allocate_slots``) is set once when the scheduler starts
(``core``), never per step; with FCFS none of this runs: throttled requests
sit at the tail of ``running``, where vLLM looks first.

``PriorityPreemptionMixin`` is mixed by ``scheduler`` over vLLM's
``Scheduler``; it reads and calls what ``host.SchedulerHost`` declares.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.request import Request, RequestStatus

from vllm_output_rate.host import SchedulerHost
from vllm_output_rate.ordering import throttled_victim

_RUNNING = RequestStatus.RUNNING


class PriorityPreemptionMixin(SchedulerHost):
    """The PRIORITY policy's victim choice (see the module)."""

    def _orl_allocate_slots(self, request: Request, *args: Any, **kwargs: Any):
        allocate = self.output_rate.upstream_allocate
        blocks = allocate(request, *args, **kwargs)
        if blocks is not None or request.status != _RUNNING:
            return blocks
        step = self.output_rate.step
        while blocks is None:
            victim = throttled_victim(self.running, request, step.charged,
                                      self._request_blocks_can_be_freed, step.charges.left,
                                      step.lent_now)
            if victim is None:
                break
            self.running.remove(victim)
            self._preempt_request(victim, time.monotonic())
            step.block_admission = True
            step.report.preempted_throttled.append(victim.request_id)
            blocks = allocate(request, *args, **kwargs)
        return blocks
