"""Engine-side telemetry driven through the real scheduler (no engine): the
throttle episodes per user (async scheduling's last token in flight
included), and the engine event log: what the engine delivered, the idle
line, aborts, a bounded queue and an unwritable file counted, no state per
request outliving it."""

from __future__ import annotations

import pytest

from harness import Driver, VirtualClock, attach_telemetry, make_request, make_scheduler, observe_steps
from telemetry_setup import counter, events_setup, limits, read_events
from vllm_output_rate.scheduler import OutputRateAsyncScheduler
from vllm_output_rate.telemetry.labels import OTHER


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
