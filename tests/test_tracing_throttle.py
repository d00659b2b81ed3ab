"""Throttle and over-limit spans with the real OpenTelemetry SDK and an
in-memory exporter: an episode a span, ended at the dispatch after which the
request was not throttled again; one over-limit period for a user pacing at
its limit (test_e2e_traces' load, exactly, in virtual time), ended when
demand falls under the limit; spans only for episodes past the minimum."""

from __future__ import annotations

import pytest

from harness import make_request, observe_steps
from tracing_setup import exporter, telemetry_mode  # noqa: F401  (fixtures)
from tracing_setup import TOKENS, cap_series, limits, setup, spans
from vllm_output_rate.tracing.recorder import THROTTLE_MIN_ENV


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
        cap_series(monkeypatch, series_mod, throttle_mod, 8)
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
