"""Waiting without spinning: the engine-core loop when only throttled work is left.

vLLM's ``EngineCoreProc._process_engine_step`` naps 1 ms after a step that ran
no model while requests remain, then steps again: with every user throttled
that is a busy loop. We wrap it: after such a step, when the scheduler says
users were refused, wait on the engine's input queue with timeout
``min(50 ms, earliest ready_at - now)``. A new request, an abort or any other
message wakes the wait at once and is handled right there.

Installed by the output-rate scheduler's constructor, so only in an
engine-core process whose scheduler is ours; every other process keeps
vLLM's method untouched.
"""

from __future__ import annotations

import queue
from typing import Any

from vllm_output_rate.observers import IdleWait

_installed = False


#: The last idle wait, for tests and debugging.
last_idle_wait: IdleWait | None = None


def _in_flight(engine: Any) -> bool:
    """Whether a batch that computes something is still in the batch queue."""
    batch_queue = getattr(engine, "batch_queue", None)
    return bool(batch_queue) and any(
        entry[1].total_num_scheduled_tokens > 0 for entry in batch_queue
    )


def idle_wait(engine: Any) -> IdleWait | None:
    """Wait on ``engine.input_queue`` for the throttled users' next budget."""
    global last_idle_wait
    scheduler = engine.scheduler
    wait_for = getattr(scheduler, "output_rate_idle_wait_s", None)
    if wait_for is None:
        return None
    timeout = wait_for()
    if timeout is None or _in_flight(engine):
        return None
    state = scheduler.output_rate  # (``ledger.OutputRateState``)
    clock = state.clock
    started = clock()
    try:
        request_type, payload = engine.input_queue.get(timeout=timeout)
    except queue.Empty:
        reason = "timeout"
    else:
        reason = getattr(request_type, "name", str(request_type))
        engine._handle_client_request(request_type, payload)
    wait = IdleWait(timeout, state.wake_target_ns(), started, clock(), reason)
    last_idle_wait = wait
    observer = state.observer
    if observer is not None:
        observer.on_idle_wait(wait)
    return wait


def install() -> None:
    """Wrap ``EngineCoreProc._process_engine_step`` once per process."""
    global _installed
    if _installed:
        return
    from vllm.v1.engine.core import EngineCoreProc

    upstream = EngineCoreProc._process_engine_step

    def _process_engine_step(self: Any) -> bool:
        model_executed = upstream(self)
        if not model_executed and self.scheduler.has_requests():
            idle_wait(self)
        return model_executed

    _process_engine_step.__wrapped__ = upstream  # type: ignore[attr-defined]
    _process_engine_step.__doc__ = upstream.__doc__
    EngineCoreProc._process_engine_step = _process_engine_step
    _installed = True


def uninstall() -> None:
    """Restore vLLM's method (tests)."""
    global _installed
    from vllm.v1.engine.core import EngineCoreProc

    current = EngineCoreProc._process_engine_step
    upstream = getattr(current, "__wrapped__", None)
    if upstream is not None:
        EngineCoreProc._process_engine_step = upstream
    _installed = False
