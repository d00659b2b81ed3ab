"""The soak (``vllm-output-rate soak``): its checks on made-up runs (each
can fail), and a short variant against a real CPU engine."""

from __future__ import annotations

import json

import pytest

from harness import second_model, tiny_model
from vllm_output_rate.tools.reliability import soak

S = 1_000_000_000


def test_slope_and_quantiles():
    assert soak.slope_per_hour([(0, 100.0), (1800, 101.0), (3600, 102.0)]) == pytest.approx(2.0)
    assert soak.slope_per_hour([(0, 5.0)]) == 0.0
    assert soak.slope_per_hour([(0, float("nan")), (10, 1.0), (20, 1.0)]) == 0.0
    # idle gaps are not steps
    assert soak.step_times([0, 10, 30, 2 * S, 2 * S + 7], 0, 3 * S) == [10, 20, 7]
    q = soak.quantiles_ms([i * 1_000_000 for i in range(1, 101)])
    assert (q["n"], q["p50"], q["max"]) == (100, 50.5, 100.0)  # interpolated, as stats.quantile


def _events(path, spends):
    """An event log with one tokens line per (t_ns, user, n)."""
    lines = [json.dumps({"kind": "start", "t_ns": 0})]
    for i, (t, user, n) in enumerate(spends):
        lines.append(json.dumps({"kind": "tokens", "t_ns": t, "tokens": [[f"r{i}", user, n]]}))
    path.write_text("\n".join(lines) + "\n")


def _paced(user, rate, seconds, t0=0):
    step = S // rate
    return [(t0 + k * step, user, 1) for k in range(seconds * rate)]


def test_the_conformance_check_passes_a_paced_run_and_fails_an_excess(tmp_path):
    good = _paced("soak-slow", 5, 20) + _paced("soak-mid", 20, 20) + _paced("churn-0", 50, 1)
    _events(tmp_path / "good.jsonl", sorted(good))
    report = soak.Report("m", 1, [])
    soak.analyse_events(report, tmp_path / "good.jsonl", 0, 20 * S)
    conformance = report.checks[0]
    assert conformance.ok, conformance
    assert report.conformance["soak-mid"]["rate"] == pytest.approx(20, rel=0.01)
    # 3 tokens more, late in a long run: over the bound in one window only
    bad = good + [(15 * S + 1, "soak-mid", 1)] * 3
    _events(tmp_path / "bad.jsonl", sorted(bad))
    report = soak.Report("m", 1, [])
    soak.analyse_events(report, tmp_path / "bad.jsonl", 0, 20 * S)
    assert not report.checks[0].ok and "soak-mid" in report.checks[0].measured


def test_the_step_time_check_fails_a_loop_that_slows_down(tmp_path):
    steady = [(k * 10_000_000, "soak-free", 1) for k in range(2000)]  # 10 ms steps, 20 s
    _events(tmp_path / "steady.jsonl", steady)
    report = soak.Report("m", 1, [])
    soak.analyse_events(report, tmp_path / "steady.jsonl", 0, 20 * S)
    assert report.checks[1].ok, report.checks[1]
    slowing = [(k * 10_000_000 + (k * k * 5_000 if k > 1000 else 0), "soak-free", 1) for k in range(2000)]
    _events(tmp_path / "slow.jsonl", slowing)
    report = soak.Report("m", 1, [])
    soak.analyse_events(report, tmp_path / "slow.jsonl", 0, slowing[-1][0])
    assert not report.checks[1].ok, report.checks[1]


def _samples(rss, final_requests=0.0):
    out = [soak.Sample(t * 60.0, r, 300.0, {"limiter.users": 10.0, "users.activity": 20.0,
                                              "requests.label": 5.0}) for t, r in enumerate(rss)]
    out.append(soak.Sample(len(rss) * 60.0, rss[-1], 300.0, {"limiter.users": 3.0, "users.activity": 20.0,
                                                             "requests.label": final_requests}))
    return out


def test_the_memory_checks_pass_a_flat_run_and_fail_growth_or_leaked_state():
    report = soak.Report("m", 10, [], samples=_samples([900.0, 950.0, 951.0, 950.5, 951.2, 950.8]))
    soak.analyse_samples(report, 10)
    assert all(c.ok for c in report.checks), report.checks
    assert abs(report.rss_slope_mib_per_hour) < 30
    report = soak.Report("m", 10, [], samples=_samples([900.0, 950.0, 980.0, 1010.0, 1040.0, 1070.0]))
    soak.analyse_samples(report, 10)
    assert not report.checks[0].ok and report.rss_slope_mib_per_hour > 1000
    report = soak.Report("m", 10, [], samples=_samples([900.0] * 6, final_requests=2.0))
    soak.analyse_samples(report, 10)
    assert report.checks[0].ok and not report.checks[1].ok


@pytest.mark.e2e
@pytest.mark.long
@pytest.mark.parametrize("model,minutes", [("tiny", 0.75), ("second", 0.5)])
def test_a_short_soak_against_a_real_engine(tmp_path, model, minutes):
    """The short variant: every check of the 30-minute soak, on the demo's
    model and on a second one with another tokenizer and shape (a sample
    every 5 s; the long runs are `vllm-output-rate soak`'s, RELIABILITY.md).
    In `make test-all` (marker ``long``): `make test` keeps the soak's checks
    on made-up runs, the engine's state sizes on /metrics come with the
    stress runner's identity churn."""
    out = tmp_path / "soak"
    path = tiny_model() if model == "tiny" else second_model()
    code = soak.main(["--model", path, "--minutes", str(minutes), "--sample-s", "5",
                      "--churn-s", "0.5", "--out", str(out)])
    doc = json.loads((out / "report.json").read_text())
    print("\n" + (out / "report.md").read_text())
    failed = [c for c in doc["checks"] if not c["ok"]]
    assert code == 0 and failed == [], failed
    assert len(doc["checks"]) == 7
    assert len(doc["samples"]) >= minutes * 60 / 5
    assert doc["requests"]["churn"]["completed"] >= minutes * 60
    assert {"soak-slow", "soak-mid", "churn-*"} <= set(doc["conformance"])
    # the engine reports its own state sizes on /metrics
    assert "limiter.users" in doc["samples"][-1]["state"]
    assert doc["samples"][-1]["engine_rss_mib"] > 0


def test_the_request_checks_tell_wrong_counts_http_errors_and_transport_errors_apart():
    def reqs(*extra):
        base = [soak.Request("paced", "soak-mid", 60, 60, "length"),
                soak.Request("unlimited", "soak-free", 120, 120, "length"),
                soak.Request("churn", "churn-0", 8, 8, "length"),
                soak.Request("cancel", "soak-mid", 200, 1, None, cancelled=True),
                soak.Request("long prompt", "soak-slow", 16, 16, "length")]
        return base + list(extra)

    def checks(requests):
        report = soak.Report("m", 1, [])
        soak.analyse_requests(report, requests)
        return [c.ok for c in report.checks]

    assert checks(reqs()) == [True, True]
    # one transport error in a few requests: within the allowance (at least one)
    assert checks(reqs(soak.Request("churn", "churn-1", 8, error="ReadError: "))) == [True, True]
    assert checks(reqs(*[soak.Request("churn", f"c{i}", 8, error="ReadError: ") for i in range(2)])) == [True, False]
    assert checks(reqs(soak.Request("churn", "churn-1", 8, error="HTTP 500: boom"))) == [True, False]
    assert checks(reqs(soak.Request("paced", "soak-mid", 60, 59, "length"))) == [False, True]
    assert checks(reqs()[1:]) == [False, True]  # a kind of load that never completed


def test_the_feature_off_arm_has_no_limits_and_no_state_checks():
    assert soak.DEFAULT_OPTION not in soak.server_args(feature_off=True)
    assert soak.DEFAULT_OPTION in soak.server_args()
    report = soak.Report("m", 10, [], samples=_samples([900.0] * 6, final_requests=2.0))
    soak.analyse_samples(report, 10, state=False)
    assert [c.ok for c in report.checks] == [True]  # RSS only: no state of ours to check


def test_a_sample_is_a_progress_line_on_stderr_unless_no_progress(capsys):
    """What the soak prints per sample (the samples themselves need a live
    engine: the short soak above): how far it is, RSS, the queues, the
    requests sent and failed; nothing with progress off."""
    s = soak.Sample(90.0, 812.4, 301.0, {"limiter.users": 42.0}, running=5, waiting=1)
    requests = [soak.Request("paced", "soak-mid", 60), soak.Request("churn", "churn-0", 8, error="ReadError: ")]
    line = soak.sample_line(s, 30, requests)
    assert line == ("soak: 1.5/30 min, engine core RSS 812 MiB, API server 301 MiB, running 5, "
                    "waiting 1, 2 requests sent, 1 failed, limiter users 42")
    soak.progress_line(True, line)
    soak.progress_line(False, "not shown")
    out, err = capsys.readouterr()
    assert out == "" and err == line + "\n"
    with pytest.raises(SystemExit):  # --no-progress is an option of the command: the error is another
        soak.main(["--no-progress", "--minutes", "0"])
    assert "--minutes, --sample-s and --churn-s must be positive" in capsys.readouterr().err
