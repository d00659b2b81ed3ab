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


class VirtualWaitQueue(RecordingQueue):
    """An empty input queue whose wait passes in virtual time: ``get``
    moves the fake clock on by the timeout it was given and times out. It
    also notes when each wait began and the budget it waited for."""

    def __init__(self, sched, clock) -> None:
        super().__init__()
        self.sched, self.clock = sched, clock
        self.log: list[tuple[int, float | None, int | None]] = []

    def get(self, block: bool = True, timeout: float | None = None):
        self.log.append((self.clock(), timeout, self.sched.output_rate_wake_target_ns()))
        if timeout is not None:
            self.clock.now_ns += round(timeout * 1e9)
        return super().get(block, timeout)


class _VirtualNap:
    """``time`` for vLLM's engine-core module: its 1 ms nap after a step
    that ran no model passes in virtual time (everything else is time's)."""

    def __init__(self, clock) -> None:
        self.clock = clock

    def sleep(self, seconds: float) -> None:
        self.clock.now_ns += round(seconds * 1e9)

    def __getattr__(self, name):
        import time

        return getattr(time, name)


@pytest.mark.parametrize("is_async", MODES)
def test_a_throttled_engine_sleeps_until_the_next_budget_in_virtual_time(is_async, monkeypatch):
    """test_e2e's engine-core-does-not-spin scenario in virtual time: one
    user at 0.5 tok/s, two streams of 5 tokens, nothing else to do. vLLM's
    own loop (its 1 ms nap after an idle step passing in virtual time too)
    would go round a thousand times a second; ours waits on the input queue
    for exactly the time to the next budget, capped at 50 ms: at most 20
    idle rounds a second plus one per budget, and each token dispatched at
    the very moment its budget comes. (The end-to-end test measures the
    engine core's CPU; this is the exact count behind it.)"""
    import vllm.v1.engine.core as core_mod

    from harness import observe_steps

    clock = VirtualClock()
    sched = make_scheduler({"default_user_output_tokens_per_second": 0.5}, clock=clock,
                           async_scheduling=is_async)
    # a step that runs a model takes 10 ms; one that runs nothing, no time
    driver = Driver(sched, clock, is_async=is_async,
                    step_ms_of=lambda out: 10.0 if out.total_num_scheduled_tokens else 0.0)
    engine = EngineStandIn(sched, driver)
    engine.input_queue = VirtualWaitQueue(sched, clock)
    monkeypatch.setattr(core_mod, "time", _VirtualNap(clock))
    charges: list[int] = []
    observe_steps(sched, lambda report: charges.extend([report.now_ns] * len(report.charged)))
    requests = [make_request("user-slow", max_tokens=5) for _ in range(2)]
    driver.add(*requests)
    t0 = clock()
    rounds = idle_rounds = unwaited = 0
    while sched.has_requests():
        rounds += 1
        assert rounds < 20_000, "the loop spins"
        waits = len(engine.input_queue.log)
        if not EngineCoreProc._process_engine_step(engine):
            idle_rounds += 1
            if len(engine.input_queue.log) == waits:
                # (only once nobody is refused: the run's last rounds, that
                # finish the requests)
                assert sched.output_rate_idle_wait_s() is None, rounds
                unwaited += 1
    driver.flush()
    elapsed_s = (clock() - t0) / 1e9
    assert [driver.count(r.request_id) for r in requests] == [5, 5]
    # 10 tokens at 0.5 tok/s: the first at once, the second 1.9 s later
    # (GCRA's 0.1 s burst), then one every 2 s, exactly
    assert charges[0] == t0
    assert [b - a for a, b in zip(charges, charges[1:])] == [1_900_000_000] + [2_000_000_000] * 8
    assert 17.9 <= elapsed_s <= 18.0
    # every idle round waited, for min(50 ms, time to the next budget);
    # zero only when vLLM's 1 ms nap reached the budget (the next step
    # dispatches then, at that very time)
    waits = engine.input_queue.log
    assert len(waits) == idle_rounds - unwaited and unwaited <= 2
    for now, timeout, target in waits:
        assert timeout == pytest.approx(max(0.0, min(0.05, (target - now) / 1e9)), abs=1e-9)
    zeros = [now for now, timeout, _ in waits if timeout == 0]
    assert set(zeros) <= set(charges)
    # no spin: 20 idle rounds a second, one more per budget that cut a wait short
    assert idle_rounds <= 20 * elapsed_s + len(charges) + 1
