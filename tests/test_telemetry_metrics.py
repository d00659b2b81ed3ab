"""Engine-side telemetry driven through the real scheduler (no engine): the
counters, spacing histograms and gauges equal what the scheduler delivered
and reported, the label cap with exact totals, the user label modes, the
snapshot and the collector that shows every metric of the table."""

from __future__ import annotations

import bisect
import json
import os

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from harness import make_request, observe_steps
from telemetry_setup import counter, limits, setup
from vllm_output_rate.telemetry.collector import SnapshotCollector
from vllm_output_rate.telemetry.labels import OTHER
from vllm_output_rate.telemetry.metrics import HISTOGRAM_SERIES, METRICS, SPACING_BUCKETS, series_name


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
