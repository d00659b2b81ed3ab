"""What borrowing shows, from the real vLLM ``Scheduler`` /
``AsyncScheduler`` on a virtual clock (see harness): charged plus borrowed
equals delivered on the metrics, the introspection endpoint's guaranteed
rate, ceiling and borrowed tokens, over-limit spans that tell borrowing from
held at the ceiling, lent tokens ending throttle episodes, and no borrowing
series without ceilings.

A limit ``{rate: R, ceiling: C}`` gives a user R for sure and up to C of the
capacity nobody within its guaranteed rate uses; the ceiling is a second
GCRA. These tests read what the scheduler dispatched from its step reports
(``charged``: guaranteed tokens, ``borrowed``: lent ones; borrowing_setup).
"""

from __future__ import annotations

import pytest

from borrowing_setup import MODES, limits
from harness import Driver, VirtualClock, make_request, make_scheduler, observe_steps
from vllm_output_rate.config import UNLIMITED


# -- telemetry ----------------------------------------------------------------


@pytest.mark.parametrize("is_async", MODES)
def test_charged_plus_borrowed_equals_delivered_on_the_metrics(tmp_path, is_async):
    from harness import attach_telemetry

    clock = VirtualClock()
    sched = make_scheduler(limits(1000, {"a": 5, "b": 20}, {"a": UNLIMITED}), clock=clock,
                           async_scheduling=is_async, max_num_seqs=16, max_num_active_seqs=4)
    tel = attach_telemetry(sched, str(tmp_path), top_k=100, start_thread=False)
    drv = Driver(sched, clock, step_ms=10.0, is_async=is_async)
    reqs = [make_request("a", max_tokens=120) for _ in range(4)] + [
        make_request("b", max_tokens=40) for _ in range(2)]
    drv.add(*reqs)
    drv.run_until_done()
    tel.snapshot()  # folds what was handed over

    def counter(name, *labels):
        return tel.counters.get((name, tuple(labels)), 0)

    for user, expected in (("a", 480), ("b", 80)):
        delivered = sum(drv.count(r.request_id) for r in reqs if r.output_rate_user == user)
        assert delivered == expected
        assert counter("tokens_charged", user) + counter("tokens_borrowed", user) == delivered
    assert counter("tokens_borrowed", "a") > 0.8 * 480
    assert counter("tokens_borrowed", "b") == 0
    assert counter("engine_tokens_borrowed") == counter("tokens_borrowed", "a")
    assert counter("engine_tokens_charged") + counter("engine_tokens_borrowed") == 560


@pytest.mark.parametrize("is_async", MODES)
def test_introspection_shows_both_rates_and_what_was_borrowed(tmp_path, monkeypatch, is_async):
    """``GET /output-rate/users/NAME`` from the engine's snapshot: the
    guaranteed rate as ``limit``, the ceiling, and the tokens borrowed over
    the last 10 s and 60 s beside those charged (they add up to what was
    delivered); a user without a ceiling shows None and borrows nothing."""
    import vllm_output_rate.telemetry.engine as engine_mod
    from harness import attach_telemetry
    from vllm_output_rate.telemetry import introspect

    clock = VirtualClock()
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", clock)  # the windows' ages
    lim = limits(1000, {"a": 5, "b": 20, "c": 50}, {"a": UNLIMITED, "b": 40})
    sched = make_scheduler(lim, clock=clock, async_scheduling=is_async, max_num_seqs=16,
                           max_num_active_seqs=4)
    tel = attach_telemetry(sched, str(tmp_path), top_k=100, start_thread=False)
    drv = Driver(sched, clock, step_ms=10.0, is_async=is_async)
    reqs = {user: [make_request(user, max_tokens=n) for _ in range(2)]
            for user, n in (("a", 100), ("b", 60), ("c", 20))}
    drv.add(*(r for rs in reqs.values() for r in rs))
    while sched.has_requests():  # an export every 100 steps (the exporter's second)
        drv.run(100)
        tel.export()
    drv.flush()
    tel.export()  # (the engine is idle: its last states)
    snap = tel.snapshot()
    assert snap["limits"]["ceilings"] == {"a": "unlimited", "b": 40.0}
    assert snap["limits"]["default_ceiling"] is None
    views = {u: introspect.user_view([snap], u) for u in ("a", "b", "c", "nobody")}
    assert all(status == 200 for status, _ in views.values())
    views = {u: v for u, (_, v) in views.items()}
    for user in ("a", "b", "c"):
        delivered = sum(drv.count(r.request_id) for r in reqs[user])
        v = views[user]
        # the run took under 10 s of virtual time: every token is in both windows
        assert v["charged_10s"] + v["borrowed_10s"] == delivered, (user, v)
        assert v["borrowed_60s"] == v["borrowed_10s"]
        assert v["borrowed_10s"] == counter_of(tel, "tokens_borrowed", user)
    assert (views["a"]["limit"], views["a"]["ceiling"]) == (5.0, "unlimited")
    assert (views["b"]["limit"], views["b"]["ceiling"]) == (20.0, 40.0)
    assert views["a"]["borrowed_10s"] > 0 and views["b"]["borrowed_10s"] > 0
    assert views["c"]["ceiling"] is None and views["c"]["borrowed_10s"] == 0
    assert views["nobody"]["ceiling"] is None and views["nobody"]["limit"] == 1000.0
    # without a ceiling anywhere the fields are not there
    plain = make_scheduler(limits(1000, {"a": 5}), clock=VirtualClock())
    tel2 = attach_telemetry(plain, str(tmp_path / "plain"), start_thread=False)
    status, view = introspect.user_view([tel2.snapshot()], "a")
    assert status == 200 and "ceiling" not in view and "borrowed_10s" not in view


def traced(tmp_path, lim, is_async, **kw):
    """The real scheduler with telemetry and a span recorder (in-memory
    exporter, every episode a span), and a step tap."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from harness import attach_telemetry
    from vllm_output_rate.internals import SchedulerView
    from vllm_output_rate.tracing.recorder import SpanRecorder

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    clock = VirtualClock()
    sched = make_scheduler(lim, clock=clock, async_scheduling=is_async, **kw)
    recorder = SpanRecorder(provider.get_tracer("test"), SchedulerView(sched), clock_offset_ns=0)
    recorder.throttle_min_ns = 0
    tel = attach_telemetry(sched, str(tmp_path), start_thread=False, spans=recorder)
    steps = []
    observe_steps(sched, steps.append)  # (after the telemetry: the tap passes steps on)
    drv = Driver(sched, clock, step_ms=10.0, is_async=is_async)

    def periods():
        """Run to the end, building the spans every 50 steps (as the
        telemetry's worker does about once a second), and the over-limit
        periods' spans."""
        while sched.has_requests():
            drv.run(50)
            tel.drain()
            recorder.flush()
        drv.flush()
        tel.drain()
        recorder.flush()
        assert not tel.counters.get(("telemetry_dropped", ("trace_queue_full",)))
        return [s for s in exporter.get_finished_spans() if s.name == "output_rate.over_limit"]
    return tel, drv, steps, periods


@pytest.mark.parametrize("is_async", MODES)
def test_over_limit_spans_tell_borrowing_from_held_at_the_ceiling(tmp_path, monkeypatch, is_async):
    """A user over its guaranteed rate gets an over-limit period span as
    with a plain limit; with a ceiling the span also says how much it
    borrowed in the period, its ceiling, and whether the ceiling refused it
    (``held_at``: "ceiling", with the steps it did) or only its guaranteed
    rate did while nothing was left to lend ("rate")."""
    import vllm_output_rate.telemetry.engine as engine_mod

    # a alone, 5 guaranteed, ceiling 20: it borrows up to 20 and is held there
    tel, drv, steps, periods = traced(
        tmp_path / "a", limits(1000, {"a": 5}, {"a": 20}), is_async, max_num_seqs=8)
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    drv.add(*(make_request("a", max_tokens=60) for _ in range(4)))
    (span,) = periods()
    attrs = span.attributes
    assert attrs["output_rate.limit_tokens_per_second"] == 5.0
    assert attrs["output_rate.ceiling_tokens_per_second"] == 20.0
    assert "output_rate.ceiling_unlimited" not in attrs
    assert attrs["output_rate.held_at"] == "ceiling"
    at_ceiling = [s for s in steps if "a" in s.at_ceiling and s.now_ns >= span.start_time]
    assert attrs["output_rate.steps_at_ceiling"] == len(at_ceiling) > 10
    lent = sum(1 for s in steps if s.now_ns > span.start_time for u in s.borrowed.values() if u == "a")
    assert attrs["output_rate.tokens_borrowed"] == lent > 100
    assert attrs["output_rate.tokens_charged"] < lent  # most of its tokens were lent
    # a token lent is a dispatch as a charged one is: each request paces at
    # the ceiling in one throttle episode (as at a plain limit) that ends
    # when it finishes, and the period spans the run
    assert tel.histograms[("throttle_episode_seconds", ("a",))].count == 4
    assert span.end_time - span.start_time > 0.95 * (steps[-1].now_ns - steps[0].now_ns)

    # b: 5 guaranteed, no ceiling above it, two requests resident; c
    # (plain, high) has more requests than fit beside them, two resident
    # taking the active slots, two waiting within its budget: no step lends
    # while they wait, b is held by its guaranteed rate; then it borrows
    # what c leaves
    tel, drv, steps, periods = traced(
        tmp_path / "b", limits(1000, {"b": 5, "c": 1000}, {"b": UNLIMITED}), is_async,
        max_num_seqs=4, max_num_active_seqs=2)
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    reqs_b = [make_request("b", max_tokens=100) for _ in range(2)]
    b_ids = {r.request_id for r in reqs_b}
    drv.add(*reqs_b, *(make_request("c", max_tokens=100) for _ in range(4)))
    made = periods()
    spans_b = [s for s in made if s.attributes.get("output_rate.user") == "b"]
    assert spans_b
    for span in spans_b:
        attrs = span.attributes
        assert attrs["output_rate.held_at"] == "rate" and attrs["output_rate.steps_at_ceiling"] == 0
        assert attrs["output_rate.ceiling_unlimited"] is True
        assert "output_rate.ceiling_tokens_per_second" not in attrs
    assert not any("b" in s.at_ceiling for s in steps)  # an unlimited ceiling never refuses
    # a token lent ends a throttle episode as a charged one does: b's
    # episodes end by its last throttled step, not when its requests finish
    # after borrowing the rest (two requests: at most twice that span)
    lent_b = [s.now_ns for s in steps if "b" in s.borrowed.values()]
    last_throttled = max(s.now_ns for s in steps for r in s.throttled if r.startswith("req-")
                         and r in b_ids)
    assert lent_b and lent_b[-1] > last_throttled + 500_000_000
    episodes = tel.histograms[("throttle_episode_seconds", ("b",))]
    # (one a request at most: the second may wait, not resident, while c's
    # requests within their budget take the slots, and borrow at once)
    assert 1 <= episodes.count <= 2
    assert 0 < episodes.sum <= 2 * (last_throttled - steps[0].now_ns) / 1e9 + 0.1
    assert sum(s.attributes["output_rate.tokens_borrowed"] for s in spans_b) <= sum(
        1 for s in steps for u in s.borrowed.values() if u == "b")
    # c has a plain limit it never reached: no period, no borrowing attributes anywhere else
    assert all(s.attributes.get("output_rate.user") == "b" for s in made)


def counter_of(tel, name, *labels):
    return tel.counters.get((name, tuple(labels)), 0)


def test_without_ceilings_no_borrowing_series(tmp_path):
    from harness import attach_telemetry

    sched = make_scheduler(limits(1000, {"a": 5}), clock=VirtualClock())
    tel = attach_telemetry(sched, str(tmp_path), start_thread=False)
    assert not any(name.endswith("borrowed") for name, _ in tel.counters)
    from vllm_output_rate.charges import DirectCharges

    assert sched.output_rate.lender is None
    assert type(sched.output_rate.step.charges) is DirectCharges
