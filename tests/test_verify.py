"""The verifier's checks on synthetic engine event logs: every check passes on a
correct run and fails on a run that breaks what it checks.

The synthetic runs come from a toy engine: fixed step time, one token per
request per step, the limiter's GCRA per user (burst 0.1 s), streams of a user
taking turns, events written the way the engine core writes them.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.tools.verify import cli as verify
from vllm_output_rate.tools.verify.checks import IDLE_GAUGES
from vllm_output_rate.tools.verify.report import PLOTS
from vllm_output_rate.tools.loadgen.run import RequestRecord, RunRecord
from vllm_output_rate.tools.loadgen.scenario import parse_scenario
from vllm_output_rate.tools.verify.analysis import Analysis, Metrics, base_request_id
from vllm_output_rate.telemetry.events import EngineLog
from vllm_output_rate.tools.verify.cli import analyze_and_report
from vllm_output_rate.tools.verify.gcra import gcra_worst_window
from vllm_output_rate.tools.verify.checks import run_checks

SCENARIO = {
    "name": "synthetic",
    "users": {"a": 20, "b": 60, "c": "unlimited"},
    "prompts": {"short": "hi", "long": {"tokens": 40},
                "shared": {"prefix": "long", "text": "q", "unique": True}},
    "phases": [
        {"name": "baseline", "streams": [{"user": "c", "prompt": "short", "max_tokens": 300}]},
        {"name": "mixed", "streams": [
            {"user": "a", "prompt": "short", "max_tokens": 40, "count": 3},
            {"user": "a", "prompt": "shared", "max_tokens": 30, "cancel_after_tokens": 5},
            {"user": "b", "prompt": "long", "max_tokens": 100, "count": 2},
            {"user": "b", "prompt": "short", "max_tokens": 100, "ignore_eos": False},
            {"user": "c", "prompt": "short", "max_tokens": 300, "start_s": 0.5},
        ]},
    ],
    "checks": {"baseline_phase": "baseline", "compare_phase": "mixed"},
}
MS = 1_000_000
S = 1_000_000_000
#: the toy engine's EOS: a stream that may stop early stops after this many tokens
EOS_AFTER = 10


def simulate(scenario_dict=SCENARIO, *, engine_limits=None, step_ms=5.0, compare_step_ms=None,
             rotate=True):
    """Run the scenario through the toy engine: (scenario, run, engine log, metrics)."""
    sc = parse_scenario(copy.deepcopy(scenario_dict), "synthetic.yaml")
    limits = {u: Fraction(v) for u, v in (engine_limits or sc.server_limits()).items()}
    default = sc.server.default_limit
    lines = [{"kind": "start", "t_ns": 0, "unix_ns": 10**18, "limits": {u: float(v) for u, v in limits.items()},
              "default_limit": float(default)}]
    run = RunRecord(sc.name, "sim", "http://sim", 10**18, 0.0)
    tat: dict[str, int] = {}
    skipped: dict[str, int] = {}
    charged: dict[str, int] = {}
    last_turn: dict[str, int] = {}
    seq = 0
    t = 10 * MS
    next_throttled = t
    for phase in sc.phases:
        step = int((compare_step_ms if compare_step_ms and phase.name == sc.checks.compare_phase
                    else step_ms) * MS)
        reqs = []
        for spec in phase.streams:
            for _ in range(spec.count):
                rec = RequestRecord(f"orl-sim-{seq:04d}", phase.name, spec.user, spec.prompt,
                                    spec.max_tokens, spec.ignore_eos, spec.cancel_after_tokens,
                                    spec.cancel_after_s, spec.start_s, sent=(t + spec.start_s * S) / S)
                eid = f"chatcmpl-{rec.rid}-{seq:08x}"
                end = spec.max_tokens if spec.ignore_eos else min(spec.max_tokens, EOS_AFTER)
                reqs.append({"rec": rec, "eid": eid, "arrive": t + int(spec.start_s * S),
                             "end": end, "n": 0, "done": False, "seq": seq})
                run.requests.append(rec)
                seq += 1
        phase_start = t
        while not all(r["done"] for r in reqs):
            out = t + step
            toks = []
            refused: dict[str, int] = {}
            by_user: dict[str, list] = {}
            for r in reqs:
                if not r["done"] and r["arrive"] <= t:
                    by_user.setdefault(r["rec"].user, []).append(r)
            for user, rs in by_user.items():
                if rotate:  # streams take turns: start after the one served last
                    after = [r for r in rs if r["seq"] > last_turn.get(user, -1)]
                    rs = after + [r for r in rs if r not in after]
                rate = limits.get(user, default)
                for r in rs:
                    cur = tat.get(user, t)
                    if cur - t <= 100 * MS:
                        tat[user] = max(cur, t) + int(Fraction(S) / rate)
                        charged[user] = charged.get(user, 0) + 1
                        last_turn[user] = r["seq"]
                        r["n"] += 1
                        toks.append([r["eid"], user, 1])
                        r["rec"].chunks.append((out / S, r["n"]))
                        r["rec"].completion_tokens = r["n"]
                    else:
                        refused[user] = refused.get(user, 0) + 1
                        skipped[user] = skipped.get(user, 0) + 1
            if toks:
                lines.append({"kind": "tokens", "t_ns": out, "tokens": toks})
            for r in reqs:
                rec = r["rec"]
                if r["done"]:
                    continue
                if rec.cancel_after_tokens is not None and r["n"] >= rec.cancel_after_tokens:
                    rec.cancelled, r["done"] = True, True
                    lines.append({"kind": "finished", "t_ns": out + step, "request_id": r["eid"],
                                  "user": rec.user, "reason": "abort", "output_tokens": r["n"]})
                elif r["n"] >= r["end"]:
                    rec.finish_reason = "length" if r["n"] == rec.max_tokens else "stop"
                    r["done"] = True
                    lines.append({"kind": "finished", "t_ns": out, "request_id": r["eid"],
                                  "user": rec.user, "reason": rec.finish_reason,
                                  "output_tokens": r["n"]})
            if out >= next_throttled:
                lines.append({"kind": "throttled", "t_ns": out, "requests": dict(refused),
                              "kv_blocks": {u: 2 * n for u, n in refused.items()},
                              "kv_share": sum(refused.values()) / 1000})
                next_throttled = out + S
            t = out
        run.phases[phase.name] = (phase_start / S, t / S)
        t += int(phase.gap_s * S)
    lines.append({"kind": "throttled", "t_ns": t + S // 2, "requests": {}, "kv_blocks": {},
                  "kv_share": 0.0})
    lines.sort(key=lambda e: e["t_ns"])
    log = EngineLog.from_lines(json.dumps(e) for e in lines)

    def sample(name, value, **labels):
        return {(name, tuple(sorted(labels.items()))): float(value)}

    before, after = {}, {}
    for user in sc.users:
        before |= sample("vllm_output_rate_tokens_charged_total", 0, user=user)
        before |= sample("vllm_output_rate_requests_skipped_total", 0, user=user)
        after |= sample("vllm_output_rate_tokens_charged_total", charged.get(user, 0), user=user)
        after |= sample("vllm_output_rate_requests_skipped_total", skipped.get(user, 0), user=user)
    before |= sample("vllm:prefix_cache_hits_total", 0)
    after |= sample("vllm:prefix_cache_hits_total", 64)
    final = {}
    for name in IDLE_GAUGES:
        final |= sample(name, 0)
    return sc, run, log, Metrics(before, after, final)


@pytest.fixture(scope="module")
def good():
    return simulate()


def checks_of(sc, run, log, metrics):
    checks, stats = run_checks(Analysis(sc, run, log, metrics))
    return {c.label: c for c in checks}, stats


def failed(checks):
    return sorted(label for label, c in checks.items() if not c.ok)


def test_a_correct_run_passes_every_check(good):
    checks, stats = checks_of(*good)
    assert failed(checks) == []
    names = {c.name for c in checks.values()}
    assert names == {"events", "limits", "gcra_bound", "rate", "spacing", "complete", "resumed",
                     "freed", "charged", "unlimited", "prefix_cache"}
    assert {"gcra_bound[a]", "gcra_bound[b]", "rate[a]", "spacing[b]", "unlimited[c]"} <= set(checks)
    assert "gcra_bound[c]" not in checks  # unlimited users have no bound to check
    assert stats["a"].rate == pytest.approx(20, rel=0.03)
    assert stats["b"].rate == pytest.approx(60, rel=0.03)
    assert stats["a"].normalized_p50 == pytest.approx(1, abs=0.1)


def test_a_limit_raised_in_the_engine_but_not_in_the_expectation_fails(good):
    sc, run, log, metrics = simulate(engine_limits={"a": 40, "b": 60, "c": 100_000})
    checks, stats = checks_of(sc, run, log, metrics)
    assert {"gcra_bound[a]", "limits[a]", "spacing[a]"} <= set(failed(checks))
    assert not any(label.endswith("[b]") for label in failed(checks))
    assert stats["a"].rate == pytest.approx(40, rel=0.05)
    assert "over the bound" in checks["gcra_bound[a]"].summary


def test_the_gcra_bound_is_exact():
    rate = Fraction(20)
    # the most GCRA allows from idle: 3 tokens at once (burst 0.1 s = 2, plus 1),
    # then one every 50 ms
    events = [(0, 3)] + [(k * 50 * MS, 1) for k in range(1, 40)]
    assert gcra_worst_window(events, rate)["excess"] == 0
    assert gcra_worst_window([(0, 4)] + events[1:], rate)["excess"] == 1
    early = events[:10] + [(events[10][0] - 1, 1)] + events[11:]  # one token 1 ns early
    worst = gcra_worst_window(early, rate)
    assert worst["excess"] == 1 and worst["violations"] >= 1
    # fractional limits are exact too: 0.5 tok/s, one token every 2 s after 1
    half = [(0, 1), (2 * S, 1), (4 * S, 1)]
    assert gcra_worst_window(half, Fraction(1, 2))["excess"] == 0
    assert gcra_worst_window([(0, 1), (2 * S - 1, 1)] + half[1:], Fraction(1, 2))["excess"] == 1


def test_one_engine_step_of_slack_only():
    """Tokens are stamped when their step's output is processed, charged when it
    was dispatched: a slow step followed by a fast one brings stamps closer than
    the charges were. Measuring from the engine's previous output covers it."""
    rate = Fraction(20)
    # dispatched at 0 (3 tokens, burst) and at 50 ms (1 token); the first step
    # took 30 ms, the second 10 ms: stamps 30 ms and 60 ms; previous output at 0
    events = [(30 * MS, 3), (60 * MS, 1)]
    assert gcra_worst_window(events, rate)["excess"] == 1  # strict: 4 tokens in 30 ms
    assert gcra_worst_window(events, rate, starts=[0, 30 * MS])["excess"] == 0
    # the slack is one step, not a blank cheque: a real excess still fails
    assert gcra_worst_window([(30 * MS, 4), (60 * MS, 1)], rate, starts=[0, 30 * MS])["excess"] == 1


def test_the_analysis_takes_the_dispatch_bound_from_the_previous_engine_output(good):
    sc, run, log, metrics = good
    a = Analysis(sc, run, log, metrics)
    stamps = [t for t, _ in a.log.steps]
    t = stamps[5]
    assert a.log.dispatch_lower_bounds([t], a.lag) == [stamps[4]]
    a.lag = 2  # async scheduling: one step in flight
    assert a.log.dispatch_lower_bounds([t], a.lag) == [stamps[3]]
    assert a.log.dispatch_lower_bounds([stamps[0]], 1) == [-(1 << 62)]  # nothing before
    assert verify.is_async(sc, {"async_scheduling": True})
    assert not verify.is_async(sc, None)


def test_a_user_held_below_its_limit_fails_the_rate_check():
    checks, _ = checks_of(*simulate(engine_limits={"a": 17, "b": 60, "c": 100_000}))
    assert "rate[a]" in failed(checks)
    assert checks["gcra_bound[a]"].ok  # below the limit is within the bound


def test_streams_that_do_not_take_turns_fail_the_spacing_check():
    checks, stats = checks_of(*simulate(rotate=False))
    assert "spacing[a]" in failed(checks)
    assert checks["rate[a]"].ok and checks["gcra_bound[a]"].ok


def test_an_incomplete_answer_fails(good):
    sc, run, log, metrics = copy.deepcopy(good)
    victim = next(r for r in run.requests if r.user == "b" and r.ignore_eos)
    victim.completion_tokens -= 7
    victim.finish_reason = None
    victim.error = "RemoteProtocolError: peer closed connection"
    checks, _ = checks_of(sc, run, log, metrics)
    assert failed(checks) == ["complete[b]"]
    assert any(victim.rid in d for d in checks["complete[b]"].details)


def test_a_count_mismatch_or_a_missing_finish_fails(good):
    sc, run, log, metrics = copy.deepcopy(good)
    short = next(r for r in run.requests if r.user == "a" and not r.cancelled)
    short.completion_tokens -= 1  # the server's usage disagrees with the engine
    checks, _ = checks_of(sc, run, log, metrics)
    assert "complete[a]" in failed(checks)
    assert "engine tokens" in " ".join(checks["complete[a]"].details)

    sc, run, log, metrics = copy.deepcopy(good)
    eid = next(e for e in log.finished if base_request_id(e) == short.rid)
    del log.finished[eid]
    checks, _ = checks_of(sc, run, log, metrics)
    assert "complete[a]" in failed(checks) and "resumed[a]" in failed(checks)


def test_an_early_stop_is_complete_but_an_ignore_eos_stream_must_be_full(good):
    sc, run, log, metrics = good
    eos = next(r for r in run.requests if not r.ignore_eos)
    assert eos.finish_reason == "stop" and eos.completion_tokens == EOS_AFTER
    sc2, run2, log2, metrics2 = copy.deepcopy(good)
    full = next(r for r in run2.requests if r.user == "c")
    full.max_tokens += 1  # asked for one more than the engine produced
    checks, _ = checks_of(sc2, run2, log2, metrics2)
    assert failed(checks) == ["complete[c]"]


def test_a_cancelled_request_left_in_the_engine_fails_freed(good):
    sc, run, log, metrics = copy.deepcopy(good)
    cancelled = next(r for r in run.requests if r.cancelled)
    del log.finished[next(e for e in log.finished if base_request_id(e) == cancelled.rid)]
    checks, _ = checks_of(sc, run, log, metrics)
    assert "freed[all]" in failed(checks)
    assert cancelled.rid in " ".join(checks["freed[all]"].details)


@pytest.mark.parametrize("cancelled", [True, False])
def test_a_request_cancelled_before_the_engine_had_it_is_no_failure(good, cancelled):
    """A request the client cancelled before the engine's scheduler had it
    (its front end slow on a loaded machine: no token, no event, nothing
    held) is named, not failed; a request with no engine event that the
    client did not cancel is one the log lost."""
    sc, run, log, metrics = copy.deepcopy(good)
    template = next(r for r in run.requests if r.user == "a")
    late = dataclasses.replace(template, rid=template.rid + "-late", chunks=[],
                               completion_tokens=0, finish_reason=None,
                               cancelled=cancelled, cancel_after_tokens=None,
                               cancel_after_s=0.5, error=None)
    run.requests.append(late)
    checks, _ = checks_of(sc, run, log, metrics)
    details = " ".join(checks["events[all]"].details)
    assert late.rid in details
    if cancelled:
        assert not {"events[all]", "freed[all]"} & set(failed(checks))
        assert "(not a failure)" in details
    else:
        assert "events[all]" in failed(checks)


@pytest.mark.parametrize("gauge", IDLE_GAUGES)
def test_anything_left_running_waiting_or_throttled_fails_freed(good, gauge):
    sc, run, log, metrics = copy.deepcopy(good)
    key = next(k for k in metrics.final if k[0] == gauge)
    metrics.final[key] = 1.0
    checks, _ = checks_of(sc, run, log, metrics)
    assert failed(checks) == ["freed[all]"]
    assert gauge in " ".join(checks["freed[all]"].details)


def test_a_throttled_state_left_after_the_run_fails_freed(good):
    sc, run, log, metrics = copy.deepcopy(good)
    log.throttled[-1] = {**log.throttled[-1], "requests": {"a": 1}, "kv_blocks": {"a": 3}}
    checks, _ = checks_of(sc, run, log, metrics)
    assert failed(checks) == ["freed[all]"]
    metrics.final = None
    metrics.error = "ConnectError: refused"
    checks, _ = checks_of(sc, run, log, metrics)
    assert "refused" in " ".join(checks["freed[all]"].details)


def test_a_user_never_throttled_or_a_stalled_request_fails_resumed(good):
    d = copy.deepcopy(SCENARIO)
    d["users"]["a"] = 1000  # far above demand: the run does not exercise the limit
    checks, _ = checks_of(*simulate(d))
    assert "resumed[a]" in failed(checks)
    assert "never throttled" in " ".join(checks["resumed[a]"].details)

    sc, run, log, metrics = copy.deepcopy(good)
    a = Analysis(sc, run, log, metrics)
    victim = next(rd for rd in a.user_reqs("a") if not rd.cancelled)
    # the victim's last token came 10 s later: it sat throttled far too long
    eid = victim.engine_ids[0]
    shifted = []
    for t, toks in log.steps:
        if any(e == eid for e, _, _ in toks) and t == victim.last_ns:
            rest = [x for x in toks if x[0] != eid]
            if rest:
                shifted.append((t, rest))
            shifted.append((t + 10 * S, [(eid, "a", 1)]))
        else:
            shifted.append((t, toks))
    log.steps = sorted(shifted, key=lambda s: s[0])
    checks, _ = checks_of(sc, run, log, metrics)
    assert "resumed[a]" in failed(checks)
    assert "stalled" in " ".join(checks["resumed[a]"].details)
    # the scenario's allowance is what the check reads: 10 s more passes
    longer = dataclasses.replace(sc, checks=dataclasses.replace(sc.checks, stall_extra_s=11.0))
    checks, _ = checks_of(longer, run, log, metrics)
    assert "resumed[a]" not in failed(checks), checks["resumed[a]"]


def test_under_charging_fails(good):
    sc, run, log, metrics = copy.deepcopy(good)
    key = ("vllm_output_rate_tokens_charged_total", (("user", "b"),))
    metrics.after[key] -= 1
    checks, _ = checks_of(sc, run, log, metrics)
    assert failed(checks) == ["charged[b]"]
    metrics.after[key] += 100  # far more than one step per request
    checks, _ = checks_of(sc, run, log, metrics)
    assert failed(checks) == ["charged[b]"]


def test_an_unlimited_user_slowed_down_fails():
    checks, _ = checks_of(*simulate(compare_step_ms=6.0))  # 1.2x: within 1.5x
    assert checks["unlimited[c]"].ok
    checks, _ = checks_of(*simulate(compare_step_ms=10.0))  # 2x
    assert "unlimited[c]" in failed(checks)
    assert "ratio 2.00" in checks["unlimited[c]"].summary


def test_no_prefix_cache_hit_fails(good):
    sc, run, log, metrics = copy.deepcopy(good)
    metrics.after[("vllm:prefix_cache_hits_total", ())] = 0
    checks, _ = checks_of(sc, run, log, metrics)
    assert failed(checks) == ["prefix_cache[all]"]


def test_the_engine_limits_must_match_the_expectation(good):
    sc, run, log, metrics = copy.deepcopy(good)
    log.starts[-1]["limits"]["b"] = 61.0
    checks, _ = checks_of(sc, run, log, metrics)
    assert failed(checks) == ["limits[b]"]
    log.starts[-1]["limits"]["c"] = 100.0  # "unlimited" c limited below 10x its rate
    checks, _ = checks_of(sc, run, log, metrics)
    assert "limits[c]" in failed(checks)


def test_the_limits_in_force_are_the_last_reload_before_the_run(good):
    """A limits file reloaded before the run: the engine's limits are the
    reload's, not its start line's; one reloaded during the run fails the
    limits check of the users it moved (the scenario assumes one limit)."""
    sc, run, log, metrics = copy.deepcopy(good)
    first = min(t for t, _ in log.steps)
    last = max(t for t, _ in log.steps)
    start = log.starts[-1]
    log.starts[-1] = {**start, "limits": {**start["limits"], "a": 5.0}}
    assert failed(checks_of(sc, run, log, metrics)[0]) == ["limits[a]"]
    # reloaded back to the expectation before the run's first token: in force
    log.limit_changes.append({"kind": "limits", "t_ns": first - 1, "limits": dict(start["limits"]),
                              "default_limit": start["default_limit"]})
    checks, _ = checks_of(sc, run, log, metrics)
    assert failed(checks) == []
    assert "engine limit 20 tok/s, expected 20" in checks["limits[a]"].summary
    # a change of b's limit in the middle of the run
    mid = (first + last) // 2
    log.limit_changes.append({"kind": "limits", "t_ns": mid,
                              "limits": {**start["limits"], "b": 90.0},
                              "default_limit": start["default_limit"]})
    checks, _ = checks_of(sc, run, log, metrics)
    assert failed(checks) == ["limits[b]"]
    assert "changed during the run: 90 tok/s at +" in checks["limits[b]"].summary
    # a change made by an earlier engine (before this engine's start line) is not this one's
    sc, run, log, metrics = copy.deepcopy(good)
    log.limit_changes.append({"kind": "limits", "t_ns": int(log.starts[-1]["t_ns"]) - 1,
                              "limits": {"a": 5.0}, "default_limit": 1.0})
    assert failed(checks_of(sc, run, log, metrics)[0]) == []


def test_events_missing_or_unreadable_fail(good):
    sc, run, log, metrics = copy.deepcopy(good)
    log.starts.clear()
    checks, _ = checks_of(sc, run, log, metrics)
    assert "events[all]" in failed(checks)
    empty = EngineLog()
    checks, _ = checks_of(sc, run, empty, metrics)
    assert {"events[all]", "gcra_bound[a]", "complete[a]", "freed[all]"} <= set(failed(checks))


def test_events_dropped_by_the_engine_fail(good):
    sc, run, log, metrics = copy.deepcopy(good)
    metrics.after[("vllm_output_rate_telemetry_dropped_total", (("reason", "events_queue_full"),))] = 3
    checks, _ = checks_of(sc, run, log, metrics)
    assert failed(checks) == ["events[all]"]
    assert "dropped 3" in " ".join(checks["events[all]"].details)


def test_the_log_reader_skips_a_half_written_last_line_only():
    lines = [json.dumps({"kind": "start", "t_ns": 1, "limits": {}, "default_limit": 5}),
             json.dumps({"kind": "tokens", "t_ns": 9, "tokens": [["chatcmpl-x-0123abcd", "u", 2]]}),
             "{\"kind\": \"tokens\", \"t_n"]
    log = EngineLog.from_lines(lines)
    assert log.bad_lines == [] and log.steps == [(9, [("chatcmpl-x-0123abcd", "u", 2)])]
    log = EngineLog.from_lines([lines[2]] + lines[:2])
    assert log.bad_lines == [1]


def test_engine_request_ids_map_back_to_the_client_id():
    assert base_request_id("chatcmpl-orl-ab12-0007-1f2e3d4c") == "orl-ab12-0007"
    assert base_request_id("orl-ab12-0007") == "orl-ab12-0007"
    assert base_request_id("chatcmpl-orl-ab12-0007") == "orl-ab12-0007"


def test_report_and_exit_code(good, tmp_path):
    sc, run, log, metrics = copy.deepcopy(good)
    assert analyze_and_report(sc, run, log, metrics, tmp_path / "ok") == 0
    report = (tmp_path / "ok" / "report.md").read_text()
    assert report.startswith("# Engine-side ITL verification: PASS")
    for png in PLOTS:
        assert (tmp_path / "ok" / png).stat().st_size > 1000
        assert f"]({png})" in report
    assert "Step slack" in report or "step slack" in report.lower()
    verdicts = json.loads((tmp_path / "ok" / "checks.json").read_text())
    assert all(v["ok"] for v in verdicts)

    sc, run, log, metrics = simulate(engine_limits={"a": 40, "b": 60, "c": 100_000})
    assert analyze_and_report(sc, run, log, metrics, tmp_path / "bad") == 1
    report = (tmp_path / "bad" / "report.md").read_text()
    assert report.startswith("# Engine-side ITL verification: FAIL")
    assert "`gcra_bound[a]` | **FAIL**" in report


def test_the_cli_refuses_bad_input(tmp_path, capsys):
    bad = tmp_path / "s.yaml"
    bad.write_text("users: {a: -1}\nprompts: {p: x}\nphases: []\n")
    assert verify.main(["--server", "http://127.0.0.1:9", "--events", "x", "--scenario",
                        str(bad), "--report", str(tmp_path / "r")]) == 2
    assert "users.a" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        verify.main(["--server", "http://127.0.0.1:9", "--report", str(tmp_path / "r")])
    assert exc.value.code == 2
    assert "--events" in capsys.readouterr().err


def test_the_log_is_read_once_every_request_finished_and_the_engine_went_idle(good, tmp_path):
    sc, run, log, metrics = good
    path = tmp_path / "events.jsonl"
    fin = [{"kind": "finished", "t_ns": 10 + i, "request_id": f"chatcmpl-{r.rid}-0000abcd",
            "user": r.user, "reason": "length", "output_tokens": 1}
           for i, r in enumerate(run.requests)]
    idle = {"kind": "throttled", "t_ns": 10_000, "requests": {}, "kv_blocks": {}, "kv_share": 0}
    path.write_text("".join(json.dumps(e) + "\n" for e in fin[:-1]))
    partial = verify._wait_for_engine_log(path, run, timeout_s=0.2)  # gives up: one missing
    assert len(partial.finished) == len(run.requests) - 1
    path.write_text("".join(json.dumps(e) + "\n" for e in fin + [idle]))
    done = verify._wait_for_engine_log(path, run, timeout_s=60)
    assert len(done.finished) == len(run.requests) and done.throttled[-1]["t_ns"] == 10_000


def test_the_reports_quantile_interpolates_linearly_between_ranks():
    import math
    import random

    import numpy as np

    from vllm_output_rate.tools.common.stats import quantile

    assert math.isnan(quantile([], 0.5))
    assert quantile([3.0], 0.99) == 3.0
    assert quantile([4.0, 1.0, 2.0, 3.0], 0.5) == 2.5
    rng = random.Random(7)
    for n in (1, 2, 5, 100):
        values = [rng.uniform(0, 50) for _ in range(n)]
        for q in (0.0, 0.1, 0.5, 0.9, 0.99, 1.0):
            assert quantile(values, q) == pytest.approx(float(np.quantile(values, q)), abs=1e-12)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 400), st.integers(1, 4)), min_size=1, max_size=40),
       st.lists(st.integers(0, 60), min_size=40, max_size=40),
       st.sampled_from([Fraction(20), Fraction(1, 2), Fraction(7, 3), Fraction(100)]),
       st.booleans())
def test_the_one_pass_excess_gives_the_same_verdict_as_every_window(steps, slack, rate, with_starts):
    """``gcra_max_excess`` (O(n), for soak-length runs) against the window
    by window check: a violation exactly when the other finds one."""
    from vllm_output_rate.tools.verify.gcra import gcra_max_excess

    events, t = [], 0
    for gap_ms, n in steps:
        t += gap_ms * MS
        events.append((t, n))
    starts = [t - s * MS for (t, _), s in zip(events, slack)] if with_starts else None
    exact = gcra_worst_window(events, rate, starts)
    excess, (i, j) = gcra_max_excess(events, rate, starts)
    assert (excess > 0) == (exact["excess"] > 0), (excess, exact)
    assert i <= j < len(events)
    # the window it names has that excess
    s_i = events[i][0] if starts is None else min(starts[i], events[i][0])
    tokens = sum(n for _, n in events[i:j + 1])
    assert excess == tokens - (Fraction(events[j][0] - s_i + 100 * MS, 10**9)) * rate - 1


def _with_prompts(good, lines, chunked=True, prompt_tokens=0):
    """The good run, its engine's start line naming a prompt budget for a
    (100 prompt tokens/s; b listed without one) and these prompt lines."""
    sc, run, log, metrics = good
    start = {**log.starts[0], "prompt_limits": {"a": 100.0, "b": None},
             "default_prompt_limit": None, "chunked_prefill": chunked}
    run = copy.deepcopy(run)
    for rec in run.requests:
        rec.prompt_tokens = prompt_tokens
    log = copy.deepcopy(log)
    log.starts = [start]
    log.prompts = [(t, {"a": n, "b": 10 * n}) for t, n in lines]
    return checks_of(sc, run, log, metrics)[0]


def test_the_prompt_budgets_bound_is_checked_where_the_limits_carry_one(good):
    """prompt_bound for a (b's prompts are not budgeted, and no check
    without prompt budgets at all): a token each 10 ms at 100 tok/s holds;
    two each 10 ms does not; without chunked prefill a whole prompt is
    allowed over the bound by its size."""
    assert not any(label.startswith("prompt_bound") for label in checks_of(*good)[0])
    steady = [(10 * MS * k, 1) for k in range(1, 300)]
    checks = _with_prompts(good, steady)
    assert [label for label in checks if label.startswith("prompt_bound")] == ["prompt_bound[a]"]
    assert checks["prompt_bound[a]"].ok and "chunked prefill" in checks["prompt_bound[a]"].summary
    over = _with_prompts(good, [(10 * MS * k, 2) for k in range(1, 300)])
    assert not over["prompt_bound[a]"].ok and "over the bound" in over["prompt_bound[a]"].summary
    whole = [(S, 400), (5 * S, 400)]  # 400 tokens at once, 4 s apart: the debt paid back
    assert not _with_prompts(good, whole, chunked=False)["prompt_bound[a]"].ok
    assert _with_prompts(good, whole, chunked=False, prompt_tokens=400)["prompt_bound[a]"].ok
