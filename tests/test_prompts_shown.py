"""A user's prompt work, shown (issue 48 item 3): what the real vLLM
scheduler reports of it, step by step, in virtual time.

- Every user's prompt tokens computed are reported per step (budgeted or
  not), prefix-cache hits not among them, a chunk not dispatched not
  counted: over a run they add up to the prompts' lengths.
- A prompt put off is reported once per request and reason: by its user's
  prompt budget (``prompt_rate``), or just in time (its user out of output
  budget), with the tokens it had left to compute; with
  ``--output-rate-prefill-ahead`` nothing is put off just in time.
- The step's make-up (tokens and requests scheduled) is vLLM's own.
- The telemetry's per-user series of them (``telemetry.prompt_work``):
  computed and put-off tokens equal to the step reports, with exact engine
  totals and the capped user label; each step's measured time split by the
  step-time model between users' prompts.
"""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from harness import (
    Driver,
    VirtualClock,
    attach_telemetry,
    make_request,
    make_scheduler,
    observe_steps,
)
from vllm_output_rate.telemetry.clock import Clock
from vllm_output_rate.telemetry.labels import OTHER
from vllm_output_rate.telemetry.prompt_work import ESTIMATE, StepCost, load_step_cost

MODES = [False, True]


def limits(default, prompt_rates=None, prefill_ahead=False, **users):
    lim = {"default_user_output_tokens_per_second": default,
           "user_output_tokens_per_second": users}
    if prompt_rates:
        lim["prompt_rates"] = {u: str(r) for u, r in prompt_rates.items()}
    if prefill_ahead:
        lim["prefill_ahead"] = True
    return lim


class DriverClock(Clock):
    """The telemetry's monotonic clock: the driver's virtual one (as the
    twin's, and as the engine's are the same system clock)."""

    def __init__(self, clock) -> None:
        self.monotonic_ns = clock


def setup(lim, is_async=False, tel_dir=None, top_k=100, step_cost=None, **kw):
    clock = VirtualClock()
    sched = make_scheduler(lim, clock=clock, async_scheduling=is_async, **kw)
    if tel_dir is not None:
        attach_telemetry(sched, str(tel_dir), top_k=top_k, start_thread=False,
                         step_cost=step_cost, clock=DriverClock(clock))
    reports = []
    observe_steps(sched, reports.append)
    return sched, Driver(sched, clock, step_ms=10.0, is_async=is_async), reports


def telemetry_of(sched):
    return sched.output_rate.observer.inner


def counters_of(tel, name):
    """labels -> value of every series of counter ``name``."""
    return {labels: v for (n, labels), v in tel.counters.items() if n == name}


def computed(reports, user):
    return sum(r.prompt_tokens.get(user, 0) for r in reports)


def deferred(reports):
    return [d for r in reports for d in r.prompt_deferred]


@pytest.mark.parametrize("is_async", MODES)
def test_every_users_prompt_tokens_are_reported_once(is_async):
    """No prompt budget anywhere: each user's prompt tokens computed add up
    to its prompts' lengths (chunks of 256 tokens, several steps each), the
    step's scheduled tokens are vLLM's, and nothing is put off."""
    sched, drv, reports = setup(limits(1000), is_async, max_num_batched_tokens=256,
                                max_num_seqs=8)
    a = [make_request("a", prompt_len=700, max_tokens=3) for _ in range(2)]
    b = make_request("b", prompt_len=90, max_tokens=3)
    drv.add(*a, b)
    drv.run_until_done()
    assert computed(reports, "a") == 1400 and computed(reports, "b") == 90
    assert max(r.prompt_tokens.get("a", 0) for r in reports) <= 256  # per step, per chunk
    outs = {id(o): o for o in drv.outputs}
    assert [r.scheduled_tokens for r in reports if r.scheduled_tokens] == [
        o.total_num_scheduled_tokens for o in outs.values() if o.total_num_scheduled_tokens]
    done = [req_id for r in reports for req_id, (_u, _n, last) in r.prompt_chunks.items() if last]
    assert sorted(done) == sorted(x.request_id for x in (*a, b))  # each prompt ends once
    assert deferred(reports) == []


def test_prefix_cache_hits_are_not_prompt_work():
    """The same 640-token prompt twice: the second computes only its last
    block's tokens at most."""
    sched, drv, reports = setup(limits(1000))
    tokens = [(i * 7) % 900 + 10 for i in range(640)]
    drv.add(make_request("p", prompt=list(tokens), max_tokens=2))
    drv.run_until_done()
    assert computed(reports, "p") == 640
    drv.add(make_request("p", prompt=list(tokens), max_tokens=2))
    drv.run_until_done()
    assert 0 < computed(reports, "p") - 640 <= 16


@pytest.mark.parametrize("is_async", MODES)
def test_a_prompt_put_off_by_its_budget_is_reported_once(is_async):
    """p at 2,000 prompt tokens/s sends three 900-token prompts: each one
    put off is reported once, with what it had left; all computed in the
    end."""
    sched, drv, reports = setup(limits(1000, prompt_rates={"p": 2000}, p=1000), is_async,
                                max_num_seqs=8)
    prompts = [make_request("p", prompt_len=900, max_tokens=2) for _ in range(3)]
    drv.add(*prompts)
    drv.run_until_done()
    put_off = deferred(reports)
    assert {(u, why) for _r, u, why, _n in put_off} == {("p", "prompt_budget")}
    ids = [r for r, *_ in put_off]
    assert len(ids) == len(set(ids)) >= 2  # once a request; the first fits the burst in part
    assert all(0 < n <= 900 for *_x, n in put_off)
    assert computed(reports, "p") == 2700


@pytest.mark.parametrize("is_async", MODES)
@pytest.mark.parametrize("ahead", [False, True])
def test_a_prompt_put_off_just_in_time_is_reported_once(is_async, ahead):
    """a (1 tok/s) spent its burst; its next 300-token prompt waits for its
    budget just in time, reported once however many steps it waits; with
    prefill ahead it is computed at once and nothing is put off."""
    sched, drv, reports = setup(limits(1000, prefill_ahead=ahead, a=1), is_async)
    drv.add(make_request("a", prompt_len=8, max_tokens=3))
    drv.run(2)
    second = make_request("a", prompt_len=300, max_tokens=2)
    drv.add(second, make_request("b", prompt_len=300, max_tokens=20))
    drv.run(30)
    put_off = [d for d in deferred(reports) if d[0] == second.request_id]
    if ahead:
        assert put_off == [] and computed(reports, "a") >= 8 + 299
    else:
        assert put_off == [(second.request_id, "a", "just_in_time", 300)]
        assert computed(reports, "a") == 8  # nothing of it computed yet
    drv.run_until_done()
    assert computed(reports, "a") == 308 and computed(reports, "b") == 300


# -- the telemetry's series ---------------------------------------------------------


@pytest.mark.parametrize("is_async", MODES)
def test_the_series_equal_the_step_reports(tmp_path, is_async):
    """Computed and put-off prompt tokens per user (and reason) as the step
    reports say, the engine totals exact, configured users' series there
    from the start."""
    lim = limits(1000, prompt_rates={"p": 2000}, p=1000, a=1, quiet=10)
    sched, drv, reports = setup(lim, is_async, tel_dir=tmp_path, max_num_seqs=8)
    tel = telemetry_of(sched)
    assert counters_of(tel, "prompt_tokens_computed")[("quiet",)] == 0
    drv.add(make_request("a", prompt_len=8, max_tokens=3))
    drv.run(2)
    drv.add(*[make_request("p", prompt_len=900, max_tokens=2) for _ in range(2)],
            make_request("a", prompt_len=300, max_tokens=2), make_request("b", prompt_len=50))
    drv.run_until_done()
    tel.drain()
    computed_ = counters_of(tel, "prompt_tokens_computed")
    assert {u: computed_.get((u,), 0) for u in ("p", "a", "b")} == {"p": 1800, "a": 308, "b": 50}
    assert tel.counters[("engine_prompt_tokens_computed", ())] == 2158
    put_off = counters_of(tel, "prompt_tokens_deferred")
    want = {}
    for _r, user, reason, n in deferred(reports):
        want[(user, reason)] = want.get((user, reason), 0) + n
    assert want[("a", "just_in_time")] == 300 and want[("p", "prompt_budget")] > 0
    assert {k: v for k, v in put_off.items() if v} == want
    for reason in ("prompt_budget", "just_in_time"):
        assert tel.counters[("engine_prompt_tokens_deferred", (reason,))] == sum(
            n for (_u, why), n in want.items() if why == reason)


def test_step_time_is_split_between_users_prompts_by_the_model(tmp_path):
    """Every step 10 ms apart (the driver's virtual clock): the engine's step
    seconds are 10 ms a step that computed anything; a user's prompt
    seconds are its prompt tokens' part of each step by the model (here
    2 ms a step, 1 ms a decode, 0.1 ms a prompt token), times 10 ms."""
    cost = StepCost(0.002, 0.001, 0.0001, "test")
    sched, drv, reports = setup(limits(1000), tel_dir=tmp_path, step_cost=cost,
                                max_num_batched_tokens=128, max_num_seqs=8)
    tel = telemetry_of(sched)
    drv.add(make_request("long", prompt_len=600, max_tokens=4),
            make_request("short", prompt_len=20, max_tokens=30))
    drv.run_until_done()
    tel.drain()
    busy = [r for r in reports if r.scheduled_tokens]
    want = {"long": 0.0, "short": 0.0}
    for r in busy:
        by_user = r.prompt_tokens
        decodes = r.scheduled_requests - len(r.prompt_chunks)
        step = 0.002 + 0.001 * decodes + 0.0001 * sum(by_user.values())
        for user, n in by_user.items():
            want[user] += 0.010 * 0.0001 * n / step
    got = counters_of(tel, "prompt_step_seconds")
    assert got[("long",)] == pytest.approx(want["long"]) and got[("short",)] == pytest.approx(
        want["short"])
    # the last busy step ends when its outputs come (the engine then idle)
    assert tel.counters[("engine_step_seconds", ())] == pytest.approx(0.010 * len(busy), rel=0.1)
    # the long prompt's steps were mostly its prompt: 128 tokens, 12.8 ms of 14.8 ms modelled
    assert got[("long",)] > 4 * 0.010 * 0.8


def test_prompt_series_stay_under_the_label_cap_with_exact_totals(tmp_path):
    """200 users' prompts with one label free (top_k=1): their series are
    at most the pinned user, one other and ``__other__``; the engine total
    is exact (a label's series ends when it is taken away, as every
    per-user counter's)."""
    sched, drv, reports = setup(limits(1000, vip=5), tel_dir=tmp_path, top_k=1,
                                max_num_seqs=64, num_blocks=4000)
    tel = telemetry_of(sched)
    for i in range(0, 200, 50):
        drv.add(*[make_request(f"u{j}", prompt_len=20 + j, max_tokens=1) for j in range(i, i + 50)])
        drv.run_until_done()
        tel.export()
        drv.step()
    total = sum(20 + j for j in range(200))
    computed_ = counters_of(tel, "prompt_tokens_computed")
    assert len(computed_) <= 3 and (OTHER,) in computed_
    assert tel.counters[("engine_prompt_tokens_computed", ())] == total
    assert sum(computed_.values()) <= total
    assert len(counters_of(tel, "prompt_step_seconds")) <= 3


def test_a_step_time_file_from_twin_calibrate_is_read(tmp_path, monkeypatch):
    """``OUTPUT_RATE_STEP_TIME`` names ``twin calibrate``'s JSON; a bad one
    is named and the estimate used."""
    from vllm_output_rate.telemetry.prompt_work import step_cost_from_settings

    good = tmp_path / "step_time.json"
    good.write_text('{"version": 1, "kind": "linear", "base_s": 0.002, "per_decode_s": 1e-05, '
                    '"per_prefill_token_s": 3.5e-05, "source": "measured", "note": "cpu"}')
    assert load_step_cost(str(good)) == StepCost(0.002, 1e-05, 3.5e-05, str(good))
    monkeypatch.setenv("OUTPUT_RATE_STEP_TIME", str(good))
    assert step_cost_from_settings().per_prefill_token_s == 3.5e-05
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "kind": "linear", "base_s": -1}')
    with pytest.raises(ValueError, match="bad.json: base_s: expected a number >= 0"):
        load_step_cost(str(bad))
    monkeypatch.setenv("OUTPUT_RATE_STEP_TIME", str(bad))
    assert step_cost_from_settings() == ESTIMATE


def test_the_introspection_names_the_prompt_budget(tmp_path):
    """``GET /output-rate/users/NAME`` from the engine's snapshot: a user's
    prompt budget (its own, or the default's; none for ``unlimited``) and
    how far behind it is; the RateLimit headers then carry it as a second
    policy."""
    from fractions import Fraction

    from vllm_output_rate import access
    from vllm_output_rate.telemetry import introspect

    lim = limits(1000, prompt_rates={"p": 2000, "free": "unlimited"}, p=1000, free=1000)
    lim["default_prompt_rate"] = "500"
    sched, drv, reports = setup(lim, tel_dir=tmp_path, max_num_seqs=8)
    tel = telemetry_of(sched)
    drv.add(*[make_request("p", prompt_len=900, max_tokens=20) for _ in range(3)])
    drv.run(5)  # p's prompt budget spent (chunks cut to it: never more than a token behind)
    tel.export()
    drv.step()  # (the step after an export reads the user states)
    snapshot = tel.snapshot()
    assert snapshot["limits"]["prompt_rates"] == {"p": 2000.0, "free": "unlimited"}
    views = {u: introspect.user_view([snapshot], u)[1] for u in ("p", "free", "nobody")}
    assert views["p"]["prompt_rate"] == 2000.0 and 0 < views["p"]["prompt_ready_in_s"] < 0.01
    assert views["free"]["prompt_rate"] == "unlimited"
    assert views["nobody"]["prompt_rate"] == 500.0 and views["nobody"]["prompt_ready_in_s"] == 0
    p = views["p"]
    headers = dict(access.ratelimit_headers(Fraction(1000), None, True, 0.0,
                                            access.limit_fraction(p["prompt_rate"]),
                                            p["prompt_ready_in_s"]))
    assert headers[b"ratelimit-policy"].endswith(b'"user-prompt";q=2000;w=1;qu="prompt-tokens"')
    assert b'"user-prompt";r=' in headers[b"ratelimit"]
    assert not headers[b"ratelimit"].endswith(b'"user-prompt";r=2000;t=0')  # behind


# -- spans ------------------------------------------------------------------------


@pytest.mark.parametrize("defer, min_s", [(False, 0), (True, 0), (False, 60)])
def test_a_deferred_prefill_is_a_span(tmp_path, defer, min_s):
    """One ``output_rate.prefill_deferred`` span per request whose prompt
    was put off: from the step that first put it off to the step that
    computed its prompt's last token (just in time: when its user's budget
    returned), or its abort; none for prompts never put off, nor for those
    put off for less than ``OUTPUT_RATE_TRACE_THROTTLE_MIN_S``."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from vllm_output_rate.internals import SchedulerView
    from vllm_output_rate.tracing.recorder import SpanRecorder

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    clock = VirtualClock()
    sched = make_scheduler(limits(1000, prompt_rates={"p": 2000}, p=1000, a=1), clock=clock,
                           max_num_seqs=8)
    recorder = SpanRecorder(provider.get_tracer("test"), SchedulerView(sched), clock_offset_ns=0,
                            background=False)
    recorder.throttle_min_ns = min_s * 10**9
    tel = attach_telemetry(sched, str(tmp_path), start_thread=False, spans=recorder, defer=defer)
    reports = []
    observe_steps(sched, reports.append)
    drv = Driver(sched, clock, step_ms=10.0)
    drv.add(make_request("a", prompt_len=8, max_tokens=3))
    drv.run(2)
    waits, gone = make_request("a", prompt_len=300, max_tokens=2), make_request("a", prompt_len=40)
    budgeted = [make_request("p", prompt_len=900, max_tokens=2) for _ in range(2)]
    quick = make_request("b", prompt_len=50, max_tokens=2)
    drv.add(waits, *budgeted, quick)
    drv.run(3)
    drv.add(gone)
    drv.run(2)
    sched.finish_requests([gone.request_id], RequestStatus.FINISHED_ABORTED)
    drv.run_until_done()
    tel.drain()
    recorder.flush()
    made = {s.attributes["output_rate.request_id"]: s for s in exporter.get_finished_spans()
            if s.name == "output_rate.prefill_deferred"}
    assert recorder.prefill.open == {}  # nothing kept once the requests are gone
    if min_s:
        assert made == {}  # none put off for a minute
        return
    put_off = {r for r, *_ in deferred(reports)}
    assert set(made) == put_off and quick.request_id not in made and waits.request_id in made
    span = made[waits.request_id]
    assert span.attributes["output_rate.prompt_deferred_reasons"] == ("just_in_time",)
    assert span.attributes["output_rate.prompt_tokens_deferred"] == 300
    assert span.attributes["output_rate.outcome"] == "computed"
    assert span.attributes["output_rate.user"] == "a"
    # it waited for a's budget (1 tok/s): about a second, ended by its prompt's last chunk
    last = max(r.now_ns for r in reports
               if r.prompt_chunks.get(waits.request_id, (0, 0, False))[2])
    first = min(r.now_ns for r in reports if any(d[0] == waits.request_id
                                                 for d in r.prompt_deferred))
    assert (span.start_time, span.end_time) == (first, last) and last - first > 0.5e9
    assert made[gone.request_id].attributes["output_rate.outcome"] == "aborted"
    assert {made[r.request_id].attributes["output_rate.prompt_deferred_reasons"]
            for r in budgeted if r.request_id in made} == {("prompt_budget",)}


@pytest.mark.parametrize("chunked", [True, False])
def test_the_event_log_carries_the_prompt_budget_and_its_bound_holds(tmp_path, chunked):
    """With the event log on: the start line names the prompt budgets, a
    ``prompt`` line per step that computed prompts; read back as ``verify``
    reads it, p's prompt tokens hold the prompt budget's bound (+1 chunked,
    + the largest prompt whole) in every window, and b has no budget."""
    from fractions import Fraction

    from vllm_output_rate.telemetry.events import EngineLog
    from vllm_output_rate.tools.verify.gcra import gcra_worst_window

    clock = VirtualClock()
    sched = make_scheduler(limits(1000, prompt_rates={"p": 3000}, p=1000), clock=clock,
                           max_num_seqs=8, enable_chunked_prefill=chunked)
    path = tmp_path / "events.jsonl"
    tel = attach_telemetry(sched, str(tmp_path), start_thread=False, events_path=str(path),
                           clock=DriverClock(clock))
    drv = Driver(sched, clock, step_ms=10.0)
    drv.add(*[make_request("p", prompt_len=700, max_tokens=2) for _ in range(4)],
            make_request("b", prompt_len=300, max_tokens=2))
    drv.run_until_done()
    tel.export()
    log = EngineLog.read(path)
    (start,) = log.starts
    assert start["prompt_limits"] == {"p": 3000.0} and start["default_prompt_limit"] is None
    assert start["chunked_prefill"] is chunked
    spends = log.user_prompt_spends("p")
    assert sum(n for _, n in spends) == 2800 and sum(n for _, n in log.user_prompt_spends("b")) == 300
    worst = gcra_worst_window(spends, Fraction(3000), extra=1 if chunked else 700)
    assert worst["excess"] <= 0 and worst["windows"] > 1
    if not chunked:  # whole prompts: over the chunked bound, within the whole one
        assert gcra_worst_window(spends, Fraction(3000))["excess"] > 0
