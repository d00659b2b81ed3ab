"""test_e2e's scenarios in virtual time: the real scheduler with test_e2e's
limits and sizes, the engine telemetry and its event log on the fake clock
(no engine). Limited users exactly at their limits on the event log, an
unlimited user never skipped beside throttled ones, the throttled gauges
back at zero once idle, a throttled user's state exact at every export."""

from __future__ import annotations

import pytest

from harness import Driver, VirtualClock, attach_telemetry, make_request, make_scheduler, observe_steps
from telemetry_setup import counter, limits


# -- test_e2e's scenarios in virtual time ------------------------------------------

#: test_e2e's limits (user-c listed at the default: far above what one
#: stream can take) and server sizes
E2E_LIMITS = limits(100_000, **{"user-a": 20, "user-b": 60, "user-slow": 0.5, "user-c": 100_000})
E2E_SIZES = {"max_num_seqs": 16, "max_num_active_seqs": 8, "max_model_len": 1024}
MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


def e2e_setup(tmp_path, monkeypatch, is_async, lim=E2E_LIMITS):
    """The real scheduler with test_e2e's limits, the engine telemetry with
    its event log stamping on the fake clock, a driver whose synchronous
    steps are stamped when their output is processed (as in the engine)."""
    import vllm_output_rate.telemetry.engine as engine_mod

    clock = VirtualClock()
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", clock)
    sched = make_scheduler(lim, clock=clock, async_scheduling=is_async, **E2E_SIZES)
    path = tmp_path / "events.jsonl"
    tel = attach_telemetry(sched, str(tmp_path), start_thread=False, events_path=str(path))
    drv = Driver(sched, clock, step_ms=10.0, is_async=is_async, stamp_at_end=True)
    return sched, drv, tel, path, clock


def run_exporting(drv, tel, every=100):
    """Until done, an export every ``every`` steps (the exporter's second)."""
    while drv.scheduler.has_requests():
        drv.run(every)
        tel.export()
    drv.flush()
    tel.export()


@pytest.mark.parametrize("is_async", MODES)
def test_limited_users_get_exactly_their_limit_on_the_event_log(tmp_path, monkeypatch, is_async):
    """test_e2e's limited users (user-a: 4 streams of 75 at 20 tok/s,
    user-b: 2 of 200 at 60) read as the end-to-end test reads them, from
    the engine's event log: every answer complete; the GCRA bound in every
    window with only the dispatch slack (one step; two with async
    scheduling); each user's rate first to last token at its limit."""
    from fractions import Fraction

    from vllm_output_rate.limiter import BURST_NS
    from vllm_output_rate.telemetry.events import EngineLog
    from vllm_output_rate.tools.verify.gcra import gcra_worst_window

    BURST_S = BURST_NS / 1e9

    sched, drv, tel, path, clock = e2e_setup(tmp_path, monkeypatch, is_async)
    reqs = ([make_request("user-a", max_tokens=75) for _ in range(4)]
            + [make_request("user-b", max_tokens=200) for _ in range(2)])
    added = clock()
    drv.add(*reqs)
    run_exporting(drv, tel)
    assert all(drv.count(r.request_id) == r.max_tokens for r in reqs)
    assert all(drv.finished[r.request_id] == "length" for r in reqs)
    log = EngineLog.read(path)
    assert not log.bad_lines and log.starts[0]["async_scheduling"] is is_async
    for user, limit, total in (("user-a", 20, 300), ("user-b", 60, 400)):
        spends = log.user_spends(user)
        assert sum(n for _, n in spends) == total
        # (nothing is dispatched before the requests came)
        starts = [max(s, added) for s in
                  log.dispatch_lower_bounds((t for t, _ in spends), 2 if is_async else 1)]
        worst = gcra_worst_window(spends, Fraction(limit), starts)
        assert worst["excess"] <= 0, (user, worst)
        # reached: the strict bound (no slack) is met to within a token
        assert gcra_worst_window(spends, Fraction(limit))["excess"] <= 1
        # at the limit throughout: the last token comes when GCRA first
        # allows it, (n - 1) / limit - burst after the first, to a step
        span_s = (spends[-1][0] - spends[0][0]) / 1e9
        assert abs(span_s - ((total - 1) / limit - BURST_S)) <= 0.01, (user, span_s)


@pytest.mark.parametrize("is_async", MODES)
def test_an_unlimited_user_is_never_skipped_beside_throttled_users(tmp_path, monkeypatch, is_async):
    """test_e2e's unlimited-user scenario: user-c's 900 tokens alone, then
    beside user-a's and user-b's six throttled streams. Not one step
    skipped for user-c (its skip counter stays 0 while theirs rise), and
    every one of its 899 spacings is exactly one engine step, alone and
    beside the load: the spacing histogram's count and sum are the same
    both times."""
    sched, drv, tel, path, clock = e2e_setup(tmp_path, monkeypatch, is_async)

    def hist(name, *labels):
        h = tel.histograms.get((name, labels))
        return (h.count, round(h.sum, 6)) if h is not None else (0, 0.0)

    alone = make_request("user-c", max_tokens=900)
    drv.add(alone)
    run_exporting(drv, tel)
    spacing_alone = hist("inter_token_seconds", "user-c")
    assert spacing_alone == (899, 8.99)  # 899 spacings of 10 ms
    c = make_request("user-c", max_tokens=900)
    others = ([make_request("user-a", max_tokens=60) for _ in range(4)]
              + [make_request("user-b", max_tokens=200) for _ in range(2)])
    drv.add(*others, c)
    steps_before = drv.steps
    run_exporting(drv, tel)
    assert all(drv.count(r.request_id) == r.max_tokens for r in [alone, c, *others])
    # the load outlasted user-c: it ran beside throttled users throughout
    last_c = drv.tokens[c.request_id][-1][1]
    assert max(drv.tokens[r.request_id][-1][1] for r in others) > last_c
    times = [t for _, t in drv.tokens[c.request_id]]
    assert {b - a for a, b in zip(times, times[1:])} == {10_000_000}
    c_count, c_sum = hist("inter_token_seconds", "user-c")
    assert (c_count - spacing_alone[0], round(c_sum - spacing_alone[1], 6)) == (899, 8.99)
    assert counter(tel, "requests_skipped", "user-c") == 0
    assert counter(tel, "requests_skipped", "user-a") > 0
    assert counter(tel, "requests_skipped", "user-b") > 0
    assert drv.steps - steps_before >= 900


def test_throttled_gauges_return_to_zero_when_the_engine_goes_idle(tmp_path, monkeypatch):
    """test_e2e's throttled-gauge scenario (user-slow at 0.5 tok/s, two
    streams of 3 tokens): at every export while it runs the gauges are the
    step's own throttled requests and their KV blocks; once the last
    answer is out they are 0 at the next export, with no step after it
    (the engine idle, nothing new arriving)."""
    sched, drv, tel, path, clock = e2e_setup(tmp_path, monkeypatch, False)
    steps = []
    observe_steps(sched, lambda report: steps.append(list(report.throttled)))
    reqs = [make_request("user-slow", prompt_len=40, max_tokens=3) for _ in range(2)]
    drv.add(*reqs)

    def gauges():  # as /metrics shows them: the exported snapshot's
        return {(n, tuple(l)): v for n, l, v in tel.snapshot()["gauges"]}

    seen = 0
    while sched.has_requests():
        drv.run(100)
        tel.export()
        # an export's figures are those of the first step after the one
        # before (the step that reads the engine for it)
        throttled = steps[-100]
        if not sched.running:  # (the last answers came: idle, below)
            break
        now = gauges()
        assert now[("throttled_requests", ("user-slow",))] == len(throttled)
        assert now[("engine_throttled_requests", ())] == len(throttled)
        if throttled:
            seen += 1
            # 40 prompt tokens and up to 3 more: 3 blocks of 16 each
            assert now[("throttled_kv_blocks", ("user-slow",))] == 3 * len(throttled)
    assert seen >= 3  # (it was throttled at exports)
    drv.flush()
    assert all(drv.count(r.request_id) == 3 for r in reqs) and not sched.has_requests()
    # the last export step saw a throttled request; no step comes after the
    # last answer on an idle engine: the exported gauges say 0 all the same
    assert tel.gauges[("throttled_requests", ("user-slow",))] == 1
    tel.export()
    idle = gauges()
    for key in [("throttled_requests", ("user-slow",)), ("throttled_kv_blocks", ("user-slow",)),
                ("engine_throttled_requests", ()), ("engine_throttled_kv_blocks", ()),
                ("throttled_kv_cache_ratio", ())]:
        assert idle[key] == 0, key


def test_a_throttled_users_state_is_exact_at_every_export(tmp_path, monkeypatch):
    """test_e2e_identity's look at a user while it streams (slowpoke at 2
    tok/s, one stream of 12 tokens), at every export rather than once at a
    moment the test process picks: what GET /output-rate/users/NAME shows
    is the engine as of the step that read it for that export. Running 1,
    throttled 0 or 1 (then its KV blocks), the budget ready within
    1 / limit - burst, the tokens charged over the last 10 s exactly those
    charged up to that step; once idle, the windowed counts equal the
    charged counter."""
    sched, drv, tel, path, clock = e2e_setup(tmp_path, monkeypatch, False,
                                             limits(40, slowpoke=2, vip=100_000))
    steps = []  # (now, slowpoke tokens charged, slowpoke throttled)
    observe_steps(sched, lambda r: steps.append(
        (r.now_ns, sum(1 for u in r.charged.values() if u == "slowpoke"), len(r.throttled))))
    drv.add(make_request("slowpoke", max_tokens=12))
    looked = 0
    while True:
        drv.run(50)
        tel.export()
        if not sched.running:
            break
        state = tel.snapshot()["users"]["states"]["slowpoke"]
        now, _, throttled = steps[-50]  # the step after the export before read the engine
        charged = sum(n for t, n, _ in steps if t <= now)
        ready = min(t for t, n, _ in steps if t > now and n)  # its next token's dispatch
        assert state == {"limit": 2.0, "charged_10s": charged, "charged_60s": charged,
                         "running": 1, "waiting": 0, "throttled": throttled,
                         "throttled_kv_blocks": state["throttled_kv_blocks"],
                         "ready_in_s": (ready - now) / 1e9}, (now, state)
        assert (state["throttled_kv_blocks"] >= 1) == (throttled == 1)
        assert 0 < state["ready_in_s"] <= 1 / 2 - 0.1  # 1 / limit - burst
        looked += 1
    assert looked >= 8
    drv.flush()
    tel.export()
    state = tel.snapshot()["users"]["states"]["slowpoke"]
    assert state["charged_60s"] == state["charged_10s"] == counter(tel, "tokens_charged", "slowpoke") == 12
    assert state["running"] == state["throttled"] == 0
