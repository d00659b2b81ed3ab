"""Spans with the real OpenTelemetry SDK and an in-memory exporter."""

from __future__ import annotations

import queue

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from harness import (Driver, VirtualClock, OtlpHttpReceiver, attach_telemetry, make_request, make_scheduler,
                     observe_steps)

from vllm_output_rate.internals import SchedulerView
from vllm_output_rate.tracing.provider import tracer_provider_from_env
from vllm_output_rate.tracing.recorder import THROTTLE_MIN_ENV, SpanRecorder
from vllm_output_rate import engine_loop


SERIES = "output_rate.spacing_series_us"
TOKENS = "gen_ai.usage.output_tokens"


def series(span) -> list[int]:
    """A generation span's spacing series (whole microseconds): an integer
    array attribute."""
    values = span.attributes[SERIES]
    assert all(type(v) is int for v in values)
    return list(values)


def limits(default, **users):
    return {"default_user_output_tokens_per_second": default,
            "user_output_tokens_per_second": users}


@pytest.fixture
def exporter():
    return InMemorySpanExporter()


def setup(tmp_path, exporter, lim, background=True, throttle_min_s=0.0, **kw):
    """A scheduler with telemetry and a span recorder on a TracerProvider
    made here (so from the OTEL_* variables set now: sampler, span limits);
    every throttle episode gets a span unless ``throttle_min_s`` (None: the
    setting's)."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    clock = VirtualClock()
    sched = make_scheduler(lim, clock=clock, **kw)
    recorder = SpanRecorder(provider.get_tracer("test"), SchedulerView(sched), clock_offset_ns=0,
                            background=background)
    if throttle_min_s is not None:
        recorder.throttle_min_ns = int(throttle_min_s * 1e9)
    _RECORDERS[:] = [recorder]
    tel = attach_telemetry(sched, str(tmp_path), start_thread=False, spans=recorder,
                           defer=_DEFER[0])
    _TELEMETRY[:] = [tel]
    return sched, Driver(sched, clock, step_ms=10.0), tel, recorder


#: recorders and telemetry made by setup(): spans() folds what the
#: telemetry was handed and builds what the recorders queued first
_RECORDERS: list[SpanRecorder] = []
_TELEMETRY: list = []
#: whether setup()'s telemetry defers its folds to a drain (as with its
#: worker thread) or folds each event at once
_DEFER = [False]


@pytest.fixture(params=[False, True], ids=["folded-at-once", "deferred"])
def telemetry_mode(request):
    """The tests that use setup() run twice: events folded as they come,
    and deferred (folded only when spans are read: the requests are gone
    from the engine by then, as they may be when the worker drains)."""
    _DEFER[0] = request.param
    yield request.param
    _DEFER[0] = False


def spans(exporter, name):
    for tel in _TELEMETRY:
        tel.drain()
    for recorder in _RECORDERS:
        recorder.flush()
    return [s for s in exporter.get_finished_spans() if s.name == name]


@pytest.mark.usefixtures("telemetry_mode")
def test_throttle_episodes_are_spans(tmp_path, exporter, monkeypatch):
    import vllm_output_rate.telemetry.engine as engine_mod

    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=10))
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    reqs = [make_request("a", prompt_len=20, max_tokens=8) for _ in range(2)]
    drv.add(*reqs)
    drv.run_until_done()
    throttles = spans(exporter, "output_rate.throttle")
    assert len(throttles) == 2
    first = throttles[0]
    attrs = first.attributes
    assert attrs["output_rate.user"] == "a"
    assert attrs["output_rate.request_id"] in {r.request_id for r in reqs}
    assert attrs["output_rate.held_kv"] is True and attrs["output_rate.kv_blocks"] >= 2
    assert attrs["output_rate.tokens_charged"] >= 1
    # two streams sharing 10 tok/s take turns (each dispatched, then
    # throttled again in the next step): pacing at the limit, one episode
    # each, from its first refusal to its last token (16 tokens: 1.5 s)
    assert all(1.2e9 <= (s.end_time - s.start_time) <= 1.6e9 for s in throttles)
    # one span per request, for its longest episode; its generation span
    # sums up all of them (the episode histogram's count)
    gens = {g.attributes["output_rate.request_id"]: g.attributes
            for g in spans(exporter, "output_rate.generation")}
    episodes = tel.histograms[("throttle_episode_seconds", ("a",))]
    assert sum(g["output_rate.throttle_episodes"] for g in gens.values()) == episodes.count == 2
    assert sum(g["output_rate.throttled_us"] for g in gens.values()) == pytest.approx(
        episodes.sum * 1e6, abs=episodes.count)
    for req in reqs:
        (mine,) = [s for s in throttles if s.attributes["output_rate.request_id"] == req.request_id]
        gen = gens[req.request_id]
        assert gen["output_rate.throttle_episodes"] == 1
        assert gen["output_rate.throttle_max_us"] == (mine.end_time - mine.start_time) // 1000
        assert gen["output_rate.throttled_us"] == gen["output_rate.throttle_max_us"]
        # the episode ends at its last token's dispatch: the request's end
        assert gen_end(gen, spans(exporter, "output_rate.generation"), req) - mine.end_time \
            <= 20e6


def gen_end(attrs, gens, req):
    (gen,) = [g for g in gens if g.attributes["output_rate.request_id"] == req.request_id]
    return gen.end_time


@pytest.mark.usefixtures("telemetry_mode")
def test_a_throttled_request_that_runs_on_ends_its_episode_at_its_dispatch(tmp_path, exporter,
                                                                          monkeypatch):
    """Three streams of a user at 150 tok/s on 10 ms steps (100 tok/s a
    stream at most) take turns; once the two short ones finished, the long
    one runs on under the limit, never throttled: its episode ended at the
    dispatch after which it was not throttled again, long before its end."""
    import vllm_output_rate.telemetry.engine as engine_mod

    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=150))
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    shorts = [make_request("a", max_tokens=12) for _ in range(2)]
    long = make_request("a", max_tokens=60)
    steps = []  # (step ns, charged ids, throttled ids)
    observe_steps(sched, lambda record: steps.append(
        (record.now_ns, set(record.charged), set(record.throttled))))
    drv.add(*shorts, long)
    drv.run_until_done()
    throttled_at = [t for t, _, thr in steps if long.request_id in thr]
    assert throttled_at  # (it did wait)
    # its last dispatch before a step that did not throttle it, after its
    # last refusal: where its episode ends
    after = [t for t, ids, _ in steps if long.request_id in ids and t > throttled_at[-1]]
    throttles = {s.attributes["output_rate.request_id"]: s
                 for s in spans(exporter, "output_rate.throttle")}
    span = throttles[long.request_id]
    assert span.end_time == after[0]
    gens = {g.attributes["output_rate.request_id"]: g for g in spans(exporter, "output_rate.generation")}
    assert gens[long.request_id].end_time - span.end_time >= 0.3e9  # it ran on
    episodes = tel.histograms[("throttle_episode_seconds", ("a",))]
    assert episodes.count == sum(g.attributes["output_rate.throttle_episodes"]
                                 for g in gens.values())


@pytest.mark.parametrize("small_books", [False, True])
@pytest.mark.usefixtures("telemetry_mode")
def test_a_user_pacing_at_its_limit_gets_one_over_limit_period(tmp_path, exporter, monkeypatch,
                                                               small_books):
    """Twelve requests of one user, five streams at a time, taking turns at
    its limit: each request is dispatched a token and throttled again in
    the next step, one throttle episode from its first refusal to its last
    token (not one per token), at most one throttle span each (past the
    default 1 s minimum); one over-limit period for the user (the start of
    its first episode to the end of its last) with its counts and the
    episodes' quantiles; each generation span has its own episode. With
    small books (episode durations cut past 8 per user and folded per
    request past 4, at every sweep) the counts, totals and longest are the
    same."""
    import vllm_output_rate.telemetry.engine as engine_mod
    from vllm_output_rate.tracing import series as series_mod, throttle as throttle_mod

    if small_books:
        _cap_series(monkeypatch, series_mod, throttle_mod, 8)
        monkeypatch.setattr(throttle_mod, "THROTTLE_FOLD_AT", 4)
        monkeypatch.setattr(throttle_mod, "BOOKS_EVERY", 1)
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=20), throttle_min_s=None,
                                 max_num_seqs=5)
    assert rec.throttle_min_ns == 1_000_000_000  # the default: 1 s
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    reqs = [make_request("a", max_tokens=10) for _ in range(12)]
    drv.add(make_request("b", max_tokens=30), *reqs)
    drv.run_until_done()
    ids = {r.request_id for r in reqs}
    throttles = spans(exporter, "output_rate.throttle")
    assert len({s.attributes["output_rate.request_id"] for s in throttles}) == len(throttles) == 12
    assert all(s.end_time - s.start_time >= 1e9 for s in throttles)
    (period,) = spans(exporter, "output_rate.over_limit")
    attrs = period.attributes
    assert attrs["output_rate.user"] == "a"
    assert attrs["output_rate.limit_tokens_per_second"] == 20.0
    gens = [g.attributes for g in spans(exporter, "output_rate.generation")
            if g.attributes["output_rate.request_id"] in ids]
    assert all(g["output_rate.throttle_episodes"] == 1 for g in gens)
    episodes = tel.histograms[("throttle_episode_seconds", ("a",))]
    assert attrs["output_rate.throttle_episodes"] == len(gens) == episodes.count == 12
    # 120 tokens at 20 tok/s with a 0.1 s burst: about 6 s; the period
    # holds the tokens after its first episode began, at the limit
    seconds = (period.end_time - period.start_time) / 1e9
    assert 5.0 <= seconds <= 6.2
    assert 100 <= attrs["output_rate.tokens_charged"] <= 120
    assert attrs["output_rate.tokens_per_second"] == pytest.approx(20, rel=0.05)
    # the user's requests waited this long in all: their generation spans'
    # totals (whole us each), within the period times its streams (five
    # slots: four and b's, then five once b is done)
    throttled = sum(g["output_rate.throttled_us"] for g in gens)
    assert abs(attrs["output_rate.throttled_us"] - throttled) <= len(gens)
    assert 3 * seconds * 1e6 < attrs["output_rate.throttled_us"] <= 5 * seconds * 1e6
    assert attrs["output_rate.throttle_max_us"] == max(g["output_rate.throttle_max_us"]
                                                       for g in gens)
    # a request's 10 tokens take turns with 4 others at 20 tok/s: about 2.5 s
    if not small_books:  # (the quantiles of the first 8 episodes otherwise)
        assert 2_000_000 <= attrs["output_rate.throttle_p50_us"] <= 2_700_000
    assert attrs["output_rate.throttle_p50_us"] <= attrs["output_rate.throttle_p99_us"] \
        <= attrs["output_rate.throttle_max_us"]
    # the user that never ran short has no period
    assert all(s.attributes["output_rate.user"] != "b"
               for s in spans(exporter, "output_rate.over_limit"))


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.usefixtures("telemetry_mode")
def test_the_end_to_end_trace_scenario_in_virtual_time(tmp_path, exporter, monkeypatch, is_async):
    """test_e2e_traces' load, exactly: user-a (20 tok/s) with three streams
    of 30 tokens beside user-b (unlimited, 60 tokens), every throttle
    episode a span. The streams take turns at the limit: one episode per
    request (not one per token), from its first refusal to its last
    token's dispatch; one over-limit period for user-a holding all three,
    the tokens charged in it and their total; each stream's tokens 3 / 20 s
    apart; user-b never throttled, a token every step."""
    import vllm_output_rate.telemetry.engine as engine_mod

    sched, drv, tel, rec = setup(tmp_path, exporter, limits(100_000, **{"user-a": 20}),
                                 max_num_seqs=16, max_model_len=1024, async_scheduling=is_async)
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    drv.is_async = is_async
    steps = []  # (now, {request: user} charged, [throttled])
    observe_steps(sched, lambda r: steps.append((r.now_ns, dict(r.charged), list(r.throttled))))
    a = [make_request("user-a", max_tokens=30) for _ in range(3)]
    b = make_request("user-b", max_tokens=60)
    drv.add(*a, b)
    drv.run_until_done()
    gens = {g.attributes["output_rate.request_id"]: g.attributes
            for g in spans(exporter, "output_rate.generation")}
    assert sorted(g[TOKENS] for g in gens.values()) == [30, 30, 30, 60]
    throttles = {s.attributes["output_rate.request_id"]: s
                 for s in spans(exporter, "output_rate.throttle")}
    assert set(throttles) == {r.request_id for r in a}
    for r in a:
        first_refused = min(t for t, _, thr in steps if r.request_id in thr)
        last_dispatch = max(t for t, charged, _ in steps if r.request_id in charged)
        span, gen = throttles[r.request_id], gens[r.request_id]
        assert (span.start_time, span.end_time) == (first_refused, last_dispatch)
        assert gen["output_rate.throttle_episodes"] == 1
        assert gen["output_rate.throttled_us"] == gen["output_rate.throttle_max_us"] == (
            last_dispatch - first_refused) // 1000
        assert gen["output_rate.spacing_p50_us"] == 150_000  # 3 streams at 20 tok/s
    assert gens[b.request_id]["output_rate.throttle_episodes"] == 0
    assert gens[b.request_id]["output_rate.spacing_p50_us"] == 10_000  # every step
    (period,) = spans(exporter, "output_rate.over_limit")
    pa = period.attributes
    assert pa["output_rate.user"] == "user-a" and pa["output_rate.limit_tokens_per_second"] == 20
    episodes = tel.histograms[("throttle_episode_seconds", ("user-a",))]
    assert pa["output_rate.throttle_episodes"] == episodes.count == 3
    assert abs(pa["output_rate.throttled_us"]
               - sum(gens[r.request_id]["output_rate.throttled_us"] for r in a)) <= 3
    # the period: the first refusal to the last episode's end; its tokens
    # those charged after it began
    assert period.start_time == min(t for t, _, thr in steps if thr)
    assert period.end_time == max(s.end_time for s in throttles.values())
    def a_tokens(keep):
        return sum(1 for t, charged, _ in steps if keep(t)
                   for user in charged.values() if user == "user-a")

    inside = a_tokens(lambda t: period.start_time < t < period.end_time)
    assert inside <= pa["output_rate.tokens_charged"] <= inside + a_tokens(
        lambda t: t == period.end_time)  # (the closing dispatch's token or not)


@pytest.mark.usefixtures("telemetry_mode")
def test_an_over_limit_period_ends_when_demand_falls_under_the_limit(tmp_path, exporter,
                                                                  monkeypatch):
    """Two periods for a user whose second burst of demand comes after a
    quiet spell longer than PERIOD_QUIET_S, while another user keeps the
    engine busy (no idle in between)."""
    import vllm_output_rate.telemetry.engine as engine_mod

    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=20), throttle_min_s=None)
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    drv.add(make_request("b", max_tokens=600))
    drv.add(*[make_request("a", max_tokens=10) for _ in range(3)])
    drv.run(320)  # a's 30 tokens take about 1.5 s; then over 1.5 s quiet
    drv.add(*[make_request("a", max_tokens=10) for _ in range(3)])
    drv.run_until_done()
    periods = sorted(spans(exporter, "output_rate.over_limit"), key=lambda s: s.start_time)
    assert [p.attributes["output_rate.user"] for p in periods] == ["a", "a"]
    assert periods[0].end_time < periods[1].start_time


@pytest.mark.usefixtures("telemetry_mode")
def test_generation_span_carries_the_spacing_series(tmp_path, exporter, monkeypatch):
    import vllm_output_rate.telemetry.engine as engine_mod

    sched, drv, tel, rec = setup(tmp_path, exporter, limits(20))
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    req = make_request("a", max_tokens=12)
    drv.add(req)
    drv.run_until_done()
    (gen,) = spans(exporter, "output_rate.generation")
    times = [t for _, t in drv.tokens[req.request_id]]
    assert series(gen) == [(b - a) // 1000 for a, b in zip(times, times[1:])]
    assert gen.attributes[TOKENS] == 12
    assert gen.attributes["output_rate.spacing_p50_us"] == pytest.approx(50_000, abs=10_000)


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


def test_no_tracing_without_configuration(monkeypatch):
    for var in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert tracer_provider_from_env(None) is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert tracer_provider_from_env(None) is not None


TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def traceparent(trace_id=TRACE_ID, span_id=PARENT_ID, flags="01"):
    return f"00-{trace_id}-{span_id}-{flags}"


def by_request(span_list):
    out = {}
    for s in span_list:
        out.setdefault(s.attributes["output_rate.request_id"], []).append(s)
    return out


@pytest.mark.usefixtures("telemetry_mode")
def test_spans_of_a_request_with_a_traceparent_are_children_of_its_trace(tmp_path, exporter,
                                                                         monkeypatch):
    """A request with a valid traceparent: its throttle episodes and its
    generation span are children of that span (same trace id, the header's
    span as parent, its tracestate carried), not links; a request without
    one, or with a broken one, keeps spans of their own. The header is
    parsed by the span builder, not on the scheduler's thread."""
    import vllm_output_rate.telemetry.engine as engine_mod

    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=10), background=False)
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    child, plain, broken = (make_request("a", max_tokens=8) for _ in range(3))
    child.trace_headers = {"traceparent": traceparent(), "tracestate": "vendor=x"}
    broken.trace_headers = {"traceparent": "00-not-a-trace-01"}
    drv.add(child, plain, broken)
    drv.run_until_done()
    contexts = rec.generation.emitter._contexts
    assert not exporter.get_finished_spans() and not contexts  # nothing parsed yet
    throttles = by_request(spans(exporter, "output_rate.throttle"))
    gens = by_request(spans(exporter, "output_rate.generation"))
    for req in (child, plain, broken):
        assert throttles[req.request_id] and len(gens[req.request_id]) == 1
    for s in throttles[child.request_id] + gens[child.request_id]:
        assert format(s.context.trace_id, "032x") == TRACE_ID
        assert s.parent is not None and s.parent.is_remote
        assert format(s.parent.span_id, "016x") == PARENT_ID
        assert s.context.trace_state.get("vendor") == "x"
        assert not s.links
    others = throttles[plain.request_id] + gens[plain.request_id] + throttles[
        broken.request_id] + gens[broken.request_id]
    assert all(s.parent is None and not s.links for s in others)
    assert all(format(s.context.trace_id, "032x") != TRACE_ID for s in others)
    assert len({s.context.trace_id for s in others}) == len(others)  # each its own trace
    assert len(contexts) == 2  # parsed once per distinct header


@pytest.mark.parametrize("sampler", [None, "always_on"])
@pytest.mark.usefixtures("telemetry_mode")
def test_a_parent_that_is_not_sampled_is_followed_unless_the_sampler_says_otherwise(
        tmp_path, exporter, monkeypatch, sampler):
    """traceparent flags 00 (the caller did not sample): with the SDK's
    default parent-based sampler the request's spans are not recorded (the
    other requests' are); OTEL_TRACES_SAMPLER=always_on keeps them, still
    in the caller's trace."""
    if sampler is None:
        monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    else:
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=10))
    quiet, other = make_request("a", max_tokens=6), make_request("a", max_tokens=6)
    quiet.trace_headers = {"traceparent": traceparent(flags="00")}
    drv.add(quiet, other)
    drv.run_until_done()
    gens = by_request(spans(exporter, "output_rate.generation"))
    throttles = by_request(spans(exporter, "output_rate.throttle"))
    assert gens[other.request_id] and throttles[other.request_id]
    if sampler is None:
        assert quiet.request_id not in gens and quiet.request_id not in throttles
    else:
        (gen,) = gens[quiet.request_id]
        assert format(gen.context.trace_id, "032x") == TRACE_ID
        assert format(gen.parent.span_id, "016x") == PARENT_ID


@pytest.mark.parametrize("source", [None, "header", "api_key"])
@pytest.mark.usefixtures("telemetry_mode")
def test_spans_carry_the_genai_attributes_and_user_id_only_when_trusted(
        tmp_path, exporter, monkeypatch, source):
    """GenAI conventions with vLLM's names: gen_ai.request.id is the id the
    client and vLLM's llm_request span know (the engine's id without
    vLLM's random suffix), gen_ai.response.model, gen_ai.usage.output_tokens,
    gen_ai.response.finish_reasons; user.id only when the API server vouched
    for the user (header or API key), output_rate.user always."""
    import vllm_output_rate.telemetry.engine as engine_mod
    from vllm_output_rate.config import TRUSTED_FIELD

    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=10))
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    reqs = [make_request("a", max_tokens=6, req_id=f"chatcmpl-{i}-0123abc{i}") for i in range(2)]
    if source is not None:
        for r in reqs:
            r.sampling_params.extra_args[TRUSTED_FIELD] = source
    drv.add(*reqs)
    drv.run_until_done()
    gens = by_request(spans(exporter, "output_rate.generation"))
    throttles = by_request(spans(exporter, "output_rate.throttle"))
    model = SchedulerView(sched).model_name
    assert model
    for i, r in enumerate(reqs):
        (gen,) = gens[r.request_id]
        a = gen.attributes
        assert a["gen_ai.request.id"] == f"chatcmpl-{i}"
        assert a["output_rate.request_id"] == r.request_id
        assert a["gen_ai.response.model"] == model
        assert a["gen_ai.usage.output_tokens"] == 6 == a["output_rate.tokens_charged"]
        assert a["gen_ai.response.finish_reasons"] == ("length",)
        assert "output_rate.tokens" not in a and "output_rate.finish_reason" not in a
        for s in [gen] + throttles[r.request_id]:
            a = s.attributes
            assert a["gen_ai.request.id"] == f"chatcmpl-{i}"
            assert a["output_rate.user"] == "a"
            if source is None:  # the body named the user: no identity
                assert "user.id" not in a and "output_rate.identity_source" not in a
            else:
                assert a["user.id"] == "a" and a["output_rate.identity_source"] == source
    names = {k for s in exporter.get_finished_spans() for k in s.attributes}
    assert all(k.startswith("output_rate.") or k in GENAI_NAMES for k in names), names


#: the only attribute names outside the project's namespace
GENAI_NAMES = {"gen_ai.request.id", "gen_ai.response.model", "gen_ai.usage.output_tokens",
               "gen_ai.response.finish_reasons", "user.id"}


@pytest.mark.usefixtures("telemetry_mode")
def test_a_shared_budget_keeps_the_callers_user_id(tmp_path, exporter):
    """In "shared" mode an unlisted user spends the one __unlisted__ budget
    (output_rate.user); user.id, when trusted, is still the caller."""
    from vllm_output_rate.config import TRUSTED_FIELD

    sched, drv, tel, rec = setup(tmp_path, exporter,
                                 {**limits(1000, a=10), "unlisted_users": "shared"})
    req = make_request("someone", max_tokens=3)
    req.sampling_params.extra_args[TRUSTED_FIELD] = "header"
    drv.add(req)
    drv.run_until_done()
    (gen,) = spans(exporter, "output_rate.generation")
    assert gen.attributes["output_rate.user"] == "__unlisted__"
    assert gen.attributes["output_rate.identity_source"] == "header"
    assert gen.attributes["user.id"] == "someone"


def test_external_request_id_is_vllms_client_facing_id(monkeypatch):
    from vllm_output_rate.tracing.attributes import external_request_id

    assert external_request_id("chatcmpl-abc-0123abcd") == "chatcmpl-abc"
    assert external_request_id("cmpl-9f2e4c1a7b3d4e5f-deadbeef") == "cmpl-9f2e4c1a7b3d4e5f"
    assert external_request_id("my-id") == "my-id"  # no suffix of vLLM's: as it is
    assert external_request_id("chatcmpl-abc-0123abcd", randomized=False) == "chatcmpl-abc-0123abcd"
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    rec = SpanRecorder(None, None, clock_offset_ns=0, background=False)
    assert rec.generation.emitter.randomized_ids is False


@pytest.mark.usefixtures("telemetry_mode")
def test_the_spacing_series_survives_the_attribute_value_length_limit(tmp_path, exporter,
                                                                      monkeypatch):
    """OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT (read by the TracerProvider's
    SpanLimits) cuts string values, here to 16 characters: the series is an
    integer array and stays whole."""
    import vllm_output_rate.telemetry.engine as engine_mod

    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "16")
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(20))
    assert rec.generation.emitter.tracer._span_limits.max_attribute_length == 16
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    user = "a-user-with-a-rather-long-id"
    req = make_request(user, max_tokens=40)
    drv.add(req)
    drv.run_until_done()
    (gen,) = spans(exporter, "output_rate.generation")
    assert gen.attributes["output_rate.user"] == user[:16]  # the limit is in force
    times = [t for _, t in drv.tokens[req.request_id]]
    assert series(gen) == [(b - a) // 1000 for a, b in zip(times, times[1:])]
    assert len(series(gen)) == 39 and gen.attributes["output_rate.spacing_series_truncated"] is False


@pytest.mark.usefixtures("telemetry_mode")
def test_client_abort_mid_throttle_ends_the_episode_and_the_generation(tmp_path, exporter,
                                                                      monkeypatch):
    import vllm_output_rate.telemetry.engine as engine_mod
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
    assert all(s.attributes["gen_ai.response.finish_reasons"] == ("abort",) for s in gens)
    assert all(0 < s.attributes[TOKENS] < 50 for s in gens)
    # one throttle span each: the two streams took turns at the limit, one
    # episode each over their pacing, ended by the abort, with the KV blocks
    # they held while they waited
    throttles = spans(exporter, "output_rate.throttle")
    assert sorted(s.attributes["output_rate.request_id"] for s in throttles) == sorted(
        r.request_id for r in reqs)
    assert {s.attributes["output_rate.outcome"] for s in throttles} == {"aborted"}
    assert all(s.attributes["output_rate.held_kv"] and s.attributes["output_rate.kv_blocks"] > 0
               for s in throttles)
    assert all(g.attributes["output_rate.throttle_episodes"] == 1 for g in gens)
    assert not tel._open_held and not tel._episodes
    assert not rec.throttle._throttle_ns and not rec.throttle._throttle_books
    assert not rec.generation.series._series and not rec.generation.series._overflow


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
    from vllm_output_rate.tracing.drops import TraceDrops, counting_processor

    drops = TraceDrops(max_queue)
    provider = TracerProvider()
    provider.add_span_processor(counting_processor(exporter, drops))
    return provider, drops


@pytest.mark.parametrize("raise_instead", [False, True])
def test_failed_exports_are_counted_and_reach_the_metrics(tmp_path, raise_instead):
    provider, drops = _counting_provider(_FailingExporter(raise_instead))
    clock = VirtualClock()
    sched = make_scheduler(limits(1000, a=10), clock=clock)
    recorder = SpanRecorder(provider.get_tracer("test"), SchedulerView(sched), clock_offset_ns=0)
    recorder.drops, recorder.provider = drops, provider
    tel = attach_telemetry(sched, str(tmp_path), start_thread=False, spans=recorder)
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


def _three_requests_with_env_traces(tmp_path, also_to=None):
    """Three requests of a limited user (the first with a traceparent)
    through a scheduler whose spans go where the OTEL_* / project variables
    say, as the engine core builds them, and to the exporter ``also_to``
    if given; the recorder shut down (everything exported). (drops, driver,
    requests)."""
    from vllm_output_rate.tracing.drops import TraceDrops
    from vllm_output_rate.tracing.provider import tracer_from

    drops = TraceDrops(2048)
    provider = tracer_provider_from_env(None, drops)
    assert provider is not None
    if also_to is not None:
        provider.add_span_processor(SimpleSpanProcessor(also_to))
    clock = VirtualClock()
    sched = make_scheduler(limits(1000, a=10), clock=clock)
    recorder = SpanRecorder(tracer_from(provider), SchedulerView(sched), clock_offset_ns=0)
    recorder.drops, recorder.provider = drops, provider
    attach_telemetry(sched, str(tmp_path), start_thread=False, spans=recorder)
    drv = Driver(sched, clock, step_ms=10.0)
    reqs = [make_request("a", max_tokens=8) for _ in range(3)]
    reqs[0].trace_headers = {"traceparent": traceparent()}
    drv.add(*reqs)
    drv.run_until_done()
    recorder.shutdown(timeout_s=10)
    return drops, drv, reqs


def test_spans_reach_a_real_otlp_http_receiver(tmp_path, monkeypatch):
    """The real OTLP/HTTP exporter, configured by OTEL_* variables, against a
    receiver on loopback that decodes the protobuf requests."""
    receiver = OtlpHttpReceiver()
    try:
        monkeypatch.setenv(THROTTLE_MIN_ENV, "0")  # a span per throttle episode
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
    assert gen[TOKENS].int_value == 8
    assert drops.counts == {"trace_queue_full": 0, "trace_export_failed": 0}


def _clear_otel_env(monkeypatch):
    for var in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("service", [
    pytest.param({}, id="defaults"),
    pytest.param({"OTEL_SERVICE_NAME": "llm-gold"}, id="OTEL_SERVICE_NAME"),
    pytest.param({"OTEL_RESOURCE_ATTRIBUTES": "service.name=llm-eu,service.version=7,deployment.environment=prod"},
                 id="OTEL_RESOURCE_ATTRIBUTES"),
])
def test_a_base_endpoint_gets_the_traces_path_and_the_service_comes_from_the_environment(
        tmp_path, monkeypatch, service):
    """OTEL_EXPORTER_OTLP_ENDPOINT is a base URL: over http/protobuf spans go
    to its /v1/traces (at a real receiver); service.name / service.version
    come from the standard variables, ours only where they give none."""
    from importlib import metadata

    _clear_otel_env(monkeypatch)
    for name, value in service.items():
        monkeypatch.setenv(name, value)
    receiver = OtlpHttpReceiver()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.base_url)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        drops, _drv, _reqs = _three_requests_with_env_traces(tmp_path)
    finally:
        receiver.close()
    assert receiver.paths and set(receiver.paths) == {"/v1/traces"}
    assert [n for n, _ in receiver.spans].count("output_rate.generation") == 3
    resource = receiver.resources[0]
    want_name = {"OTEL_SERVICE_NAME": "llm-gold", "OTEL_RESOURCE_ATTRIBUTES": "llm-eu"}
    # unset: the SDK's default, what vLLM's own tracer provider carries too
    assert resource["service.name"] == next(
        (want_name[k] for k in service), "unknown_service:python")
    if "OTEL_RESOURCE_ATTRIBUTES" in service:
        assert resource["service.version"] == "7" and resource["deployment.environment"] == "prod"
    else:  # this package's version is its tracer's, not the service's
        assert "service.version" not in resource
    assert {v for _n, v in receiver.scopes} == {metadata.version("vllm-output-rate")}
    assert drops.counts == {"trace_queue_full": 0, "trace_export_failed": 0}


@pytest.mark.parametrize("service_name", [None, "llm-gold"])
def test_our_spans_and_vllms_own_land_in_one_service(monkeypatch, service_name):
    """vLLM's own tracer (``vllm.tracing.init_tracer``) and ours, in one
    process, export to one receiver: one service.name and one
    service.instance.id, with or without OTEL_SERVICE_NAME."""
    import os
    import subprocess
    import sys

    _clear_otel_env(monkeypatch)
    receiver = OtlpHttpReceiver()
    env = {**os.environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    if service_name:
        env["OTEL_SERVICE_NAME"] = service_name
    script = ("import sys\n"
              "from opentelemetry.trace import get_tracer_provider\n"
              "from vllm.tracing import init_tracer\n"
              "from vllm_output_rate.tracing.provider import tracer_from, tracer_provider_from_env\n"
              "init_tracer('vllm.llm_engine', sys.argv[1]).start_span('vllm').end()\n"
              "ours = tracer_provider_from_env(sys.argv[1])\n"
              "tracer_from(ours).start_span('ours').end()\n"
              "ours.shutdown()\n"
              "get_tracer_provider().shutdown()\n")
    try:
        run = subprocess.run([sys.executable, "-c", script, receiver.url], env=env,
                             capture_output=True, text=True, timeout=300)
    finally:
        receiver.close()
    assert run.returncode == 0, run.stderr
    assert sorted(n for n, _ in receiver.spans) == ["ours", "vllm"]
    assert len(receiver.resources) == 2
    vllm_res, ours_res = sorted(receiver.resources, key=lambda r: "vllm.process_id" in r, reverse=True)
    assert "vllm.process_id" in vllm_res and "vllm.process_id" not in ours_res
    for key in ("service.name", "service.instance.id"):
        assert ours_res[key] == vllm_res[key], key
    assert ours_res["service.name"] == (service_name or "unknown_service:python")


def test_a_comma_separated_exporter_list_exports_to_each(monkeypatch):
    """OTEL_TRACES_EXPORTER=otlp,console: every span to a real receiver and
    to the console (in a process of its own, whose stdout is the console)."""
    import os
    import subprocess
    import sys

    _clear_otel_env(monkeypatch)
    receiver = OtlpHttpReceiver()
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "otlp, console",
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    script = ("from vllm_output_rate.tracing.provider import tracer_from, tracer_provider_from_env\n"
              "p = tracer_provider_from_env(None)\n"
              "t = tracer_from(p)\n"
              "for i in range(3):\n"
              "    t.start_span('probe').end()\n"
              "p.shutdown()\n")
    try:
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=120)
    finally:
        receiver.close()
    assert run.returncode == 0, run.stderr
    assert run.stdout.count('"name": "probe"') == 3
    assert [n for n, _ in receiver.spans] == ["probe"] * 3
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console,none")
    assert tracer_provider_from_env(None) is None  # none wins


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


def _cap_series(monkeypatch, series_mod, throttle_mod, cap):
    """The spacing series, and the episode durations kept per over-limit
    period, cut past ``cap``."""
    monkeypatch.setattr(series_mod, "MAX_SERIES", cap)
    monkeypatch.setattr(throttle_mod, "MAX_SERIES", cap)


@pytest.mark.usefixtures("telemetry_mode")
def test_generation_series_is_capped_and_the_token_count_is_not(tmp_path, exporter, monkeypatch):
    import vllm_output_rate.telemetry.engine as engine_mod
    from vllm_output_rate.tracing import series as series_mod, throttle as throttle_mod

    _cap_series(monkeypatch, series_mod, throttle_mod, 16)
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(100_000))
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    drv.add(make_request("a", max_tokens=40))
    drv.run_until_done()
    (gen,) = spans(exporter, "output_rate.generation")
    assert gen.attributes[TOKENS] == 40
    assert gen.attributes["output_rate.spacing_series_truncated"] is True
    assert len(series(gen)) == 16
    assert not rec.generation.series._overflow


@pytest.mark.usefixtures("telemetry_mode")
def test_a_long_generation_series_stays_bounded_while_it_runs(tmp_path, exporter, monkeypatch):
    """Steady tokens are not appended per request: the timeline of update
    spacings and the open runs hold them, and every TRIM_EVERY updates the
    series past the cap are cut and the timeline is cut to the oldest open
    run; both stay bounded while the request runs, and the count is exact."""
    import vllm_output_rate.telemetry.engine as engine_mod
    from vllm_output_rate.tracing import series as series_mod, throttle as throttle_mod

    _cap_series(monkeypatch, series_mod, throttle_mod, 16)
    monkeypatch.setattr(series_mod, "TRIM_EVERY", 8)
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(100_000))
    book = rec.generation.series
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    req = make_request("a", max_tokens=120)
    drv.add(req)
    longest = timeline = 0
    for _ in range(119):
        drv.step()
        tel.drain()  # (deferred: the telemetry's worker folds the step)
        rec.flush()  # (the builder keeps the series)
        longest = max(longest, len(book._series.get(req.request_id, ())))
        timeline = max(timeline, len(book._gaps))
        if req.request_id in book._series:  # every token so far, kept or not
            assert book.spacings(req.request_id) == drv.count(req.request_id) - 1
    assert longest == 16  # cut back to the cap while running
    assert 16 < timeline <= 16 + 2 * 8  # the timeline was cut too
    drv.run_until_done()
    (gen,) = spans(exporter, "output_rate.generation")
    assert gen.attributes[TOKENS] == 120
    assert len(series(gen)) == 16
    assert not book._overflow and not book._series and not book._runs
    # a request that is never steady (its tokens come one by one after pauses)
    for i in range(100):
        book.on_tokens("paused", 1, None if i == 0 else i * 1000, i * 1000 + 500)
        book.on_zeros("paused", 2)
        assert len(book._series["paused"]) <= 16 + 8 + 2
    rec.on_aborted([("paused", "a")], 200_000)
    gen = [s for s in spans(exporter, "output_rate.generation")
           if s.attributes["output_rate.request_id"] == "paused"]
    assert gen[0].attributes[TOKENS] == 300


@pytest.mark.parametrize("cap", [10_000, 5])
@pytest.mark.usefixtures("telemetry_mode")
def test_generation_series_equal_the_delivered_spacings(tmp_path, exporter, monkeypatch, cap):
    """Steady runs, pauses at the limit, resumptions, two tokens in one
    update, aborts, and the timeline cut every 3 updates while runs are
    open: every generation span's series is the spacings of the tokens its
    request delivered (the first ``cap`` of them), its count exact."""
    import itertools
    from collections import deque

    import vllm_output_rate.telemetry.engine as engine_mod
    from vllm_output_rate.tools.common import scheduler_driver

    from vllm_output_rate.tracing import series as series_mod, throttle as throttle_mod
    from vllm.v1.request import RequestStatus

    _cap_series(monkeypatch, series_mod, throttle_mod, cap)
    monkeypatch.setattr(series_mod, "TRIM_EVERY", 3)
    plain = scheduler_driver.model_output_for

    calls = itertools.count()

    def sometimes_two(scheduler, out, token=scheduler_driver.SAMPLED_TOKEN):
        mro = plain(scheduler, out, token)
        n = next(calls)
        for i, _req_id in enumerate(mro.req_ids):  # a second token now and then
            if mro.sampled_token_ids[i] and (n + i) % 7 == 0:
                mro.sampled_token_ids[i] = [token, token]
        return mro

    monkeypatch.setattr(scheduler_driver, "model_output_for", sometimes_two)
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=30, b=70))
    book = rec.generation.series
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    users = ["a", "a", "a", "b", "b", "c", "c", "d"]
    reqs = [make_request(u, max_tokens=20 + 7 * i) for i, u in enumerate(users)]
    drv.add(*reqs)
    recent = deque(maxlen=4)
    for step in range(2000):
        if not sched.has_requests():
            break
        rec.flush()  # (its builder thread may be mid-replay: build here, then read)
        open_runs = list(book._runs.values())
        drv.step()
        if step == 30:
            sched.finish_requests([reqs[1].request_id, reqs[5].request_id],
                                  RequestStatus.FINISHED_ABORTED)
        rec.flush()
        # the timeline holds no more than the runs open in the last 3
        # updates (it is cut every 3) need
        recent.append(min(open_runs + list(book._runs.values()), default=book._index))
        assert len(book._gaps) <= book._index - min(recent) + 1
    gens = {s.attributes["output_rate.request_id"]: s for s in spans(exporter, "output_rate.generation")}
    assert set(gens) == {r.request_id for r in reqs}
    twos = 0
    for r in reqs:
        times = [t for _, t in drv.tokens[r.request_id]]
        want = [(b - a) // 1000 for a, b in zip(times, times[1:])]
        twos += want.count(0)
        attrs = gens[r.request_id].attributes
        assert series(gens[r.request_id]) == want[:cap]
        assert attrs[TOKENS] == len(times)
        assert attrs["output_rate.spacing_series_truncated"] == (len(want) >= cap)
    assert twos > 3  # the two-token updates did happen
    assert not book._series and not book._runs and not book._overflow and not rec.generation._who


def test_spans_are_built_off_the_schedulers_thread_with_a_bounded_counted_queue(tmp_path, exporter):
    """The scheduler's thread only queues plain data: no SDK span exists
    until the builder (here: flush) runs; past the queue's bound spans are
    dropped and counted, and a span that cannot be built is counted while
    the rest are built."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    clock = VirtualClock()
    sched = make_scheduler(limits(1000, a=20), clock=clock)
    rec = SpanRecorder(provider.get_tracer("test"), SchedulerView(sched), clock_offset_ns=0, background=False)
    rec.drops.max_queue = 6
    attach_telemetry(sched, str(tmp_path), start_thread=False, spans=rec)
    drv = Driver(sched, clock, step_ms=10.0)
    drv.add(*[make_request("a", max_tokens=6) for _ in range(4)])
    drv.run_until_done()
    assert not exporter.get_finished_spans()  # nothing built on the scheduler's thread
    queued, dropped = len(rec._pending), rec.drops.counts["trace_queue_full"]
    assert queued == 6 and dropped > 0
    broken = rec._pending[0]
    assert broken[0].__name__.lstrip("_").startswith(("build_", "replay_"))
    rec._pending[0] = (lambda: 1 / 0, ())
    rec.flush()  # a broken entry is counted, the rest go on
    assert rec.drops.counts["trace_export_failed"] == 1
    assert not rec._pending
    # every update and step with something for the builder: all accounted
    # for, queued or dropped
    assert dropped + queued >= drv.steps


@pytest.mark.parametrize("raw, spans_expected", [("0.15", "long only"), ("0", "all"),
                                                   ("bad", "default"), ("-1", "default")])
@pytest.mark.usefixtures("telemetry_mode")
def test_throttle_spans_only_for_episodes_past_the_minimum(tmp_path, exporter, monkeypatch, raw,
                                                          spans_expected):
    import vllm_output_rate.telemetry.engine as engine_mod

    monkeypatch.setenv(THROTTLE_MIN_ENV, raw)
    sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=10), throttle_min_s=None)
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    # two short streams and a long one take turns at 10 tok/s (pacing: one
    # episode each): the short ones' last under 1 s, the long one's 2 s
    drv.add(*[make_request("a", max_tokens=n) for n in (3, 3, 22)])
    drv.run_until_done()
    throttles = spans(exporter, "output_rate.throttle")
    episodes = tel.histograms[("throttle_episode_seconds", ("a",))]
    assert episodes.count == 3  # every episode is in the histogram either way
    long = [s for s in throttles if s.end_time - s.start_time >= 1_500_000_000]
    if spans_expected == "all":  # every throttled request: its longest episode
        assert rec.throttle_min_ns == 0 and len(throttles) == 3 and len(long) == 1
    elif spans_expected == "default":  # (a bad value: the default, 1 s)
        assert rec.throttle_min_ns == 1_000_000_000 and throttles == long and len(long) == 1
    else:
        assert rec.throttle_min_ns == 150_000_000
        assert 1 <= len(throttles) <= 3
        assert all(s.end_time - s.start_time >= 150_000_000 for s in throttles)


def _any_value(value):
    """An OTLP AnyValue as the SDK holds attribute values (arrays as tuples)."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_any_value(v) for v in value.array_value.values)
    return getattr(value, kind)


def _from_otlp_json(line: str):
    """One line of the traces file back into an ExportTraceServiceRequest:
    the ids are hex there (OTLP/JSON), base64 in protobuf's own JSON
    mapping, which json_format.Parse reads (and refuses unknown fields)."""
    import base64
    import json
    import re

    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    doc = json.loads(line)
    assert set(doc) == {"resourceSpans"}
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                assert isinstance(span["kind"], int)  # enums as integers
                assert isinstance(span["startTimeUnixNano"], str)  # int64 as a string
                for obj in [span, *span.get("links", ())]:
                    for field, digits in (("traceId", 32), ("spanId", 16), ("parentSpanId", 16)):
                        if field in obj:
                            assert re.fullmatch(f"[0-9a-f]{{{digits}}}", obj[field]), obj[field]
                            obj[field] = base64.b64encode(bytes.fromhex(obj[field])).decode()
    return json_format.Parse(json.dumps(doc), ExportTraceServiceRequest())


@pytest.mark.parametrize("writable", [True, False])
def test_offline_traces_are_an_otlp_json_file(tmp_path, monkeypatch, writable):
    """OUTPUT_RATE_TRACES_FILE: every line one ExportTraceServiceRequest in
    OTLP/JSON (lowerCamelCase, hex ids, integer enums), as the Collector's
    otlpjsonfile receiver reads it; parsed back it holds exactly the spans
    the SDK made (names, ids, parents, times, attributes including the
    integer series). A file that cannot be written is a counted export
    failure, the engine goes on."""
    from importlib import metadata

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from vllm_output_rate.tracing.provider import TRACES_FILE_ENV

    path = tmp_path / ("traces.jsonl" if writable else "missing-dir/traces.jsonl")
    _clear_otel_env(monkeypatch)
    monkeypatch.setenv(TRACES_FILE_ENV, str(path))
    monkeypatch.setenv(THROTTLE_MIN_ENV, "0")  # a span per throttle episode
    made = InMemorySpanExporter()
    drops, drv, reqs = _three_requests_with_env_traces(tmp_path, also_to=made)
    assert all(drv.count(r.request_id) == 8 for r in reqs)
    if not writable:
        assert not path.exists()
        assert drops.counts["trace_export_failed"] >= 3 + 1  # every span, counted
        return
    assert drops.counts == {"trace_queue_full": 0, "trace_export_failed": 0}
    lines = path.read_text().splitlines()
    assert lines
    got = {}
    for line in lines:
        request = _from_otlp_json(line)
        for rs in request.resource_spans:
            resource = {a.key: _any_value(a.value) for a in rs.resource.attributes}
            assert resource["service.name"] == "unknown_service:python"
            for ss in rs.scope_spans:
                assert ss.scope.name == "vllm_output_rate"
                assert ss.scope.version == metadata.version("vllm-output-rate")
                for span in ss.spans:
                    got[span.span_id] = span
    sdk = {s.context.span_id.to_bytes(8, "big"): s for s in made.get_finished_spans()}
    assert set(got) == set(sdk)  # every span, once
    for span_id, span in got.items():
        want = sdk[span_id]
        assert span.name == want.name
        assert span.trace_id == want.context.trace_id.to_bytes(16, "big")
        assert span.parent_span_id == (
            want.parent.span_id.to_bytes(8, "big") if want.parent else b"")
        assert (span.start_time_unix_nano, span.end_time_unix_nano) == (want.start_time,
                                                                        want.end_time)
        assert {a.key: _any_value(a.value) for a in span.attributes} == dict(want.attributes)
    names = [s.name for s in got.values()]
    assert names.count("output_rate.generation") == 3 and "output_rate.throttle" in names
    child = [s for s in got.values() if s.attributes and any(
        a.key == "output_rate.request_id" and a.value.string_value == reqs[0].request_id
        for a in s.attributes)]
    assert {s.name for s in child} == {"output_rate.generation", "output_rate.throttle"}
    assert all(s.trace_id.hex() == TRACE_ID and s.parent_span_id.hex() == PARENT_ID
               for s in child)
    gen = next(s for s in child if s.name == "output_rate.generation")
    attrs = {a.key: a.value for a in gen.attributes}
    assert attrs["gen_ai.usage.output_tokens"].int_value == 8
    values = attrs["output_rate.spacing_series_us"].array_value.values
    assert len(values) == 7 and all(v.WhichOneof("value") == "int_value" for v in values)


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


@pytest.mark.parametrize("mode", ["hashed", "off"])
def test_span_ids_follow_the_user_label_mode(tmp_path, exporter, monkeypatch, mode):
    """user.id (trusted only, as before) and output_rate.user are hashed
    like the label, or left out with ``off``."""
    import json

    from vllm_output_rate import user_label
    from vllm_output_rate.config import TRUSTED_FIELD

    salt = tmp_path / "salt"
    salt.write_bytes(b"0123456789abcdef-salt")
    for name, value in user_label.child_settings(mode, str(salt) if mode == "hashed" else None).items():
        monkeypatch.setenv(name, value)
    user_label.forget()
    try:
        sched, drv, tel, rec = setup(tmp_path, exporter, limits(1000, a=10))
        req = make_request("alice", max_tokens=3)
        req.sampling_params.extra_args[TRUSTED_FIELD] = "api_key"
        drv.add(req)
        drv.run_until_done()
    finally:
        user_label.forget()
    (gen,) = spans(exporter, "output_rate.generation")
    if mode == "hashed":
        label = user_label.hashed("alice", b"0123456789abcdef-salt")
        assert gen.attributes["user.id"] == gen.attributes["output_rate.user"] == label
    else:
        assert "user.id" not in gen.attributes and "output_rate.user" not in gen.attributes
    assert "alice" not in json.dumps({k: str(v) for k, v in gen.attributes.items()})
