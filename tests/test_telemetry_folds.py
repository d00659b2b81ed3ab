"""Engine-side telemetry driven through the real scheduler (no engine): the
folds. Grouped observations equal one by one (hypothesis), pending steps and
the inbox bounded, deferred folds equal folds at once, a failing fold
counted, and throttle episodes and skips against references kept from the
scheduler's own step reports (hypothesis, derandomized)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from harness import Driver, VirtualClock, attach_telemetry, make_request, make_scheduler, observe_steps
from telemetry_setup import counter, limits, setup
from vllm_output_rate.telemetry.histograms import (
    Histogram,
    ns_edges,
    observe_by_label,
    sums_by_key,
)
from vllm_output_rate.telemetry.metrics import EPISODE_BUCKETS, SPACING_BUCKETS


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
