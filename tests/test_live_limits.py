"""Live limits: ``--output-rate-limits-file`` reloaded under the real vLLM
Scheduler / AsyncScheduler with a fake clock (the watcher's thread off: the
test looks at the file itself, as the thread would every 250 ms)."""

from __future__ import annotations

import math
import os
import signal
import time
from fractions import Fraction

import pytest

from harness import (
    rewrite_unseen,
    Driver,
    VirtualClock,
    limit_at,
    limit_integral,
    make_request,
    make_scheduler,
    observe_steps,
)
from vllm_output_rate import limits_watch
from vllm_output_rate.config import (
    LIMITS_FILE_OPTION,
    UNLISTED_USER,
    OutputRateConfig,
    OutputRateConfigError,
    load_limits_file,
)
from vllm_output_rate.limiter import BURST_NS, NS_PER_S
from vllm_output_rate.ledger import OutputRateState

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


@pytest.fixture(autouse=True)
def no_watch_thread(monkeypatch):
    monkeypatch.setattr(OutputRateState, "watch_thread", False)


def write(path, text):
    # a new inode each time, as an editor or a ConfigMap update does
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def setup(path, is_async=False):
    clock = VirtualClock()
    sched = make_scheduler(load_limits_file(str(path)).to_dict(), clock=clock,
                           async_scheduling=is_async)
    drv = Driver(sched, clock, step_ms=10.0, is_async=is_async)
    charges: list[tuple[int, str, int]] = []  # (now_ns, user, tokens) per step

    def tap(report):
        per_user: dict[str, int] = {}
        for user in report.charged.values():
            per_user[user] = per_user.get(user, 0) + 1
        charges.extend((report.now_ns, u, n) for u, n in per_user.items())

    observe_steps(sched, tap)
    return sched, drv, clock, charges


def tokens_of(charges, user, t0, t1):
    return sum(n for t, u, n in charges if u == user and t0 <= t < t1)


def check_piecewise_bound(charges, user, schedule):
    """Every window of ``user``'s charges: tokens <= integral of the limit
    over the window + the burst at the limit of the window's last token + 1."""
    times = [t for t, u, n in charges if u == user for _ in range(n)]

    for i in range(len(times)):
        for j in range(i, min(len(times), i + 150)):
            a, b = times[i], times[j]
            bound = (limit_integral(schedule, a, b)
                     + limit_at(schedule, b) * Fraction(BURST_NS, NS_PER_S) + 1)
            assert j - i + 1 <= math.floor(bound), (a, b)


@pytest.mark.parametrize("is_async", MODES)
def test_a_changed_file_is_in_force_at_the_next_step(tmp_path, is_async):
    path = tmp_path / "limits.yaml"
    write(path, "default: 1000\nusers: {user-a: 20}\n")
    sched, drv, clock, charges = setup(path, is_async)
    watcher = sched.output_rate.watcher
    assert watcher is not None and watcher.results["loaded"] == 0
    drv.add(*[make_request("user-a", max_tokens=2000) for _ in range(4)])
    drv.add(make_request("user-b", max_tokens=2000))
    schedule = []  # (from ns, limit of user-a)

    def phase(limit, text, seconds=3):
        if text is not None:
            write(path, text)
            assert watcher.check() == "loaded"
        t0 = clock()
        schedule.append((t0, Fraction(limit)))
        drv.run(int(seconds * 100))
        got = tokens_of(charges, "user-a", t0, clock())
        # at its limit throughout (demand: 4 streams at 100 tok/s each); a
        # lowered limit first pays the debt run up at the old one (the old
        # limit's burst, counted in tokens, beyond the new limit's burst)
        previous = schedule[-2][1] if len(schedule) > 1 else limit
        debt = max(0, previous - limit) * Fraction(BURST_NS, NS_PER_S)
        assert limit * seconds - debt - 1 <= got <= limit * (seconds + 0.1) + 1, (limit, got)
        return got

    phase(20, None)
    phase(40, "default: 1000\nusers: {user-a: 40}\n")
    assert sched.output_rate.config.rate_of("user-a") == 40
    # a broken file changes nothing, is counted once, and logged once
    write(path, "default: 1000\nusers: {user-a: -5}\n")
    assert watcher.check() == "invalid"
    assert watcher.check() is None  # the same bad file is not counted again
    assert "users.user-a" in watcher.last_error and str(path) in watcher.last_error
    phase(40, None, seconds=1)
    phase(10, "default: 1000\ntiers: {slow: 10}\nusers: {user-a: slow}\n")
    assert sched.output_rate.config.tier_of("user-a") == "slow"
    assert watcher.results == {"loaded": 2, "unchanged": 0, "invalid": 1, "unreadable": 0}
    tap = sched.output_rate.observer
    assert [c.changed for c in tap.limit_changes] == [("user-a",), ("user-a",)]
    # user-b (the default, 1000 tok/s) was never held back
    assert tokens_of(charges, "user-b", 0, clock()) >= 0.95 * drv.steps
    check_piecewise_bound(charges, "user-a", schedule)


def check_piecewise_bound_on_log(log, user, schedule, lag):
    """``check_piecewise_bound`` on the engine's event log, as the end-to-end
    test reads it: tokens are stamped when their step's output is processed,
    charged when the step was dispatched, at or after the output ``lag``
    steps before (``dispatch_lower_bounds``). A window of stamps i..j holds
    charges within [dispatch bound of i, stamp of j]: the tokens <= the
    limits' integral over that + the burst at the larger limit about the
    last charge + 1. No other slack. Returns the worst window's share of
    its bound."""
    spends = log.user_spends(user)
    stamps = [t for t, _ in spends]
    starts = log.dispatch_lower_bounds(stamps, lag)
    burst = Fraction(BURST_NS, NS_PER_S)
    worst = Fraction(0)
    for i in range(len(spends)):
        tokens = 0
        for j in range(i, min(len(spends), i + 150)):
            tokens += spends[j][1]
            a, b = starts[i], stamps[j]
            last = max(limit_at(schedule, max(starts[j], schedule[0][0])), limit_at(schedule, b))
            bound = limit_integral(schedule, max(a, schedule[0][0]), b) + last * burst + 1
            assert tokens <= math.floor(bound), (user, a, b, tokens, float(bound))
            worst = max(worst, tokens / bound)
    return worst


@pytest.mark.parametrize("is_async", MODES)
def test_the_bound_holds_on_the_engine_event_log_across_live_changes(tmp_path, monkeypatch,
                                                                      is_async):
    """test_e2e_live_limits' scenario in virtual time, read as it reads it
    (the engine telemetry's event log): user-a's four streams at 20 tok/s;
    the file rewritten to 40, then broken, then 40 again (unchanged), then
    10 with the same size and modification time (polling sees nothing; a
    SIGHUP does). Each change is in force, and logged, at exactly the first
    step after it was read; each phase runs at its limit; the piecewise
    GCRA bound holds in every window of the log with only the dispatch
    slack (one step, two with async scheduling)."""
    from harness import attach_telemetry
    from vllm_output_rate.telemetry.events import EngineLog

    path = tmp_path / "limits.yaml"
    write(path, "default: 100000\nusers:\n  user-a: 20\n")
    clock = VirtualClock()
    monkeypatch.setattr(time, "monotonic_ns", clock)  # the telemetry's stamps
    sched = make_scheduler(load_limits_file(str(path)).to_dict(), clock=clock,
                           async_scheduling=is_async, max_num_seqs=16)
    events = tmp_path / "events.jsonl"
    tel = attach_telemetry(sched, str(tmp_path), start_thread=False, events_path=str(events))
    # a synchronous step's tokens are stamped when its output is processed,
    # a step later than their charge (as in the engine)
    drv = Driver(sched, clock, step_ms=10.0, is_async=is_async, stamp_at_end=True)
    watcher = sched.output_rate.watcher
    drv.add(*[make_request("user-a", max_tokens=5000) for _ in range(4)])
    t_start = clock()

    def run(seconds):
        for _ in range(int(seconds * 10)):
            drv.run(10)
            tel.export()  # the exporter, about once a second

    in_force = {}
    run(4)
    write(path, "default: 100000\nusers:\n  user-a: 40\n")
    assert watcher.check() == "loaded"
    in_force[40] = clock()  # the next step's time
    run(4)
    write(path, "default: 100000\nusers:\n  user-a: [40]\n")
    assert watcher.check() == "invalid"
    run(1.5)
    write(path, "default: 100000\nusers:\n  user-a: 40\n")
    assert watcher.check() == "unchanged"
    run(1)
    rewrite_unseen(path, "user-a: 40", "user-a: 10")
    assert watcher.check() is None  # polling sees nothing ...
    run(1)
    watcher.request_reload()  # ... what SIGHUP does
    assert watcher.check() == "loaded"
    in_force[10] = clock()
    run(4)
    end = clock()
    tel.export()
    assert watcher.results == {"loaded": 2, "unchanged": 1, "invalid": 1, "unreadable": 0}
    counters = {(n, tuple(l)): v for n, l, v in tel.snapshot()["counters"]}
    assert [counters[("limits_reloads", (r,))] for r in ("loaded", "unchanged", "invalid")] == [2, 1, 1]

    log = EngineLog.read(events)
    assert not log.bad_lines
    changes = [(c["t_ns"], c["limits"]["user-a"]) for c in log.limit_changes]
    assert changes == [(in_force[40], 40.0), (in_force[10], 10.0)]
    schedule = [(t_start, Fraction(20)), (in_force[40], Fraction(40)), (in_force[10], Fraction(10))]
    # each phase, from a second after its change (the lowered limit's debt
    # paid) to the next: the limit exactly, within a token at each end (a
    # token is stamped a step after its charge)
    bounds = [in_force[40], in_force[10], end]
    for (begin, limit), stop in zip(schedule, bounds):
        lo = begin + (NS_PER_S if begin != t_start else 0)
        got = sum(n for t, n in log.user_spends("user-a", lo) if t < stop)
        assert abs(got - limit * Fraction(stop - lo, NS_PER_S)) <= 2, (limit, got)
    worst = check_piecewise_bound_on_log(log, "user-a", schedule, 2 if is_async else 1)
    assert worst > Fraction(9, 10)  # (the bound is tight: the limit was reached)
    sched.shutdown()


def test_sighup_reads_the_file_even_when_its_stat_is_unchanged(tmp_path):
    path = tmp_path / "limits.json"
    write(path, '{"default": 5}')
    sched, drv, clock, charges = setup(path)
    watcher = sched.output_rate.watcher
    st = os.stat(path)
    with open(path, "r+") as f:  # same size, same mtime: polling cannot see it
        f.write('{"default": 7}')
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert watcher.check() is None
    assert limits_watch.install_sighup(watcher)
    os.kill(os.getpid(), signal.SIGHUP)
    time.sleep(0.05)
    assert watcher.check() == "loaded"
    drv.step()
    assert sched.output_rate.limiter.rate_of("anyone") == 7
    os.kill(os.getpid(), signal.SIGHUP)  # nothing changed: counted as such
    assert watcher.check() == "unchanged"
    sched.shutdown()


def test_an_unreadable_file_keeps_the_limits_and_recovers(tmp_path):
    path = tmp_path / "limits.yaml"
    write(path, "default: 5\n")
    sched, drv, _, _ = setup(path)
    watcher = sched.output_rate.watcher
    os.remove(path)
    assert watcher.check() == "unreadable"
    assert watcher.check() is None  # one episode, counted once
    drv.step()
    assert sched.output_rate.limiter.default_rate == 5
    write(path, "default: 6\n")
    assert watcher.check() == "loaded"
    drv.step()
    assert sched.output_rate.limiter.default_rate == 6
    status = sched.output_rate.watcher.status()
    assert status.results["unreadable"] == 1 and status.last_error is None
    assert status.source == str(path)


def test_shared_unlisted_users_spend_one_budget(tmp_path):
    path = tmp_path / "limits.yaml"
    write(path, "default: 10\nusers: {vip: 1000}\n")
    config = OutputRateConfig.from_options(None, None, str(path), "shared")
    clock = VirtualClock()
    sched = make_scheduler(config.to_dict(), clock=clock, max_num_seqs=64)
    drv = Driver(sched, clock, step_ms=10.0)
    # 50 invented ids: one default budget between them
    requests = [make_request(f"rotating-{i}", max_tokens=500) for i in range(50)]
    vip = make_request("vip", max_tokens=500)
    drv.add(*requests, vip)
    assert {r.output_rate_user for r in requests} == {UNLISTED_USER}
    assert requests[0].output_rate_identity == "rotating-0"
    drv.run(200)  # 2 s
    invented = sum(drv.count(r.request_id) for r in requests)
    assert 10 * 2 - 1 <= invented <= 10 * 2.1 + 1, invented
    assert drv.count(vip.request_id) >= 190
    # listing one of them in the file gives it its own budget from then on
    write(path, "default: 10\nusers: {vip: 1000, rotating-0: 1000}\n")
    assert sched.output_rate.watcher.check() == "loaded"
    before = drv.count(requests[0].request_id)
    drv.run(100)
    assert requests[0].output_rate_user == "rotating-0"
    assert drv.count(requests[0].request_id) - before >= 90


def test_a_file_changed_before_the_engine_started_is_read_at_once(tmp_path):
    path = tmp_path / "limits.yaml"
    write(path, "default: 5\n")
    carried = load_limits_file(str(path)).to_dict()
    write(path, "default: 9\n")
    sched = make_scheduler(carried, clock=VirtualClock())
    assert sched.output_rate.watcher.results["loaded"] == 1
    Driver(sched, VirtualClock()).step()
    assert sched.output_rate.limiter.default_rate == 9


@pytest.mark.parametrize("text, where", [
    ("default: 0\n", "default"),
    ("default: 5\nusers: {bob: silver}\n", "users.bob"),
    ("default: 5\ntiers: {gold: .inf}\n", "tiers.gold"),
    ("default: 5\nusers: {bob: yes}\n", "users.bob"),
    ("users: {bob: 5}\n", "'default' is required"),
    ("default: 5\nlimits: {}\n", "unknown key"),
    ("- 5\n", "expected a mapping"),
    ("default: [5\n", "not valid YAML"),
])
def test_a_bad_file_is_refused_naming_the_file_the_key_and_the_value(tmp_path, text, where):
    path = tmp_path / "limits.yaml"
    write(path, text)
    with pytest.raises(OutputRateConfigError) as err:
        load_limits_file(str(path))
    assert str(path) in str(err.value) and where in str(err.value)


def test_the_file_and_the_options_are_not_combined(tmp_path):
    path = tmp_path / "limits.yaml"
    write(path, "default: 5\n")
    with pytest.raises(OutputRateConfigError, match=LIMITS_FILE_OPTION):
        OutputRateConfig.from_options("10", None, str(path))
    with pytest.raises(OutputRateConfigError, match="cannot read"):
        OutputRateConfig.from_options(None, None, str(tmp_path / "missing.yaml"))


def test_limits_file_values_are_exact(tmp_path):
    path = tmp_path / "limits.yaml"
    write(path, "default: 0.1\ntiers: {gold: '1e2', third: 1/3}\n"
                "users: {alice: gold, bob: 12.5, carol: third, 42: 7}\n")
    config = load_limits_file(str(path))
    assert config.default_rate == Fraction(1, 10)
    assert config.user_rates == {"alice": 100, "bob": Fraction(25, 2),
                                 "carol": Fraction(1, 3), "42": 7}
    assert config.user_tiers == {"alice": "gold", "carol": "third"}
    again = OutputRateConfig.from_dict(config.to_dict())
    assert again == config and again.digest == config.digest


def test_telemetry_follows_a_reload(tmp_path):
    from harness import attach_telemetry
    from vllm_output_rate.telemetry.events import EngineLog

    path = tmp_path / "limits.yaml"
    write(path, "default: 100\nusers: {user-a: 20, gone: 3}\n")
    clock = VirtualClock()
    sched = make_scheduler(load_limits_file(str(path)).to_dict(), clock=clock)
    events = tmp_path / "events.jsonl"
    tel = attach_telemetry(sched, str(tmp_path), start_thread=False, events_path=str(events))
    drv = Driver(sched, clock, step_ms=10.0)
    drv.add(make_request("user-a", max_tokens=300), make_request("newbie", max_tokens=300))
    drv.run(50)

    def snap():
        data = tel.snapshot()
        return ({(n, tuple(l)): v for n, l, v in data["counters"]},
                {(n, tuple(l)): v for n, l, v in data["gauges"]})

    counters, gauges = snap()
    assert gauges[("user_limit_tokens_per_second", ("user-a",))] == 20
    assert gauges[("limits_info", (sched.output_rate.config.digest, str(path)))] == 1
    old_digest = sched.output_rate.config.digest
    write(path, "default: 100\nusers: {user-a: 40, fresh: 7}\n")
    assert sched.output_rate.watcher.check() == "loaded"
    write(path, "default: 100\nusers: {user-a: nope}\n")
    assert sched.output_rate.watcher.check() == "invalid"
    drv.run(50)
    counters, gauges = snap()
    new_digest = sched.output_rate.config.digest
    assert new_digest != old_digest
    assert gauges[("user_limit_tokens_per_second", ("user-a",))] == 40
    assert gauges[("user_limit_tokens_per_second", ("fresh",))] == 7
    # no longer listed: the default now, until its idle label is given up
    assert gauges.get(("user_limit_tokens_per_second", ("gone",)), 100) == 100
    assert ("limits_info", (old_digest, str(path))) not in gauges
    assert gauges[("limits_info", (new_digest, str(path)))] == 1
    assert counters[("limits_reloads", ("loaded",))] == 1
    assert counters[("limits_reloads", ("invalid",))] == 1
    assert counters[("tokens_charged", ("fresh",))] == 0  # a newly listed user's series
    tel.export()
    log = EngineLog.read(events)
    (change,) = log.limit_changes
    assert change["limits"] == {"user-a": 40.0, "fresh": 7.0}
    assert change["added"] == ["fresh"] and change["removed"] == ["gone"]
    assert change["changed"] == ["user-a"] and change["sha256"] == new_digest


def test_sighup_ignored_by_nohup_is_taken_over():
    """Under ``nohup`` SIGHUP is ignored (and stays ignored in every child
    process): reloading on it is what such an operator wants too."""
    saved = limits_watch._hup_installed
    before = signal.getsignal(signal.SIGHUP)
    limits_watch._hup_installed = False
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert limits_watch.install_sighup()
        assert signal.getsignal(signal.SIGHUP) is limits_watch._on_sighup
        signal.signal(signal.SIGHUP, lambda *a: None)  # another program's own handler
        limits_watch._hup_installed = False
        assert not limits_watch.install_sighup()
    finally:
        signal.signal(signal.SIGHUP, before)
        limits_watch._hup_installed = saved


def test_a_file_read_empty_while_rewritten_is_not_counted(tmp_path):
    """A file rewritten in place (truncated, then written) reads empty in
    between: that look changes nothing and counts nothing; the content
    written after it is what counts. A file left empty is invalid at the
    next look, counted once; SIGHUP's forced read does not wait."""
    from vllm_output_rate.limits_watch import LimitsWatcher

    path = tmp_path / "limits.yaml"
    path.write_text("default: 10\n")
    watcher = LimitsWatcher(load_limits_file(str(path)), start_thread=False)
    path.write_text("")  # the moment between the truncation and the write
    assert watcher.check() is None
    path.write_text("default: 20\n")
    assert watcher.check() == "loaded"
    assert watcher.results == {"loaded": 1, "unchanged": 0, "invalid": 0, "unreadable": 0}
    path.write_text("")  # left empty
    assert watcher.check() is None
    assert watcher.check() == "invalid"
    assert watcher.check() is None  # counted once
    assert watcher.results["invalid"] == 1 and watcher.current.default_rate == 20
    path.write_text("default: 30\n")
    assert watcher.check() == "loaded"
    path.write_text("")
    watcher.request_reload()
    assert watcher.check() == "invalid"  # SIGHUP: read as it is
