"""Spans with the real OpenTelemetry SDK and an in-memory exporter."""

from __future__ import annotations

import queue

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from harness import Driver, FakeClock, OtlpHttpReceiver, make_request, make_scheduler
from telemetry.engine import EngineTelemetry
from tracing.spans import SpanRecorder, decode_series, tracer_provider_from_env
from vllm_patch import engine_loop


def limits(default, **users):
    return {"default_user_output_tokens_per_second": default,
            "user_output_tokens_per_second": users}


@pytest.fixture
def exporter():
    return InMemorySpanExporter()


def setup(tmp_path, exporter, lim, **kw):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    clock = FakeClock()
    sched = make_scheduler(lim, clock=clock, **kw)
    recorder = SpanRecorder(provider.get_tracer("test"), sched, clock_offset_ns=0)
    _RECORDERS[:] = [recorder]
    tel = EngineTelemetry(sched, str(tmp_path), start_thread=False, spans=recorder)
    return sched, Driver(sched, clock, step_ms=10.0), tel, recorder


#: recorders made by setup(): spans() builds what they queued first
_RECORDERS: list[SpanRecorder] = []


def spans(exporter, name):
    for recorder in _RECORDERS:
        recorder.flush()
    return [s for s in exporter.get_finished_spans() if s.name == name]


def test_throttle_episodes_are_spans(tmp_path, exporter, monkeypatch):
    import telemetry.engine as engine_mod

    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=10))
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    reqs = [make_request("a", prompt_len=20, max_tokens=8) for _ in range(2)]
    drv.add(*reqs)
    drv.run_until_done()
    throttles = spans(exporter, "output_rate.throttle")
    assert throttles
    first = throttles[0]
    attrs = first.attributes
    assert attrs["output_rate.user"] == "a"
    assert attrs["output_rate.request_id"] in {r.request_id for r in reqs}
    assert attrs["output_rate.held_kv"] is True and attrs["output_rate.kv_blocks"] >= 2
    assert attrs["output_rate.tokens_charged"] >= 1
    assert first.end_time > first.start_time
    # two streams sharing 10 tok/s: an episode lasts about 0.1-0.2 s
    assert all(0 < (s.end_time - s.start_time) <= 0.25e9 for s in throttles)
    assert attrs["output_rate.expected_ready_unix_ns"] <= first.end_time


def test_generation_span_carries_the_spacing_series(tmp_path, exporter, monkeypatch):
    import telemetry.engine as engine_mod

    sched, drv, tel, rec = setup(tmp_path, exporter, limits(20))
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    req = make_request("a", max_tokens=12)
    drv.add(req)
    drv.run_until_done()
    (gen,) = spans(exporter, "output_rate.generation")
    series = decode_series(gen.attributes["output_rate.spacing_series_us_b64u32"])
    times = [t for _, t in drv.tokens[req.request_id]]
    assert series == [(b - a) // 1000 for a, b in zip(times, times[1:])]
    assert gen.attributes["output_rate.tokens"] == 12
    assert gen.attributes["output_rate.spacing_p50_us"] == pytest.approx(50_000, abs=10_000)


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


def test_no_tracing_without_configuration(monkeypatch):
    for var in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert tracer_provider_from_env(None) is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert tracer_provider_from_env(None) is not None


def test_generation_span_links_to_the_request_trace(tmp_path, exporter):
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000))
    req = make_request("a", max_tokens=3)
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    req.trace_headers = {"traceparent": f"00-{trace_id}-{span_id}-01"}
    drv.add(req)
    drv.run_until_done()
    (gen,) = spans(exporter, "output_rate.generation")
    (link,) = gen.links
    assert format(link.context.trace_id, "032x") == trace_id
    assert format(link.context.span_id, "016x") == span_id


def test_client_abort_mid_throttle_ends_the_episode_and_the_generation(tmp_path, exporter,
                                                                      monkeypatch):
    import telemetry.engine as engine_mod
    from vllm.v1.request import RequestStatus

    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=5))
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    reqs = [make_request("a", max_tokens=50) for _ in range(2)]
    drv.add(*reqs)
    drv.run(20)
    assert not spans(exporter, "output_rate.generation")
    sched.finish_requests([r.request_id for r in reqs], RequestStatus.FINISHED_ABORTED)
    gens = spans(exporter, "output_rate.generation")
    assert sorted(s.attributes["output_rate.request_id"] for s in gens) == sorted(
        r.request_id for r in reqs)
    assert all(s.attributes["output_rate.finish_reason"] == "abort" for s in gens)
    assert all(0 < s.attributes["output_rate.tokens"] < 50 for s in gens)
    aborted = [s for s in spans(exporter, "output_rate.throttle")
               if s.attributes["output_rate.outcome"] == "aborted"]
    assert len(aborted) == 2
    assert not rec._episodes and not rec._series and not rec._overflow


class _FailingExporter:
    """An exporter whose endpoint is down (the OTLP exporter returns FAILURE)."""

    def __init__(self, raise_instead=False):
        self.calls = 0
        self.raise_instead = raise_instead

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.calls += 1
        if self.raise_instead:
            raise ConnectionError("endpoint down")
        return SpanExportResult.FAILURE

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis=30000):
        return True


def _counting_provider(exporter, max_queue=2048):
    from tracing.spans import TraceDrops, _counting_processor

    drops = TraceDrops(max_queue)
    provider = TracerProvider()
    provider.add_span_processor(_counting_processor(exporter, drops))
    return provider, drops


@pytest.mark.parametrize("raise_instead", [False, True])
def test_failed_exports_are_counted_and_reach_the_metrics(tmp_path, raise_instead):
    provider, drops = _counting_provider(_FailingExporter(raise_instead))
    clock = FakeClock()
    sched = make_scheduler(limits(1000, a=10), clock=clock)
    recorder = SpanRecorder(provider.get_tracer("test"), sched, clock_offset_ns=0)
    recorder.drops, recorder.provider = drops, provider
    tel = EngineTelemetry(sched, str(tmp_path), start_thread=False, spans=recorder)
    drv = Driver(sched, clock, step_ms=10.0)
    drv.add(*[make_request("a", max_tokens=8) for _ in range(3)])
    drv.run_until_done()
    recorder.flush()
    provider.force_flush()
    assert drops.counts["trace_export_failed"] > 0
    assert drops.counts["trace_queue_full"] == 0
    assert not drops.pending  # nothing left counted as queued
    counters = {(n, tuple(l)): v for n, l, v in tel.snapshot()["counters"]}
    assert counters[("telemetry_dropped", ("trace_export_failed",))] == drops.counts[
        "trace_export_failed"]
    recorder.shutdown()


def test_a_full_span_queue_drops_and_counts_without_blocking():
    import threading

    from opentelemetry.sdk.trace.export import SpanExportResult

    gate = threading.Event()

    class Stuck(_FailingExporter):
        received = 0

        def export(self, spans):
            Stuck.received += len(spans)
            gate.wait(10)  # an exporter stuck on a dead endpoint
            return SpanExportResult.SUCCESS

    provider, drops = _counting_provider(Stuck(), max_queue=8)
    tracer = provider.get_tracer("test")
    for i in range(100):  # returns at once although nothing is exported
        tracer.start_span(f"s{i}").end()
    # at most 8 queued, at most one batch (8) in the stuck exporter, the rest
    # dropped; every span accounted for
    assert len(drops.pending) <= 8 and Stuck.received <= 8
    assert drops.counts["trace_queue_full"] == 100 - len(drops.pending) - Stuck.received >= 84
    gate.set()
    provider.shutdown()


def _three_requests_with_env_traces(tmp_path):
    """Three requests of a limited user through a scheduler whose spans go
    where the OTEL_* / project variables say, as the engine core builds
    them; the recorder shut down (everything exported). (drops, driver,
    requests)."""
    from tracing.spans import TraceDrops, tracer_from

    drops = TraceDrops(2048)
    provider = tracer_provider_from_env(None, drops)
    assert provider is not None
    clock = FakeClock()
    sched = make_scheduler(limits(1000, a=10), clock=clock)
    recorder = SpanRecorder(tracer_from(provider), sched, clock_offset_ns=0)
    recorder.drops, recorder.provider = drops, provider
    EngineTelemetry(sched, str(tmp_path), start_thread=False, spans=recorder)
    drv = Driver(sched, clock, step_ms=10.0)
    reqs = [make_request("a", max_tokens=8) for _ in range(3)]
    drv.add(*reqs)
    drv.run_until_done()
    recorder.shutdown(timeout_s=10)
    return drops, drv, reqs


def test_spans_reach_a_real_otlp_http_receiver(tmp_path, monkeypatch):
    """The real OTLP/HTTP exporter, configured by OTEL_* variables, against a
    receiver on loopback that decodes the protobuf requests."""
    receiver = OtlpHttpReceiver()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.url)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        drops, _drv, _reqs = _three_requests_with_env_traces(tmp_path)
    finally:
        receiver.close()
    received = receiver.spans
    names = [n for n, _ in received]
    assert names.count("output_rate.generation") == 3
    assert "output_rate.throttle" in names
    gen = next(a for n, a in received if n == "output_rate.generation")
    assert gen["output_rate.tokens"].int_value == 8
    assert drops.counts == {"trace_queue_full": 0, "trace_export_failed": 0}


def test_refusal_only_steps_are_sampled_refund_steps_are_not(tmp_path, exporter, monkeypatch):
    from tracing import spans as spans_mod

    monkeypatch.setenv(spans_mod.STEP_SAMPLE_ENV, "10")
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=1))
    assert rec.step_sample_every == 10
    drv.add(*[make_request("a", max_tokens=3) for _ in range(2)])
    drv.run(100)  # "a" is refused in nearly every step
    steps = spans(exporter, "output_rate.step")
    refusal_steps = rec._refusal_steps
    assert refusal_steps >= 90
    assert len(steps) == -(-refusal_steps // 10)  # the 1st, 11th, 21st, ...
    assert all(s.attributes["output_rate.refusal_steps_per_span"] == 10 for s in steps)


def test_generation_series_is_capped_and_the_token_count_is_not(tmp_path, exporter, monkeypatch):
    import telemetry.engine as engine_mod
    from tracing import spans as spans_mod

    monkeypatch.setattr(spans_mod, "MAX_SERIES", 16)
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(100_000))
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    drv.add(make_request("a", max_tokens=40))
    drv.run_until_done()
    (gen,) = spans(exporter, "output_rate.generation")
    assert gen.attributes["output_rate.tokens"] == 40
    assert gen.attributes["output_rate.spacing_series_truncated"] is True
    assert len(decode_series(gen.attributes["output_rate.spacing_series_us_b64u32"])) == 16
    assert not rec._overflow


def test_a_long_generation_series_stays_bounded_while_it_runs(tmp_path, exporter, monkeypatch):
    """Steady tokens are not appended per request: the timeline of update
    spacings and the open runs hold them, and every TRIM_EVERY updates the
    series past the cap are cut and the timeline is cut to the oldest open
    run; both stay bounded while the request runs, and the count is exact."""
    import telemetry.engine as engine_mod
    from tracing import spans as spans_mod

    monkeypatch.setattr(spans_mod, "MAX_SERIES", 16)
    monkeypatch.setattr(spans_mod, "TRIM_EVERY", 8)
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(100_000))
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    req = make_request("a", max_tokens=120)
    drv.add(req)
    longest = timeline = 0
    for _ in range(119):
        drv.step()
        longest = max(longest, len(rec._series.get(req.request_id, ())))
        timeline = max(timeline, len(rec._gaps))
        if req.request_id in rec._series:  # every token so far, kept or not
            assert rec._spacings(req.request_id) == drv.count(req.request_id) - 1
    assert longest == 16  # cut back to the cap while running
    assert 16 < timeline <= 16 + 2 * 8  # the timeline was cut too
    drv.run_until_done()
    (gen,) = spans(exporter, "output_rate.generation")
    assert gen.attributes["output_rate.tokens"] == 120
    assert len(decode_series(gen.attributes["output_rate.spacing_series_us_b64u32"])) == 16
    assert not rec._overflow and not rec._series and not rec._runs
    # a request that is never steady (its tokens come one by one after pauses)
    for i in range(100):
        rec.on_tokens("paused", 1, None if i == 0 else i * 1000, i * 1000 + 500)
        rec.on_zeros("paused", 2)
        assert len(rec._series["paused"]) <= 16 + 8 + 2
    rec.on_aborted([type("R", (), {"request_id": "paused"})()], 200_000)
    gen = [s for s in spans(exporter, "output_rate.generation")
           if s.attributes["output_rate.request_id"] == "paused"]
    assert gen[0].attributes["output_rate.tokens"] == 300


@pytest.mark.parametrize("cap", [10_000, 5])
def test_generation_series_equal_the_delivered_spacings(tmp_path, exporter, monkeypatch, cap):
    """Steady runs, pauses at the limit, resumptions, two tokens in one
    update, aborts, and the timeline cut every 3 updates while runs are
    open: every generation span's series is the spacings of the tokens its
    request delivered (the first ``cap`` of them), its count exact."""
    import harness
    import telemetry.engine as engine_mod
    from collections import deque

    from tracing import spans as spans_mod
    from vllm.v1.request import RequestStatus

    monkeypatch.setattr(spans_mod, "MAX_SERIES", cap)
    monkeypatch.setattr(spans_mod, "TRIM_EVERY", 3)
    plain = harness.model_output_for

    def sometimes_two(scheduler, out, token=harness.SAMPLED_TOKEN):
        mro = plain(scheduler, out, token)
        for i, req_id in enumerate(mro.req_ids):  # a second token now and then
            if mro.sampled_token_ids[i] and (hash(req_id) + len(scheduler.requests)) % 7 == 0:
                mro.sampled_token_ids[i] = [token, token]
        return mro

    monkeypatch.setattr(harness, "model_output_for", sometimes_two)
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=30, b=70))
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    users = ["a", "a", "a", "b", "b", "c", "c", "d"]
    reqs = [make_request(u, max_tokens=20 + 7 * i) for i, u in enumerate(users)]
    drv.add(*reqs)
    recent = deque(maxlen=4)
    for step in range(2000):
        if not sched.has_requests():
            break
        open_runs = list(rec._runs.values())
        drv.step()
        if step == 30:
            sched.finish_requests([reqs[1].request_id, reqs[5].request_id],
                                  RequestStatus.FINISHED_ABORTED)
        # the timeline holds no more than the runs open in the last 3
        # updates (it is cut every 3) need
        recent.append(min(open_runs + list(rec._runs.values()), default=rec._index))
        assert len(rec._gaps) <= rec._index - min(recent) + 1
    gens = {s.attributes["output_rate.request_id"]: s for s in spans(exporter, "output_rate.generation")}
    assert set(gens) == {r.request_id for r in reqs}
    twos = 0
    for r in reqs:
        times = [t for _, t in drv.tokens[r.request_id]]
        want = [(b - a) // 1000 for a, b in zip(times, times[1:])]
        twos += want.count(0)
        attrs = gens[r.request_id].attributes
        assert decode_series(attrs["output_rate.spacing_series_us_b64u32"]) == want[:cap]
        assert attrs["output_rate.tokens"] == len(times)
        assert attrs["output_rate.spacing_series_truncated"] == (len(want) >= cap)
    assert twos > 3  # the two-token updates did happen
    assert not rec._series and not rec._runs and not rec._overflow


def test_spans_are_built_off_the_schedulers_thread_with_a_bounded_counted_queue(tmp_path, exporter):
    """The scheduler's thread only queues plain data: no SDK span exists
    until the builder (here: flush) runs; past the queue's bound spans are
    dropped and counted, and a span that cannot be built is counted while
    the rest are built."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    clock = FakeClock()
    sched = make_scheduler(limits(1000, a=20), clock=clock)
    rec = SpanRecorder(provider.get_tracer("test"), sched, clock_offset_ns=0, background=False)
    rec.drops.max_queue = 6
    EngineTelemetry(sched, str(tmp_path), start_thread=False, spans=rec)
    drv = Driver(sched, clock, step_ms=10.0)
    drv.add(*[make_request("a", max_tokens=6) for _ in range(4)])
    drv.run_until_done()
    assert not exporter.get_finished_spans()  # nothing built on the scheduler's thread
    queued, dropped = len(rec._pending), rec.drops.counts["trace_queue_full"]
    assert queued == 6 and dropped > 0
    broken = rec._pending[0]
    rec._pending[0] = (lambda: 1 / 0, ())
    rec.flush()
    assert len(exporter.get_finished_spans()) == queued - 1
    assert rec.drops.counts["trace_export_failed"] == 1
    # 4 generation spans + at least one throttle episode per stream: all
    # accounted for, built or dropped
    assert dropped + queued >= 4 + 4
    assert broken[0].__name__.startswith("_build_")


@pytest.mark.parametrize("raw, spans_expected", [("0.15", "long only"), ("bad", "all"), ("-1", "all")])
def test_throttle_spans_only_for_episodes_past_the_minimum(tmp_path, exporter, monkeypatch, raw,
                                                          spans_expected):
    import telemetry.engine as engine_mod
    from tracing import spans as spans_mod

    monkeypatch.setenv(spans_mod.THROTTLE_MIN_ENV, raw)
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=10))
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    drv.add(*[make_request("a", max_tokens=8) for _ in range(3)])
    drv.run_until_done()
    throttles = spans(exporter, "output_rate.throttle")
    episodes = tel.histograms[("throttle_episode_seconds", ("a",))]
    assert episodes.count > 5  # every episode is in the histogram either way
    if spans_expected == "all":
        assert rec.throttle_min_ns == 0 and len(throttles) == episodes.count
    else:
        assert rec.throttle_min_ns == 150_000_000
        assert 0 < len(throttles) < episodes.count
        assert all(s.end_time - s.start_time >= 150_000_000 for s in throttles)


@pytest.mark.parametrize("writable", [True, False])
def test_offline_traces_go_to_a_json_lines_file(tmp_path, monkeypatch, writable):
    """VLLM_OUTPUT_RATE_TRACES_FILE: spans appended as JSON lines; a file
    that cannot be written is a counted export failure, the engine goes on."""
    import json

    from tracing.spans import TRACES_FILE_ENV

    path = tmp_path / ("traces.jsonl" if writable else "missing-dir/traces.jsonl")
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv(TRACES_FILE_ENV, str(path))
    drops, drv, reqs = _three_requests_with_env_traces(tmp_path)
    assert all(drv.count(r.request_id) == 8 for r in reqs)
    if writable:
        spans_ = [json.loads(line) for line in path.read_text().splitlines()]
        names = [s["name"] for s in spans_]
        assert names.count("output_rate.generation") == 3 and "output_rate.throttle" in names
        gen = next(s for s in spans_ if s["name"] == "output_rate.generation")
        assert gen["attributes"]["output_rate.tokens"] == 8
        assert drops.counts == {"trace_queue_full": 0, "trace_export_failed": 0}
    else:
        assert not path.exists()
        assert drops.counts["trace_export_failed"] >= 3 + 1  # every span, counted
