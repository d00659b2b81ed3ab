"""The engine loop's wait, through vLLM's own ``EngineCoreProc._process_engine_step``.

The method is vLLM's (wrapped by ``engine_loop.install``, which the
output-rate scheduler's constructor calls); what it reads of the engine is
stood in for: the real scheduler stepped by the driver as the engine's step
function, the input queue, the client-request handler. No model, no
process: this runs beside every supported vLLM version (the 0.34 loop feeds
a watchdog first; the rest is the same). The queue records the timeout it is
asked to wait for and never blocks, so nothing here depends on wall time.
"""

from __future__ import annotations

import queue

import pytest
from vllm.v1.engine.core import EngineCoreProc

from harness import Driver, VirtualClock, make_request, make_scheduler
from vllm_output_rate import engine_loop

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


class RecordingQueue(queue.Queue):
    """An input queue that says what it was asked to wait for, without waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float | None] = []

    def get(self, block: bool = True, timeout: float | None = None):
        self.waits.append(timeout)
        return super().get(block=False)


class EngineStandIn:
    """The attributes ``_process_engine_step`` reads of an ``EngineCoreProc``."""

    def __init__(self, scheduler, driver: Driver) -> None:
        self.scheduler = scheduler
        self.driver = driver
        self.input_queue = RecordingQueue()
        self.output_queue: queue.Queue = queue.Queue()
        self.batch_queue = None
        self.handled: list[tuple[str, object]] = []

    def step_fn(self):
        out = self.driver.step()
        return {}, out.total_num_scheduled_tokens > 0

    def post_step(self, model_executed: bool) -> None:
        pass

    def _handle_client_request(self, request_type, payload) -> None:
        self.handled.append((request_type, payload))


def _engine(is_async: bool):
    clock = VirtualClock()
    sched = make_scheduler({"default_user_output_tokens_per_second": 2}, clock=clock,
                           async_scheduling=is_async)
    driver = Driver(sched, clock, step_ms=10.0, is_async=is_async)
    return EngineStandIn(sched, driver), sched, clock


def _until_nothing_runs(engine: EngineStandIn) -> None:
    for _ in range(50):
        if not EngineCoreProc._process_engine_step(engine):
            return
    raise AssertionError("a model ran in every step")


@pytest.mark.parametrize("is_async", MODES)
def test_the_loop_waits_on_its_input_queue_for_the_next_budget(is_async):
    engine, sched, clock = _engine(is_async)
    assert getattr(EngineCoreProc._process_engine_step, "__wrapped__", None) is not None
    engine.driver.add(make_request("a", max_tokens=20), make_request("a", max_tokens=20))
    _until_nothing_runs(engine)
    # one wait per step that ran no model, for exactly the time to the next
    # budget (capped at 50 ms): the fake clock stands still, so it is exact
    ready_ns = sched.output_rate_wake_target_ns()
    expected = min(0.05, (ready_ns - clock()) / 1e9)
    assert engine.input_queue.waits[-1] == pytest.approx(expected, abs=1e-9)
    assert engine_loop.last_idle_wait.reason == "timeout"
    waits = len(engine.input_queue.waits)
    # a step that runs a model does not wait
    clock.now_ns = ready_ns
    assert EngineCoreProc._process_engine_step(engine)
    assert len(engine.input_queue.waits) == waits


@pytest.mark.parametrize("is_async", MODES)
def test_a_message_ends_the_wait_and_is_handled_at_once(is_async):
    engine, sched, _ = _engine(is_async)
    engine.driver.add(make_request("a", max_tokens=20))
    _until_nothing_runs(engine)
    engine.input_queue.put(("ADD", "new-request"))
    assert not EngineCoreProc._process_engine_step(engine)
    assert engine.handled == [("ADD", "new-request")]
    assert engine_loop.last_idle_wait.reason == "ADD"


def test_without_refused_users_the_loop_is_vllms(monkeypatch):
    """No user refused: no wait of ours (vLLM's own loop, unchanged)."""
    engine, sched, _ = _engine(False)
    monkeypatch.setattr(sched, "output_rate_idle_wait_s", lambda: None)
    engine.driver.add(make_request("a", max_tokens=20))
    _until_nothing_runs(engine)
    assert engine.input_queue.waits == []
