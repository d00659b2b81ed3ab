"""Step, idle-wait and limits-reload spans with the real OpenTelemetry SDK
and an in-memory exporter: a refund on a step span, refusal-only steps
sampled, the engine loop's idle wait a span (and woken at once by a new
request), a limits reload with what changed."""

from __future__ import annotations

import queue

import pytest

from harness import make_request
from tracing_setup import exporter, telemetry_mode  # noqa: F401  (fixtures)
from tracing_setup import limits, setup, spans
from vllm_output_rate import engine_loop


@pytest.mark.usefixtures("telemetry_mode")
def test_refund_is_recorded_on_a_step_span(tmp_path, exporter):
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(10, b=1000), num_blocks=5,
                                 block_size=16, max_num_batched_tokens=256)
    drv.add(make_request("b", prompt_len=60, max_tokens=100, block_size=16))
    drv.step()
    a = make_request("a", prompt_len=20, max_tokens=5, block_size=16)
    drv.add(a)
    drv.step()
    steps = [s for s in spans(exporter, "output_rate.step") if s.attributes["output_rate.refunded"]]
    assert steps
    (event,) = [e for e in steps[0].events if e.name == "refund"]
    assert event.attributes["output_rate.request_id"] == a.request_id
    assert event.attributes["output_rate.reason"] == "not_scheduled"


class _FakeEngine:
    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.input_queue = queue.Queue()
        self.batch_queue = None
        self.handled = []

    def _handle_client_request(self, request_type, payload):
        self.handled.append((request_type, payload))


@pytest.mark.usefixtures("telemetry_mode")
def test_idle_wait_is_a_span(tmp_path, exporter):
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1))
    drv.add(make_request("a", max_tokens=5))
    drv.step()
    drv.step()  # nothing to run: the user is refused
    wait = engine_loop.idle_wait(_FakeEngine(sched))
    assert wait is not None and wait.reason == "timeout"
    (span,) = spans(exporter, "output_rate.idle_wait")
    assert span.attributes["output_rate.reason"] == "timeout"
    assert span.attributes["output_rate.planned_timeout_s"] == pytest.approx(0.05)
    assert "output_rate.lateness_ns" in span.attributes


@pytest.mark.usefixtures("telemetry_mode")
def test_new_request_wakes_the_idle_wait_at_once(tmp_path, exporter):
    import enum

    class Kind(enum.Enum):
        ADD = 1

    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1))
    drv.add(make_request("a", max_tokens=5))
    drv.step()
    drv.step()
    engine = _FakeEngine(sched)
    engine.input_queue.put((Kind.ADD, "payload"))
    wait = engine_loop.idle_wait(engine)
    assert wait.reason == "ADD" and engine.handled == [(Kind.ADD, "payload")]


@pytest.mark.usefixtures("telemetry_mode")
def test_refusal_only_steps_are_sampled_refund_steps_are_not(tmp_path, exporter, monkeypatch):
    from vllm_output_rate.tracing import recorder as recorder_mod

    monkeypatch.setenv(recorder_mod.STEP_SAMPLE_ENV, "10")
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=1))
    assert rec.step_sample_every == 10
    drv.add(*[make_request("a", max_tokens=3) for _ in range(2)])
    drv.run(100)  # "a" is refused in nearly every step
    steps = spans(exporter, "output_rate.step")
    refusal_steps = rec._refusal_steps
    assert refusal_steps >= 90
    assert len(steps) == -(-refusal_steps // 10)  # the 1st, 11th, 21st, ...
    assert all(s.attributes["output_rate.refusal_steps_per_span"] == 10 for s in steps)


@pytest.mark.usefixtures("telemetry_mode")
def test_a_limits_reload_is_a_span(tmp_path, exporter, monkeypatch):
    from vllm_output_rate.config import load_limits_file
    from vllm_output_rate.ledger import OutputRateState

    monkeypatch.setattr(OutputRateState, "watch_thread", False)
    path = tmp_path / "limits.yaml"
    path.write_text("default: 10\nusers: {a: 5, gone: 1}\n")
    sched, drv, tel, rec = setup(tmp_path, exporter, load_limits_file(str(path)).to_dict())
    old = sched.output_rate.config.digest
    path.write_text("default: 20\nusers: {a: 7, new: 3}\n")
    assert sched.output_rate.watcher.check() == "loaded"
    drv.step()
    (span,) = spans(exporter, "output_rate.limits_reload")
    a = span.attributes
    assert a["output_rate.limits.previous_sha256"] == old
    assert a["output_rate.limits.sha256"] == sched.output_rate.config.digest != old
    assert a["output_rate.limits.default_tokens_per_second"] == 20
    assert a["output_rate.limits.previous_default_tokens_per_second"] == 10
    assert (a["output_rate.limits.users_added"], a["output_rate.limits.users_removed"],
            a["output_rate.limits.users_changed"]) == (1, 1, 1)
    assert list(a["output_rate.limits.added"]) == ["new"]
    assert list(a["output_rate.limits.removed"]) == ["gone"]
