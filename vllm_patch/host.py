"""What the output-rate mixins need of their host, vLLM's ``Scheduler``.

``core`` (with ``prompt_points``), ``residency`` and ``preemption`` are
mixed by ``scheduler`` over vLLM's ``Scheduler`` and ``AsyncScheduler``.
They derive from ``SchedulerHost``: for type checkers, vLLM's ``Scheduler``
with the attributes they read declared (vllm-ascend's way); at run time,
``object``.

The contract:

* the host is vLLM's V1 ``Scheduler`` (or ``AsyncScheduler``) of a
  supported version; every vLLM name declared here is in the register of
  internals (``internals``);
* the mixins read the attributes declared below, call vLLM's
  ``_preempt_request(request, timestamp)`` (after taking the request off
  ``running``, as vLLM's own loop does) and ``_request_blocks_can_be_freed``,
  reorder ``running`` (a list) in place and, FCFS only, ``waiting`` (``clear``
  and ``extend``); they set no attribute on the host: their state is the one
  attribute ``scheduler`` makes before vLLM's ``__init__`` runs,
  ``output_rate`` (``ledger.OutputRateState``);
* the host's hook points (``scheduler``) call them: ``_orl_start`` after
  vLLM's ``__init__``, ``_orl_add`` for a new request, ``_orl_before_schedule``
  and ``_orl_after_schedule`` around vLLM's ``schedule()``, ``_orl_charge`` at
  the charge point, ``_orl_admit`` at admission; ``_orl_allocate_slots``
  replaces the KV cache manager's ``allocate_slots`` (PRIORITY only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    from vllm_output_rate.ledger import OutputRateState

    class SchedulerHost(Scheduler):
        """vLLM's ``Scheduler`` as the output-rate mixins read it."""

        #: ours: the one attribute (made by ``scheduler``)
        output_rate: OutputRateState
        #: vLLM's: the queues and the requests
        running: list[Request]
        waiting: Any
        requests: dict[str, Request]
        #: vLLM's: the caps and the settings read once
        max_num_running_reqs: int
        max_num_scheduled_tokens: int
        num_prefill_lookahead: int
        block_size: int
        lora_config: Any
        policy: Any
        vllm_config: Any
        scheduler_config: Any
        cache_config: Any
        kv_cache_config: Any
        #: vLLM's: the KV cache (``block_pool.get_num_free_blocks``,
        #: ``allocate_slots``)
        kv_cache_manager: Any
else:
    SchedulerHost = object
