"""Engine-side telemetry driven through the real scheduler (no engine)."""

from __future__ import annotations

import bisect
import json
import os

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from harness import Driver, VirtualClock, attach_telemetry, make_request, make_scheduler, observe_steps
from vllm_output_rate.scheduler import OutputRateAsyncScheduler
from vllm_output_rate.telemetry.collector import SnapshotCollector
from vllm_output_rate.telemetry.labels import OTHER
from vllm_output_rate.telemetry.metrics import HISTOGRAM_SERIES, METRICS, SPACING_BUCKETS, series_name


def limits(default, **users):
    return {"default_user_output_tokens_per_second": default,
            "user_output_tokens_per_second": users}


def setup(tmp_path, lim, top_k=100, **kw):
    clock = VirtualClock()
    sched = make_scheduler(lim, clock=clock, **kw)
    tel = attach_telemetry(sched, str(tmp_path), top_k=top_k, start_thread=False)
    return sched, Driver(sched, clock, step_ms=10.0), tel


def counter(tel, name, *labels):
    return tel.counters.get((name, tuple(labels)), 0)


def test_charged_counters_equal_delivered_tokens(tmp_path):
    sched, drv, tel = setup(tmp_path, limits(1000, a=20, b=50))
    reqs = [make_request(u, max_tokens=30) for u in ("a", "a", "b", "c")]
    drv.add(*reqs)
    drv.run_until_done()
    for user in ("a", "b"):
        delivered = sum(drv.count(r.request_id) for r in reqs if r.output_rate_user == user)
        assert counter(tel, "tokens_charged", user) == delivered == 30 * (2 if user == "a" else 1)
    assert counter(tel, "engine_tokens_charged") == 120
    assert counter(tel, "requests_skipped", "a") > 0  # a was throttled
    assert counter(tel, "requests_skipped", "c") == 0


@pytest.mark.parametrize("top_k", [100, 1])
def test_skip_and_charge_counters_equal_the_step_records(tmp_path, top_k):
    """Skips per user are folded from the changes between steps; at every
    export and at the end they equal the sum over steps of the user's
    throttled requests (the step records are the oracle), with users taking
    turns at their limits, requests finishing, exports (and, with top_k=1,
    label changes: the overflow bucket) in between."""
    from collections import Counter

    sched, drv, tel = setup(tmp_path, limits(1000, a=30, b=45, d=15), top_k=top_k)
    per_user: Counter = Counter()
    total = [0]
    charged: Counter = Counter()

    def on_step(record):
        per_user.update(sched.requests[rid].output_rate_user for rid in record.throttled)
        total[0] += len(record.throttled)
        charged.update(record.charged.values())

    observe_steps(sched, on_step)
    users = ["a", "a", "a", "b", "b", "c", "d", "d", "e", "e"]
    drv.add(*[make_request(u, max_tokens=20 + 7 * i) for i, u in enumerate(users)])
    checked = 0
    for step in range(2000):
        if not sched.has_requests():
            break
        drv.step()
        if step % 37 == 36:
            tel._export_due = True  # as the exporter thread sets it
            drv.step()
            expected = Counter()
            for user, n in per_user.items():
                expected[tel.labeler.label(user)] += n
            got = {labels[0]: v for (name, labels), v in tel.counters.items()
                   if name == "requests_skipped" and v}
            if top_k == 100:  # folded up to and including the export step
                assert got == {k: v for k, v in expected.items() if v}
                # (users idle long enough lose their label and their series)
                labelled = tel.labeler.labelled_users()
                got_charged = {labels[0]: v for (name, labels), v in tel.counters.items()
                               if name == "tokens_charged" and v and labels[0] in labelled}
                assert got_charged == {u: n for u, n in charged.items() if n and u in labelled}
            checked += 1
    drv.flush()
    tel.close()
    assert checked > 3 and total[0] > 100
    if top_k == 100:
        got = {u: counter(tel, "requests_skipped", u) for u in ("a", "b", "c", "d", "e")}
        assert got == {u: per_user.get(u, 0) for u in ("a", "b", "c", "d", "e")}
        assert sum(got.values()) == total[0]
        labelled = tel.labeler.labelled_users()
        assert {"a", "b", "d"} <= set(labelled)  # configured: always labelled
        assert {u: counter(tel, "tokens_charged", u) for u in charged if u in labelled} == {
            u: n for u, n in charged.items() if u in labelled}
    assert counter(tel, "engine_requests_skipped") == total[0]
    assert counter(tel, "engine_tokens_charged") == sum(charged.values())


def test_spacing_histogram_matches_token_events(tmp_path, monkeypatch):
    import vllm_output_rate.telemetry.engine as engine_mod

    sched, drv, tel = setup(tmp_path, limits(20))
    # engine-side timestamps follow the fake clock here
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    reqs = [make_request("a", max_tokens=20) for _ in range(2)]
    drv.add(*reqs)
    drv.run_until_done()
    spacings = []
    for r in reqs:
        times = [t for _, t in drv.tokens[r.request_id]]
        spacings += [(b - a) / 1e9 for a, b in zip(times, times[1:])]
    # "a" got a label of its own at the first step (top-K, not configured)
    hist = tel.histograms[("inter_token_seconds", ("a",))]
    total_counts, total_sum, total_count = next(
        h[2:] for h in tel.snapshot()["histograms"] if h[0] == "engine_inter_token_seconds")
    assert hist.count == total_count == sum(total_counts) == len(spacings) == 38
    assert hist.sum == pytest.approx(sum(spacings)) == pytest.approx(total_sum)
    # two streams sharing 20 tok/s: each stream's tokens ~0.1 s apart
    assert sorted(spacings)[len(spacings) // 2] == pytest.approx(0.1, abs=0.011)


@pytest.mark.parametrize("top_k", [100, 1])
def test_spacing_per_label_matches_token_events_with_pauses_aborts_and_relabels(
        tmp_path, monkeypatch, top_k):
    """The steady requests' per-label counts are kept from the requests
    that pause, start and finish (a request counts from its second token in
    a row): after every update they equal a recount,
    and the spacing histograms equal the spacings of the delivered tokens,
    with users taking turns at their limits, aborts and label changes."""
    from collections import Counter

    import vllm_output_rate.telemetry.engine as engine_mod
    from vllm.v1.request import RequestStatus

    sched, drv, tel = setup(tmp_path, limits(1000, a=30, b=45), top_k=top_k)
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", drv.clock)
    users = ["a", "a", "a", "b", "b", "c", "d", "d", "e"]
    reqs = [make_request(u, max_tokens=15 + 6 * i) for i, u in enumerate(users)]
    drv.add(*reqs)
    for step in range(3000):
        if not sched.has_requests():
            break
        drv.step()
        if step == 25:  # abort one stream of a (throttled by then) and d's first
            sched.finish_requests([reqs[0].request_id, reqs[6].request_id],
                                  RequestStatus.FINISHED_ABORTED)
        if step % 29 == 28:
            tel._export_due = True  # exports: labels may change (top_k=1)
        # (requests with one token after none are not steady yet)
        spacing = tel.folds.spacing
        assert spacing.joining <= spacing.prev_ids
        recount = Counter(spacing.request_label.get(r) or OTHER for r in spacing.prev_ids - spacing.joining)
        assert spacing.prev_by_label == {k: v for k, v in recount.items() if v}
    drv.flush()
    spacings = 0
    for r in reqs:
        times = [t for _, t in drv.tokens[r.request_id]]
        spacings += max(len(times) - 1, 0)
    total = next(h for h in tel.snapshot()["histograms"] if h[0] == "engine_inter_token_seconds")
    assert total[4] == spacings > 100
    if top_k == 100:
        for user in ("a", "b"):
            times = [[t for _, t in drv.tokens[r.request_id]] for r in reqs if r.output_rate_user == user]
            user_spacings = [(y - x) * 1e-9 for ts in times for x, y in zip(ts, ts[1:])]
            hist = tel.histograms[("inter_token_seconds", (user,))]
            assert hist.count == len(user_spacings)
            assert hist.sum == pytest.approx(sum(user_spacings))
            buckets = [0] * len(hist.counts)
            for spacing in user_spacings:
                buckets[bisect.bisect_left(SPACING_BUCKETS, spacing)] += 1
            assert hist.counts == buckets
            assert len([b for b in buckets if b]) > 1  # (spacings fell in several buckets)


def test_throttled_gauges_follow_throttling(tmp_path):
    # (prompts computed ahead: all three resident and throttled at once)
    sched, drv, tel = setup(tmp_path, {**limits(1000, a=2), "prefill_ahead": True})
    drv.add(*[make_request("a", prompt_len=40, max_tokens=6) for _ in range(3)])
    drv.run(5)
    tel.export()
    drv.step()
    assert tel.gauges[("engine_throttled_requests", ())] == 3
    assert tel.gauges[("throttled_requests", ("a",))] == 3
    assert tel.gauges[("throttled_kv_blocks", ("a",))] >= 3 * 3  # 40+ tokens, 16 per block
    assert 0 < tel.gauges[("throttled_kv_cache_ratio", ())] < 1
    drv.run_until_done()
    tel.export()
    drv.add(make_request("b", max_tokens=2))
    drv.step()
    assert tel.gauges[("engine_throttled_requests", ())] == 0
    assert tel.gauges[("throttled_requests", ("a",))] == 0


def test_ten_thousand_users_stay_under_the_label_cap_with_exact_totals(tmp_path):
    sched, drv, tel = setup(tmp_path, limits(1000, vip=5), top_k=50, max_num_seqs=256,
                            num_blocks=20_000)
    n = 10_000
    for i in range(0, n, 500):
        drv.add(*[make_request(f"user-{j}", prompt_len=4, max_tokens=1) for j in range(i, i + 500)])
        drv.run_until_done()
        tel.export()
        drv.step()  # the step after an export rebalances labels
    users = {labels[0] for (name, labels) in tel.counters if name == "tokens_charged"}
    assert len(users) <= 1 + 50 + 1  # pinned + top-K + __other__
    assert OTHER in users
    assert counter(tel, "engine_tokens_charged") == n
    assert len(tel.labeler._activity) <= tel.labeler.capacity


def test_export_and_collector_show_every_metric(tmp_path):
    sched, drv, tel = setup(tmp_path, limits(1000, a=5))
    drv.add(*[make_request("a", max_tokens=10) for _ in range(2)])
    drv.run(20)
    assert tel.export()
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(str(tmp_path)))
    text = generate_latest(registry).decode()
    for m in METRICS:
        assert m.full_name in text, m.full_name
    assert 'vllm_output_rate_tokens_charged_total{engine="0",model_name="' in text
    assert 'user="a"' in text


def test_series_names_are_what_the_collector_exposes(tmp_path):
    """series_name gives, for every metric of the table, exactly the sample
    names a scrape of the collector shows (what the tools look up)."""
    from prometheus_client.parser import text_string_to_metric_families

    snap = {"engine": "0", "model_name": "tiny", "counters": [], "gauges": [], "histograms": []}
    expected = {}
    for m in METRICS:
        labels = [f"{label}-x" for label in m.labels]
        if m.kind == "histogram":
            snap["histograms"].append([m.name, labels, [1] * (len(m.buckets) + 1), 0.5,
                                       len(m.buckets) + 1])
            expected[m.name] = {series_name(m.name, part) for part in HISTOGRAM_SERIES}
        else:
            snap[m.kind + "s"].append([m.name, labels, 3.0])
            expected[m.name] = {series_name(m.name)}
    (tmp_path / "engine-0.json").write_text(json.dumps(snap))
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(str(tmp_path)))
    exposed: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        exposed.setdefault(family.name, set()).update(s.name for s in family.samples)
    by_family = {m.full_name: m.name for m in METRICS}
    got = {by_family[name]: names for name, names in exposed.items() if name in by_family}
    # the parser names a counter's family without _total
    got.update({by_family[name + "_total"]: names for name, names in exposed.items()
                if name + "_total" in by_family})
    assert got == expected
    assert series_name("tokens_charged") == "vllm_output_rate_tokens_charged_total"
    assert series_name("inter_token_seconds", "count") == "vllm_output_rate_inter_token_seconds_count"
    assert series_name("engine_throttled_requests") == "vllm_output_rate_engine_throttled_requests"
    for bad in (("tokens_charged", "count"), ("inter_token_seconds", None),
                ("inter_token_seconds", "total")):
        with pytest.raises(ValueError):
            series_name(*bad)
    with pytest.raises(KeyError):
        series_name("no_such_metric")


def test_dead_export_target_is_counted_not_raised(tmp_path):
    sched, drv, tel = setup(tmp_path, limits(1000))
    tel.exporter.path = str(tmp_path / "missing-dir" / "engine-0.json")
    drv.add(make_request("a", max_tokens=5))
    drv.run_until_done()
    assert not tel.export()
    assert not tel.export()
    assert counter(tel, "telemetry_dropped", "export_failed") == 2


def test_unreadable_snapshot_is_skipped(tmp_path):
    (tmp_path / "engine-0.json").write_text("{not json")
    collector = SnapshotCollector(str(tmp_path))
    families = list(collector.collect())
    assert families and collector.read_errors == 1


def test_snapshot_is_json(tmp_path):
    sched, drv, tel = setup(tmp_path, limits(1000))
    tel.export()
    data = json.loads((tmp_path / "engine-0.json").read_text())
    assert data["engine"] == "0" and data["counters"]
    assert not os.path.exists(str(tmp_path / "engine-0.json.tmp"))


def events_setup(tmp_path, lim, monkeypatch, **kw):
    import vllm_output_rate.telemetry.engine as engine_mod

    clock = VirtualClock()
    sched = make_scheduler(lim, clock=clock, **kw)
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", clock)
    path = tmp_path / "events.jsonl"
    tel = attach_telemetry(sched, str(tmp_path), start_thread=False, events_path=str(path))
    return sched, Driver(sched, clock, step_ms=10.0), tel, path


def read_events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_throttle_episodes_are_timed_per_user(tmp_path, monkeypatch):
    # 3 streams of "a" at 10 tok/s, 10 ms steps: after the burst the streams
    # take turns, each dispatched once about every 0.3 s and throttled again
    # in the next step: pacing at the limit, one episode per stream, from its
    # first refusal to its last token (24 tokens at 10 tok/s: about 2 s)
    sched, drv, tel, _ = events_setup(tmp_path, limits(1000, a=10), monkeypatch)
    drv.add(*[make_request("a", max_tokens=8) for _ in range(3)])
    drv.add(make_request("b", max_tokens=8))
    drv.run_until_done()
    hist = tel.histograms[("throttle_episode_seconds", ("a",))]
    assert hist.count == 3
    mean = hist.sum / hist.count
    assert 1.6 <= mean <= 2.4
    assert ("throttle_episode_seconds", ("b",)) not in tel.histograms or \
        tel.histograms[("throttle_episode_seconds", ("b",))].count == 0
    assert not tel._episodes  # every episode ended


@pytest.mark.parametrize("defer", [False, True], ids=["folded-at-once", "deferred"])
@pytest.mark.parametrize("stop", ["max_tokens", "eos"])
def test_async_a_request_finishing_while_its_user_is_throttled(tmp_path, stop, defer):
    """Async scheduling: the next step is scheduled while a request's last
    token is in flight. Three streams of "a" pacing at 20 tok/s beside an
    unlimited user: each request's one throttle episode is booked under
    "a" (none under the overflow label), from its first refusal to its last
    dispatch (not the step after). Stopped by ``max_tokens``, the request
    is not throttled again after its last dispatch (vLLM's ``schedule()``
    passes it by: no false skip); stopped by EOS (not
    known when the next step is scheduled), it may be refused once more
    there, and only those refusals the scheduler reported are counted."""
    clock = VirtualClock()
    sched = make_scheduler(limits(100_000, a=20), clock=clock, async_scheduling=True)
    assert isinstance(sched, OutputRateAsyncScheduler)
    tel = attach_telemetry(sched, str(tmp_path), start_thread=False, defer=defer)
    drv = Driver(sched, clock, step_ms=10.0, is_async=True)
    steps = []  # (now, charged ids, throttled ids)
    observe_steps(sched, lambda r: steps.append((r.now_ns, set(r.charged), list(r.throttled))))
    eos = stop == "eos"
    a = [make_request("a", max_tokens=40 if eos else 10, ignore_eos=not eos) for _ in range(3)]
    ids = {r.request_id for r in a}
    if eos:  # the model samples EOS as each one's 10th token
        real = drv._apply

        def apply(out, mro):
            for i, rid in enumerate(mro.req_ids):
                if rid in ids and mro.sampled_token_ids[i] and drv.count(rid) == 9:
                    mro.sampled_token_ids[i] = [1]
            real(out, mro)

        drv._apply = apply
    drv.add(*a, make_request("b", max_tokens=60))
    drv.run_until_done()
    tel.drain()
    tel.folds.fold()
    assert all(drv.count(rid) == 10 for rid in ids)
    took, late = [], 0
    for rid in ids:
        first_refused = min(t for t, _, thr in steps if rid in thr)
        last_dispatch = max(t for t, charged, _ in steps if rid in charged)
        took.append(last_dispatch - first_refused)
        late += sum(thr.count(rid) for t, _, thr in steps if t > last_dispatch)
    episodes = tel.histograms[("throttle_episode_seconds", ("a",))]
    assert episodes.count == 3
    assert episodes.sum == pytest.approx(sum(took) / 1e9)
    other = tel.histograms.get(("throttle_episode_seconds", (OTHER,)))
    assert other is None or other.count == 0
    assert not tel._episodes and not tel.folds.book.bases
    refused = sum(thr.count(rid) for _, _, thr in steps for rid in ids)
    assert counter(tel, "requests_skipped", "a") == refused
    assert counter(tel, "requests_skipped", OTHER) == 0
    if eos:
        assert 1 <= late <= 3  # (the case this checks happened: refused once more)
    else:
        assert late == 0  # no false skip


def test_the_event_logs_start_line_says_whether_the_scheduler_runs_ahead(tmp_path, monkeypatch):
    """The verifier allows one more update of lag under async scheduling:
    it reads the mode from the engine, not from how the server was started."""
    for is_async in (False, True):
        (tmp_path / str(is_async)).mkdir()
        sched, drv, tel, path = events_setup(tmp_path / str(is_async), limits(1000, a=20),
                                             monkeypatch, async_scheduling=is_async)
        assert isinstance(sched, OutputRateAsyncScheduler) == is_async
        tel.export()
        assert read_events(path)[0]["async_scheduling"] is is_async


def test_event_log_matches_what_the_engine_delivered(tmp_path, monkeypatch):
    sched, drv, tel, path = events_setup(tmp_path, limits(1000, a=20), monkeypatch)
    reqs = [make_request("a", max_tokens=12) for _ in range(2)] + [make_request("b", max_tokens=9)]
    drv.add(*reqs)
    drv.run(5)
    tel.export()  # the throttled line of an export-due step comes at the next step
    drv.run_until_done()
    tel.export()
    tel.export()  # idle at two exports in a row: the all-zero line
    events = read_events(path)
    assert events[0]["kind"] == "start"
    assert events[0]["limits"] == {"a": 20.0} and events[0]["default_limit"] == 1000.0
    assert events[0]["async_scheduling"] is False
    per_request: dict[str, int] = {}
    times: dict[str, list[int]] = {}
    for e in events:
        if e["kind"] == "tokens":
            for req_id, user, n in e["tokens"]:
                per_request[req_id] = per_request.get(req_id, 0) + n
                times.setdefault(req_id, []).append(e["t_ns"])
    for r in reqs:
        assert per_request[r.request_id] == drv.count(r.request_id)
        assert times[r.request_id] == [t for _, t in drv.tokens[r.request_id]]
    finished = {e["request_id"]: e for e in events if e["kind"] == "finished"}
    assert {r.request_id for r in reqs} == set(finished)
    for r in reqs:
        assert finished[r.request_id]["output_tokens"] == r.max_tokens
        assert finished[r.request_id]["reason"] == "length"
        assert finished[r.request_id]["user"] == r.output_rate_user
    throttled = [e for e in events if e["kind"] == "throttled"]
    assert any(e["requests"].get("a", 0) >= 1 and e["kv_blocks"]["a"] > 0 for e in throttled)
    assert throttled[-1]["requests"] == {} and throttled[-1]["kv_share"] == 0.0
    last_tokens = max(e["t_ns"] for e in events if e["kind"] == "tokens")
    assert throttled[-1]["t_ns"] >= last_tokens


def test_idle_line_follows_the_last_tokens_even_after_an_unthrottled_busy_export(
        tmp_path, monkeypatch):
    # the last export-due step has work but nothing throttled (an all-zero
    # line is queued then); the engine must still say "idle, nothing
    # throttled" after its last tokens
    sched, drv, tel, path = events_setup(tmp_path, limits(1000, a=20), monkeypatch)
    drv.add(*[make_request("a", max_tokens=6) for _ in range(2)])
    drv.add(make_request("b", max_tokens=80))
    while sched.requests:  # exports now and then: the last busy one sees only "b"
        drv.run(10)
        tel.export()
    throttled = [e for e in read_events(path) if e["kind"] == "throttled"]
    assert any(e["requests"] for e in throttled)  # "a" was throttled at some point
    assert throttled[-1]["requests"] == {}  # the last busy export-due step: nothing
    before = read_events(path)
    tel.export()
    tel.export()
    events = read_events(path)
    assert len(events) > len(before)
    last_tokens = max(e["t_ns"] for e in events if e["kind"] == "tokens")
    idle = [e for e in events if e["kind"] == "throttled" and e["t_ns"] >= last_tokens]
    assert len(idle) == 1 and idle[0]["requests"] == {}
    tel.export()
    assert len(read_events(path)) == len(events)  # said once


def test_abort_mid_throttle_ends_episode_and_is_logged(tmp_path, monkeypatch):
    from vllm.v1.request import RequestStatus

    sched, drv, tel, path = events_setup(tmp_path, limits(1000, a=5), monkeypatch)
    reqs = [make_request("a", max_tokens=50) for _ in range(2)]
    drv.add(*reqs)
    drv.run(20)
    assert tel._episodes  # both are throttled now
    sched.finish_requests([r.request_id for r in reqs], RequestStatus.FINISHED_ABORTED)
    assert not tel._episodes and not tel.folds.spacing.last_token_ns
    assert tel.histograms[("throttle_episode_seconds", ("a",))].count >= 2
    tel.export()
    finished = [e for e in read_events(path) if e["kind"] == "finished"]
    assert sorted(e["request_id"] for e in finished) == sorted(r.request_id for r in reqs)
    assert all(e["reason"] == "abort" and 0 < e["output_tokens"] < 50 for e in finished)
    assert not tel.events.tokens


def test_event_queue_overflow_is_counted(tmp_path, monkeypatch):
    import vllm_output_rate.telemetry.eventlog as eventlog_mod

    monkeypatch.setattr(eventlog_mod, "EVENTS_QUEUE_CAP", 3)
    sched, drv, tel, path = events_setup(tmp_path, limits(1000), monkeypatch)
    drv.add(make_request("a", max_tokens=10))
    # 1 queued + 1 throttled (none) + 1 prompt line + 10 token lines + 1 finish line, 3 kept
    drv.run_until_done()
    assert counter(tel, "telemetry_dropped", "events_queue_full") == 11
    tel.export()
    kinds = [e["kind"] for e in read_events(path)]
    assert sorted(kinds) == ["prompt", "queued", "start", "throttled"]


def test_unwritable_event_log_is_counted_not_raised(tmp_path, monkeypatch):
    sched, drv, tel, path = events_setup(tmp_path, limits(1000), monkeypatch)
    tel.events.path = str(tmp_path / "missing-dir" / "events.jsonl")
    drv.add(make_request("a", max_tokens=4))
    drv.run_until_done()
    assert tel.export()  # the snapshot still goes out
    assert counter(tel, "telemetry_dropped", "events_write_failed") >= 5


def test_no_per_request_state_outlives_its_request(tmp_path, monkeypatch):
    from vllm.v1.request import RequestStatus

    sched, drv, tel, _ = events_setup(tmp_path, limits(1000, a=15), monkeypatch)
    reqs = [make_request(u, max_tokens=12) for u in ("a", "a", "a", "b", "c")]
    drv.add(*reqs)
    drv.run(10)
    sched.finish_requests([reqs[0].request_id], RequestStatus.FINISHED_ABORTED)
    drv.run_until_done()
    spacing = tel.folds.spacing
    assert not spacing.last_token_ns and not spacing.prev_ids and not spacing.request_label
    assert not tel._episodes and not tel.events.tokens
    # every delivered token but the first of each request is one spacing
    delivered = sum(drv.count(r.request_id) for r in reqs)
    total = sum(h.count for h in tel.series.spacing.values())
    assert total == delivered - len(reqs)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_kv_blocks_held_matches_vllms_block_ids(tmp_path, prefix_caching):
    from vllm_output_rate.internals import kv_blocks_held

    sched, drv, tel = setup(tmp_path, limits(1000, a=2), enable_prefix_caching=prefix_caching)
    reqs = [make_request("a", prompt_len=40, max_tokens=30) for _ in range(3)]
    drv.add(*reqs, make_request("b", prompt_len=70, max_tokens=30))
    manager = sched.kv_cache_manager
    for _ in range(12):
        drv.step()
        for req_id in sched.requests:
            want = sum(len(g) for g in manager.get_block_ids(req_id))
            assert kv_blocks_held(manager, req_id) == want
    assert any(kv_blocks_held(manager, r.request_id) > 1 for r in reqs)
    assert kv_blocks_held(manager, "no-such-request") == 0

    class OtherLayout:  # no coordinator: the public way
        def get_block_ids(self, req_id):
            return ([1, 2], [3])

    assert kv_blocks_held(OtherLayout(), "x") == 3


def test_the_metrics_page_lists_every_renamed_metric():
    from harness import REPO
    from vllm_output_rate.telemetry.metrics import METRICS, PREFIX, RENAMED_FROM

    readme = (REPO / "docs" / "metrics.md").read_text()
    assert PREFIX == "vllm_output_rate_"
    assert set(RENAMED_FROM) == {m.full_name for m in METRICS if m.renamed}
    # metrics added after the rename: shared-budget mode's, borrowing's,
    # the preemptions for a request with budget, prompt work and the state sizes
    added = [m.name for m in METRICS if not m.renamed]
    assert [n for n in added if not n.startswith("shared_")] == [
        "tokens_borrowed", "engine_tokens_borrowed", "engine_throttled_preempted",
        "prompt_tokens_computed", "engine_prompt_tokens_computed", "prompt_tokens_deferred",
        "engine_prompt_tokens_deferred", "prompt_step_seconds", "engine_step_seconds",
        "state_entries"]
    for new, old in RENAMED_FROM.items():
        assert f"| `{old}` | `{new}` |" in readme, new
    shares = [m for m in METRICS if m.unit == "ratio"]
    assert shares and all(m.name.endswith("_ratio") for m in shares)


from hypothesis import given, settings as hsettings, strategies as st  # noqa: E402

from vllm_output_rate.telemetry.histograms import (  # noqa: E402
    Histogram,
    ns_edges,
    observe_by_label,
    sums_by_key,
)
from vllm_output_rate.telemetry.metrics import EPISODE_BUCKETS  # noqa: E402


@pytest.mark.parametrize("bounds", [SPACING_BUCKETS, EPISODE_BUCKETS])
@hsettings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=400 * 10**9), max_size=60),
       st.lists(st.sampled_from(["a", "b", None]), min_size=60, max_size=60))
def test_observing_by_label_in_c_equals_observing_one_by_one(bounds, values_ns, labels):
    """The folds' grouped observation (integer ns edges, counts per (label,
    bucket) in C) puts every value where Histogram.observe(ns * 1e-9) does,
    bucket boundaries included."""
    edges = ns_edges(bounds)
    near = [e + d for e in edges for d in (-1, 0, 1)]  # every boundary, both sides
    values = values_ns + near
    names = (labels * (len(values) // len(labels) + 1))[:len(values)]
    grouped: dict = {}
    observe_by_label(names, values, lambda n: grouped.setdefault(n, Histogram(bounds)))
    single: dict = {}
    for name, v in zip(names, values):
        single.setdefault(name, Histogram(bounds)).observe(v * 1e-9)
    assert grouped.keys() == single.keys()
    for name in single:
        assert grouped[name].counts == single[name].counts
        assert grouped[name].count == single[name].count
        assert grouped[name].sum == pytest.approx(single[name].sum, rel=1e-12, abs=1e-12)


@hsettings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", None]),
                          st.integers(min_value=0, max_value=10**12)), max_size=80))
def test_sums_by_key_in_numpy_equal_summing_one_by_one(pairs):
    """The folds' per-user sums of episode credits (numpy over the batch)
    equal a plain loop: exact integers, every key present, None a key."""
    keys = [k for k, _ in pairs]
    values = [v for _, v in pairs]
    expected: dict = {}
    for key, value in pairs:
        expected[key] = expected.get(key, 0) + value
    got = sums_by_key(keys, values)
    assert got == expected
    assert all(type(v) is int for v in got.values())


def test_pending_steps_stay_bounded_without_exports(tmp_path, monkeypatch):
    """With exports late (none here), what the steps left for the next fold
    is folded once PENDING_STEPS_CAP runs are pending: bounded, and the
    counters still exact."""
    from collections import Counter

    import vllm_output_rate.telemetry.folds as folds_mod

    monkeypatch.setattr(folds_mod, "PENDING_STEPS_CAP", 8)
    sched, drv, tel = setup(tmp_path, limits(1000, a=30))
    tel._export_due = False
    skipped: Counter = Counter()
    observe_steps(sched, lambda record: skipped.update(
        sched.requests[rid].output_rate_user for rid in record.throttled))
    drv.add(*[make_request("a", max_tokens=40) for _ in range(3)], make_request("b", max_tokens=90))
    peak = 0
    while sched.has_requests():
        drv.step()
        peak = max(peak, tel.state_sizes()["steps.pending"])
    assert 0 < peak <= 8 + 4  # (a step adds at most one run of each kind)
    tel.folds.fold()
    assert counter(tel, "requests_skipped", "a") == skipped["a"] > 50
    assert counter(tel, "tokens_charged", "a") == 120 and counter(tel, "tokens_charged", "b") == 90


def _run_churn(tmp_path, monkeypatch, defer: bool, inbox_cap: int | None = None):
    """Users pacing at their limits, one far below it, a burst of short
    requests that finish between two drains, a client abort mid-throttle
    and a second wave after the engine went idle; exports every 25 steps.
    Returns the final snapshot and the telemetry."""
    import vllm_output_rate.telemetry.engine as engine_mod
    import vllm_output_rate.telemetry.intake as intake_mod
    from vllm.v1.request import RequestStatus

    if inbox_cap is not None:
        monkeypatch.setattr(intake_mod, "INBOX_CAP", inbox_cap)
    clock = VirtualClock()
    sched = make_scheduler(limits(1000, a=15, b=40, c=200), clock=clock)
    tel = attach_telemetry(sched, str(tmp_path), top_k=100, start_thread=False, defer=defer)
    drv = Driver(sched, clock, step_ms=10.0)
    monkeypatch.setattr(engine_mod.time, "monotonic_ns", clock)
    pacing = [make_request("a", max_tokens=30) for _ in range(3)]
    pacing += [make_request("b", max_tokens=40) for _ in range(4)]
    drv.add(*pacing, make_request("c", max_tokens=60))
    for i in range(160):
        if i == 20:  # short requests: added, served and finished between drains
            drv.add(*[make_request(u, max_tokens=2) for u in ("a", "b", "d", "e")])
        if i == 60:
            sched.finish_requests([pacing[0].request_id], RequestStatus.FINISHED_ABORTED)
        if i % 25 == 0:
            tel._export_due = True  # (as after an export)
        drv.step()
    drv.run_until_done()
    drv.add(*[make_request(u, max_tokens=12) for u in ("a", "a", "c")])
    drv.run_until_done()
    tel.folds.fold()  # (deferred: nothing is folded before this snapshot drains)
    return tel.snapshot(), tel


def _comparable(snapshot):
    """A snapshot's series without wall-clock times and container sizes."""
    skip = {"telemetry_snapshot_timestamp_seconds", "state_entries",
            "limits_loaded_timestamp_seconds", "schedule_limiter_ratio"}
    # (sums of float seconds: the order of additions may differ)
    return {kind: sorted(json.dumps([round(v, 9) if isinstance(v, float) else v for v in row])
                         for row in snapshot[kind] if row[0] not in skip)
            for kind in ("counters", "gauges", "histograms")}


def test_deferred_folds_equal_folds_at_once(tmp_path, monkeypatch):
    """The worker folds what the scheduler's thread handed over later, when
    requests may be gone from the engine (users and facts by the handle
    taken when each was added; KV blocks, live requests and episodes read
    on the scheduler's thread): every counter, gauge and histogram equals
    what folding each event at once gives, and nothing per request is left."""
    at_once, _ = _run_churn(tmp_path / "once", monkeypatch, defer=False)
    deferred, tel = _run_churn(tmp_path / "deferred", monkeypatch, defer=True)
    a, b = _comparable(deferred), _comparable(at_once)
    for kind in a:
        assert set(a[kind]) ^ set(b[kind]) == set(), kind
    counters = {(n, tuple(l)): v for n, l, v in deferred["counters"]}
    assert counters[("requests_skipped", ("a",))] > 50
    assert counters[("tokens_refunded", ("a", "not_scheduled"))] >= 0
    assert counters[("telemetry_dropped", ("fold_failed",))] == 0
    # (the ready time of a user with no live request is read by the worker)
    states = [{u: {k: v for k, v in state.items() if k != "ready_in_s" or state["running"]}
               for u, state in snap["users"]["states"].items()} for snap in (deferred, at_once)]
    assert states[0] == states[1] and len(states[0]) == 5
    sizes = tel.state_sizes()
    assert not any(v for k, v in sizes.items() if k.startswith("requests.")), sizes
    assert sizes["events.inbox"] == 0


def test_inbox_is_bounded_when_the_worker_is_late(tmp_path, monkeypatch):
    """With no drain at all, the scheduler's thread folds the inbox itself
    once INBOX_CAP events wait: bounded, and the result is the same."""
    import vllm_output_rate.telemetry.engine as engine_mod

    peaks = []
    real_post = engine_mod.EngineTelemetry._post

    def post(self, fold, *args):
        real_post(self, fold, *args)
        peaks.append(len(self._inbox))

    monkeypatch.setattr(engine_mod.EngineTelemetry, "_post", post)
    capped, _ = _run_churn(tmp_path / "capped", monkeypatch, defer=True, inbox_cap=16)
    assert 0 < max(peaks) < 16 and len(peaks) > 500
    monkeypatch.undo()
    at_once, _ = _run_churn(tmp_path / "once", monkeypatch, defer=False)
    a, b = _comparable(capped), _comparable(at_once)
    for kind in a:
        assert set(a[kind]) ^ set(b[kind]) == set(), kind


def test_a_failing_fold_is_counted_and_the_others_go_on(tmp_path, monkeypatch, caplog):
    """A fold that raises on the worker drops that event (counted, logged
    once): the engine and the other events go on."""
    sched, drv, tel = setup(tmp_path, limits(1000, a=30))
    tel._sync = False
    drv.add(make_request("a", max_tokens=10))
    drv.run(3)
    tel._inbox.appendleft((lambda: 1 / 0, ()))
    tel._inbox.appendleft((lambda: 1 / 0, ()))
    drv.run_until_done()
    tel.drain()
    assert counter(tel, "telemetry_dropped", "fold_failed") == 2
    assert sum("folding an event failed" in r.getMessage() for r in caplog.records) == 1
    tel.folds.fold()
    assert counter(tel, "tokens_charged", "a") == 10


@hsettings(max_examples=10, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), active=st.sampled_from([None, 3]), defer=st.booleans())
def test_throttle_episodes_follow_the_scheduler_step_by_step(tmp_path_factory, seed, active,
                                                             defer):
    """Throttle episodes, against a reference kept from the scheduler's own
    step reports: one opens when a request is throttled with none open; a
    request dispatched with one open keeps it if it is throttled again in
    the next step (a user pacing at its limit: one episode, not one per
    token), and otherwise its episode ends at that dispatch (also when the
    request finished there). Per user, the histogram has exactly the
    reference's episodes and durations, whether folded at once or deferred,
    with exports and folds at random steps."""
    import random
    from collections import defaultdict

    rng = random.Random(seed)
    clock = VirtualClock()
    sched = make_scheduler(limits(1000, a=rng.choice([10, 30, 150]), b=rng.choice([15, 60])),
                           clock=clock, max_num_seqs=8, max_num_active_seqs=active)
    tel = attach_telemetry(sched, str(tmp_path_factory.mktemp("episodes")), start_thread=False,
                           defer=defer)
    drv = Driver(sched, clock, step_ms=10.0)
    user_of: dict[str, str] = {}
    opened: dict[str, int] = {}
    took: dict[str, list[int]] = defaultdict(list)
    prev: list[str] = []
    prev_ns = 0

    def reference(record):
        nonlocal prev, prev_ns
        # (before the intake's step: whether it takes its steady path, every
        # request dispatched inside an episode throttled again, none new)
        dispatched, again = tel._cur, record.throttled_new
        if dispatched and record.step - 1 == tel._last_step:
            _STEADY_PATHS.add(again == dispatched)
        throttled = set(record.throttled)
        for req_id in prev:
            if req_id not in throttled:
                took[user_of[req_id]].append(prev_ns - opened.pop(req_id))
        prev = [r for r in record.charged if r in opened]
        prev_ns = record.now_ns
        for req_id in record.throttled:
            opened.setdefault(req_id, record.now_ns)

    observe_steps(sched, reference)
    for i in range(200):
        if i % 50 == 0:
            reqs = [make_request(rng.choice("ab"), max_tokens=rng.randint(3, 30))
                    for _ in range(rng.randint(2, 6))]
            drv.add(*reqs)
            user_of.update({r.request_id: r.output_rate_user for r in reqs})
        _step_folding_at_random(tel, drv, rng)
    drv.run_until_done()
    for req_id in prev:  # (the last step's: nothing after it throttles them)
        took[user_of[req_id]].append(prev_ns - opened.pop(req_id))
    tel.drain()
    tel.folds.fold()
    assert not opened and not tel._episodes
    for user in "ab":
        hist = tel.histograms.get(("throttle_episode_seconds", (user,)))
        count = hist.count if hist else 0
        assert count == len(took[user])
        if count:
            assert hist.sum == pytest.approx(sum(took[user]) / 1e9)
    assert any(took.values())


#: whether the intake took its steady path (True) or looked at the step's
#: requests (False), over the examples above, at steps with requests
#: dispatched inside an episode
_STEADY_PATHS: set[bool] = set()


def test_the_episode_examples_took_both_ways():
    """The examples above had steady steps at the limit (every request
    dispatched inside an episode throttled again: the intake's passes
    skipped) and steps where episodes ended or opened (derandomized)."""
    if not _STEADY_PATHS:
        pytest.skip("run with the test above")
    assert _STEADY_PATHS == {True, False}


def _step_folding_at_random(tel, drv, rng):
    """One step, with an export due before it and a fold after it, each
    at random."""
    if rng.random() < 0.05:
        tel._export_due = True
    drv.step()
    if rng.random() < 0.05:
        tel.drain()
        tel.folds.fold()


#: whether steps with throttled requests were counted by episode (True) or
#: request by request (False), over the examples above
_SKIP_PATHS: set[bool] = set()


@hsettings(max_examples=16, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), active=st.sampled_from([None, 3, 5]),
       batched=st.sampled_from([2048, 40, 24]), defer=st.booleans(), ahead=st.booleans())
def test_skips_counted_by_episode_equal_skips_counted_per_request(tmp_path_factory, seed, active,
                                                                   batched, defer, ahead):
    """Skips are counted by throttle episode when a step's throttled
    requests are exactly those with an episode open, request by request
    otherwise (the active cap or the token budget left some out, a prefill
    held, a preemption): per user, always the count of (step, request)
    pairs the scheduler reported throttled, whether folded at once or
    deferred, with folds at random steps."""
    import random
    from collections import Counter

    from vllm.v1.request import RequestStatus

    rng = random.Random(seed)
    clock = VirtualClock()
    # prompts just in time (the default) or computed ahead (the mixes of
    # held prefills and open episodes differ)
    sched = make_scheduler({**limits(1000, a=rng.choice([10, 30]), b=rng.choice([15, 60]), c=200),
                            "prefill_ahead": ahead},
                           clock=clock, max_num_seqs=8, max_num_active_seqs=active,
                           max_num_batched_tokens=batched)
    tel = attach_telemetry(sched, str(tmp_path_factory.mktemp("skips")), start_thread=False,
                           defer=defer)
    drv = Driver(sched, clock, step_ms=10.0)
    exact: Counter = Counter()
    observe_steps(sched, lambda record: exact.update(
        sched.requests[rid].output_rate_user for rid in record.throttled))
    every = []
    real = type(tel.folds).fold_step

    def fold_step(self, record, episodes, reads):
        if record.throttled:
            every.append(episodes.every)
        real(self, record, episodes, reads)

    tel._fold_step = fold_step.__get__(tel.folds)
    live = []
    for i in range(220):
        if i % 40 == 0:
            reqs = [make_request(rng.choice("abc"), prompt_len=rng.choice([8, 30]),
                                 max_tokens=rng.randint(3, 25)) for _ in range(rng.randint(3, 7))]
            drv.add(*reqs)
            live += reqs
        if rng.random() < 0.02:
            victims = [r.request_id for r in live if r.request_id in sched.requests][:1]
            if victims:
                sched.finish_requests(victims, RequestStatus.FINISHED_ABORTED)
        _step_folding_at_random(tel, drv, rng)
    drv.run_until_done()
    tel.drain()
    tel.folds.fold()
    got = {user: counter(tel, "requests_skipped", user) for user in exact}
    assert got == dict(exact)
    _SKIP_PATHS.update(every)  # (both ways are taken: see the test below)
    assert not tel.folds.book.bases and not tel._episodes


def test_the_skip_examples_took_both_ways():
    """The examples above counted steps by episode and request by request
    (derandomized: the same examples every run)."""
    if not _SKIP_PATHS:
        pytest.skip("run with the test above")
    assert _SKIP_PATHS == {True, False}


@hsettings(max_examples=10, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), defer=st.booleans())
def test_every_throttled_request_has_an_episode_open_after_its_step(tmp_path_factory, seed, defer):
    """Episodes open by the requests not throttled in the step before (the
    scheduler lists them) when the telemetry saw that step, and by every
    throttled request after steps it did not see (its observer unset for a
    while): either way each throttled request of a step has an episode open
    after it, and every request throttled again keeps the one it had."""
    import random

    rng = random.Random(seed)
    clock = VirtualClock()
    sched = make_scheduler(limits(1000, a=rng.choice([10, 25]), b=rng.choice([15, 40])),
                           clock=clock, max_num_seqs=12)
    tel = attach_telemetry(sched, str(tmp_path_factory.mktemp("open")), start_thread=False,
                           defer=defer)
    drv = Driver(sched, clock, step_ms=10.0)
    drv.add(*[make_request(rng.choice("ab"), max_tokens=rng.randint(20, 60)) for _ in range(10)])
    fast = slow = 0
    started: dict[str, int] = {}
    for _ in range(150):
        unseen = rng.random() < 0.05
        if unseen:
            sched.output_rate.observer = None
        seen_before = tel._last_step
        drv.step()
        sched.output_rate.observer = tel
        record = sched.output_rate.last_step
        if unseen:
            continue
        if record.step - 1 == seen_before:
            fast += 1
        else:
            slow += 1
        assert set(record.throttled) <= tel._episodes.keys()
        assert set(record.throttled_new) <= set(record.throttled)
        for req_id in record.throttled:
            if req_id in started and req_id not in record.throttled_new:
                assert tel._episodes[req_id] == started[req_id]  # (kept, not reopened)
        started = {r: tel._episodes[r] for r in record.throttled}
    assert fast > 100 and slow > 0


@pytest.mark.parametrize("mode", ["hashed", "off"])
def test_user_label_modes_keep_ids_off_the_metrics_with_exact_totals(tmp_path, monkeypatch, mode):
    """``--output-rate-user-label hashed|off`` (carried as settings): no id on
    ``/metrics``; hashed labels group each user, off keeps only totals and
    ``__other__``; the totals are exact either way."""
    from vllm_output_rate import user_label

    salt = tmp_path / "salt"
    salt.write_bytes(b"0123456789abcdef-salt")
    (tmp_path / "out").mkdir()
    for name, value in user_label.child_settings(mode, str(salt) if mode == "hashed" else None).items():
        monkeypatch.setenv(name, value)
    user_label.forget()
    try:
        sched, drv, tel = setup(tmp_path / "out", limits(1000, alice=50))
        drv.add(*[make_request(u, max_tokens=5) for u in ("alice", "bob-the-customer")])
        drv.run_until_done()
        assert tel.export()
        registry = CollectorRegistry()
        registry.register(SnapshotCollector(str(tmp_path / "out")))
        text = generate_latest(registry).decode()
    finally:
        user_label.forget()
    assert "alice" not in text and "bob-the-customer" not in text
    assert counter(tel, "engine_tokens_charged") == 10
    if mode == "hashed":
        for user in ("alice", "bob-the-customer"):
            label = user_label.hashed(user, b"0123456789abcdef-salt")
            assert f'user="{label}"' in text and counter(tel, "tokens_charged", label) == 5
    else:
        assert counter(tel, "tokens_charged", OTHER) == 10
        users = {labels[0] for (name, labels) in tel.counters if name == "tokens_charged"}
        assert users == {OTHER}


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
