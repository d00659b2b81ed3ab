"""The twin's accuracy tool (``twin accuracy``) and the request path of
its step-time model, without an engine: the engine-side figures computed
from an event log are the twin's own figures on a twin run, the comparison
rows and goals, the workloads, the request path fitted from a log and put
into a run. The real-engine comparison itself is ``vllm-output-rate twin
accuracy`` (docs/twin.md, "Accuracy")."""

from __future__ import annotations

import json

import pytest

from harness import tiny_model
from vllm_output_rate.telemetry.events import EngineLog
from vllm_output_rate.tools.twin import accuracy as ta, accuracy_runs as runs
from vllm_output_rate.tools.twin.step_time import parse_step_time
from vllm_output_rate.tools.twin import Twin, TwinConfig
from vllm_output_rate.tools.twin.run import T0_NS
from vllm_output_rate.tools.twin.calibrate import request_path_fit
from vllm_output_rate.tools.twin.workload import LimitsChangeAt, WorkloadRequest, read_workload

NS = 1_000_000_000


def _twin(tmp_path, wl, extra=(), step=None):
    path, limits = runs.write_workload(wl, tmp_path)
    argv = ["--workload", str(path), "--out", str(tmp_path / "twin"), "--model", tiny_model(),
            "--no-plots", *runs.SERVE_ARGS, "--output-rate-limits-file", str(limits), *extra]
    if step is not None:
        (tmp_path / "step.json").write_text(json.dumps(step))
        argv += ["--step-time", str(tmp_path / "step.json")]
    return path, Twin(TwinConfig.from_argv(argv)).run()


def _arrivals(path):
    """The twin's request ids and arrivals (ns on its clock), in its order."""
    out, i = {}, 0
    for line in path.read_text().splitlines():
        obj = json.loads(line)
        if "user" in obj:
            out[f"twin-{i}-{obj['user']}"] = (obj["user"], T0_NS + round(obj["t"] * NS))
            i += 1
    return out


@pytest.mark.parametrize("name", ["tiers", "bursts"])
def test_the_event_log_figures_of_a_twin_run_are_the_twins_own(tmp_path, name):
    """What the tool computes for a real engine from its event log and the
    clients' sends is, on a twin run (async scheduling: its log stamps each
    step's tokens when the step's output is applied, as the summary does),
    exactly the twin's summary: rate, TTFT and spacing quantiles, counts."""
    wl = runs.WORKLOADS[name](3, 8.0)
    path, summary = _twin(tmp_path, wl, ["--async-scheduling", "--until", "12"])
    log = EngineLog.read(tmp_path / "twin" / "events.jsonl")
    end = T0_NS + round(summary["run"]["virtual_s"] * NS)
    figures = runs.figures_from_log(log, _arrivals(path), end)
    assert figures.keys() == summary["users"].keys() and len(figures) >= 4
    keys = ("requests", "finished", "unstarted", "output_tokens", "rate_tok_s", "ttft_s", "itl_s")
    for user, fig in figures.items():
        assert fig == {k: summary["users"][user][k] for k in keys}, user
    assert any(f["ttft_s"]["p90"] for f in figures.values())
    # tokens after the cut are not counted, nor requests outside the arrivals
    early = runs.figures_from_log(log, _arrivals(path), T0_NS + 4 * NS)
    assert sum(f["output_tokens"] for f in early.values()) < sum(
        f["output_tokens"] for f in figures.values())
    some = dict(list(_arrivals(path).items())[:5])
    assert sum(f["requests"] for f in runs.figures_from_log(log, some).values()) == 5


def test_a_live_change_in_an_accuracy_workload_reaches_the_twin(tmp_path):
    wl = runs.tiers(1, 10.0)
    path, summary = _twin(tmp_path, wl, ["--until", "14"])
    events = read_workload(str(path)).events
    assert sum(isinstance(e, LimitsChangeAt) for e in events) == 1
    assert sum(isinstance(e, WorkloadRequest) for e in events) == len(wl.lines)
    (change,) = summary["run"]["limits_changes"]
    assert change["t"] == 5.0 and change["result"] == "loaded"
    assert 5.0 <= change["in_force_t"] < 5.1
    # a free user's rate falls from 10 to 5 tok/s: over the run, in between
    free = summary["users"]["free-0"]
    assert 5 < free["rate_tok_s"] < 10


def test_the_workloads_are_seeded_and_fit_the_engine():
    for make in runs.WORKLOADS.values():
        a, b = make(7, 30.0), make(7, 30.0)
        assert a.lines == b.lines and a.lines != make(8, 30.0).lines
        assert all(x["prompt_tokens"] + x["max_tokens"] <= 1024 for x in a.lines)
        assert a.lines == sorted(a.lines, key=lambda x: x["t"])
        assert "open" in {x["user"] for x in a.lines} and a.unlimited_users() == {"open"}
        assert all(0 <= x["t"] < 30.0 for x in a.lines)


def test_compare_rows_median_spread_error_and_goals():
    real = [{"u": {"rate_tok_s": 10.0, "ttft_s": {"p50": 0.100, "p90": 0.200},
                   "itl_s": {"p50": 0.004, "p90": 0.006}}},
            {"u": {"rate_tok_s": 10.4, "ttft_s": {"p50": 0.120, "p90": 0.260},
                   "itl_s": {"p50": 0.005, "p90": 0.007}}},
            {"u": {"rate_tok_s": 9.8, "ttft_s": {"p50": 0.110, "p90": 0.240},
                   "itl_s": {"p50": 0.006, "p90": 0.008}}}]
    twin = {"u": {"rate_tok_s": 10.3, "ttft_s": {"p50": 0.125, "p90": 0.270},
                  "itl_s": {"p50": 0.0149, "p90": 0.0185}}}
    rows = {r["figure"]: r for r in ta.compare(real, twin, unlimited=set())}
    rate = rows["rate"]
    assert rate["median"] == 10.0 and rate["error"] == pytest.approx(0.03)
    assert rate["goal"] == 0.02 and rate["met"] is False  # a limited user: 2%
    assert ta.compare(real, twin, unlimited={"u"})[0]["met"] is True  # unlimited: 10%
    # the real runs' own spread: each against the median of the other two
    assert rate["real_spread"] == pytest.approx(max(abs(10 - 10.1) / 10.1, abs(10.4 - 9.9) / 9.9,
                                                    abs(9.8 - 10.2) / 10.2))
    p50 = rows["TTFT p50"]
    assert p50["median"] == 0.110 and p50["error"] == pytest.approx(0.15 / 1.1)
    assert p50["met"] is False  # 13.6% > 10% and 15 ms > 10 ms
    assert rows["TTFT p90"]["met"] is True  # 12.5% <= 15%
    sp = rows["spacing p50"]
    assert sp["error"] == pytest.approx(1.98) and sp["met"] is True  # 9.9 ms: a small figure
    assert rows["spacing p90"]["met"] is False  # 11.5 ms off
    # a user the twin never served: no error, not counted
    unserved = ta.compare(real, {}, unlimited=set())
    assert {r["met"] for r in unserved} == {None} and {r["within_spread"] for r in unserved} == {None}
    result = {"step_time": {}, "workloads": {"w": {
        "replays": 3, "errors": 0, "rows": ta.compare(real, twin, set()), "unlimited": []}}}
    text = ta.render(result)
    assert "Goals met: 2 of 5" in text
    # missed, but no further from the real median than a real run is from
    # the others' (rate 3% against 5%, TTFT p50 13.6% against 14.3%);
    # spacing p90 (164% against 23%) is not
    assert rate["within_spread"] is True and p50["within_spread"] is True
    assert rows["spacing p90"]["within_spread"] is False
    assert "within the goal or the real runs' own spread (" in text and ": 4 of 5." in text
    assert text.count("**no** (within the real spread)") == 2
    over = {o["figure"]: o for o in ta.overview(result)}
    assert over["rate, limited"]["met_or_within_spread"] == 1
    assert over["rate, limited"]["met"] == 0 and over["rate, limited"]["n"] == 1
    assert "rate, unlimited" not in over
    assert over["TTFT p90"]["error_max"] == pytest.approx(0.125)
    assert over["spacing p50"]["spread_max"] == pytest.approx(1 / 3)  # 6 ms vs 4.5 ms


def _log(lines):
    return EngineLog.from_lines([json.dumps(x) for x in lines])


def test_the_request_path_is_fitted_on_requests_sent_to_an_idle_engine():
    """A request sent to an idle engine: its first token comes one step
    (by the model) after it reached the scheduler; requests sent while a
    step ran tell nothing and are left out."""
    terms = {"base_s": 0.002, "per_decode_s": 0.001, "per_prefill_token_s": 0.0001}
    lines, sent, prompts = [], {}, {}
    t = 10 * NS
    for i in range(12):
        rid = f"cal-{i:03d}"
        sent[rid], prompts[rid] = t, 10
        path = (3 + i % 3) * 1_000_000  # 3, 4 or 5 ms
        first = t + path + 3_000_000  # base 2 ms + 10 prompt tokens x 0.1 ms
        lines.append({"kind": "tokens", "t_ns": first, "tokens": [[f"cmpl-{rid}-0", "u", 1]]})
        lines.append({"kind": "tokens", "t_ns": first + 3_000_000,
                      "tokens": [[f"cmpl-{rid}-0", "u", 1]]})
        t += NS
    busy = "cal-busy"  # sent while a step ran: left out
    sent[busy], prompts[busy] = t + 1_000_000, 10
    lines.append({"kind": "tokens", "t_ns": t + 2_000_000, "tokens": [["cmpl-cal-000-0", "u", 1]]})
    lines.append({"kind": "tokens", "t_ns": t + 50_000_000,
                  "tokens": [["cmpl-cal-000-0", "u", 1], [f"cmpl-{busy}-0", "u", 1]]})
    fit = request_path_fit(_log(lines), sent, prompts, terms)
    assert fit["requests"] == 12
    assert fit["p50_s"] == pytest.approx(0.004) and fit["p10_s"] == pytest.approx(0.003)
    assert fit["p90_s"] == pytest.approx(0.005)
    assert request_path_fit(_log(lines[:10]), sent, prompts, terms) is None  # fewer than 8
    assert request_path_fit(_log(lines), {}, prompts, terms) is None


def test_the_twin_puts_a_request_on_the_scheduler_its_request_path_after_arrival(tmp_path):
    """With ``request_path_s`` the twin sees a request that much later and
    counts its TTFT from its arrival: alone on an idle engine, TTFT = path
    + one step, exactly."""
    step = {"version": 1, "kind": "linear", "base_s": 0.01, "source": "hand"}
    wl = runs.AccuracyWorkload("alone", [runs._req(1.0, "open", 16, 4), runs._req(3.0, "open", 16, 4)],
                             "default: 100000\n")
    _, base = _twin(tmp_path / "a", wl, step=step)
    _, late = _twin(tmp_path / "b", wl, step={**step, "request_path_s": 0.007})
    assert base["users"]["open"]["ttft_s"]["p50"] == pytest.approx(0.010)
    assert late["users"]["open"]["ttft_s"]["p50"] == pytest.approx(0.017)
    assert late["run"]["step_time"]["request_path_s"] == 0.007
    assert parse_step_time({**step, "request_path_s": 0.002}).request_path_s == 0.002
    with pytest.raises(ValueError, match="request_path_s"):
        parse_step_time({**step, "request_path_s": -1})


def test_the_request_path_is_the_queued_line_when_the_log_has_it():
    """With ``queued`` lines the path is measured, not inferred: queued
    minus sent (the step-time model's estimate of the first token's step
    would say 1 ms more here); the quantiles p0, p1, ..., p100 go into the model."""
    terms = {"base_s": 0.002, "per_decode_s": 0.0, "per_prefill_token_s": 0.0}
    lines, sent = [], {}
    t = 10 * NS
    for i in range(10):
        rid = f"cal-{i:03d}"
        sent[rid] = t
        path = (2 + i) * 1_000_000  # 2 .. 11 ms
        lines.append({"kind": "queued", "t_ns": t + path, "request_id": f"cmpl-{rid}-0",
                      "user": "u"})
        lines.append({"kind": "tokens", "t_ns": t + path + 3_000_000,
                      "tokens": [[f"cmpl-{rid}-0", "u", 1]]})
        t += NS
    fit = request_path_fit(_log(lines), sent, {}, terms)
    assert fit["requests"] == 10 and fit["from_queued_lines"] == 10
    assert fit["p50_s"] == pytest.approx(0.0065)
    qs = fit["quantiles_s"]
    assert len(qs) == 101 and qs[0] == pytest.approx(0.002) and qs[-1] == pytest.approx(0.011)
    assert qs == sorted(qs)
    # without the queued lines: the first token less the model's step (2 ms)
    old = request_path_fit(_log([x for x in lines if x["kind"] == "tokens"]), sent, {}, terms)
    assert old["from_queued_lines"] == 0 and old["p50_s"] == pytest.approx(0.0075)


def test_each_requests_path_is_drawn_from_the_spread_seeded(tmp_path):
    """``request_path_quantiles_s``: each request reaches the scheduler a
    path drawn from the spread after its arrival (alone on an idle engine:
    TTFT = its path + one step), the same draws for the same seed, others
    for another; a spread that decreases is refused with its index."""
    step = {"version": 1, "kind": "linear", "base_s": 0.01, "source": "hand",
            "request_path_s": 0.004, "request_path_quantiles_s": [0.002, 0.004, 0.012]}
    wl = runs.AccuracyWorkload("alone", [runs._req(1.0 + i, "open", 16, 4) for i in range(20)],
                             "default: 100000\n")

    def ttfts(name, seed):
        path, summary = _twin(tmp_path / name, wl, step=step, extra=("--seed", str(seed)))
        log = EngineLog.read(tmp_path / name / "twin" / "events.jsonl")
        firsts = {}
        for t, tokens in log.steps:
            for rid, _, _ in tokens:
                firsts.setdefault(rid, t)
        arrivals = _arrivals(path)
        return [(firsts[rid] - at) / NS for rid, (_, at) in arrivals.items()], summary

    a, summary = ttfts("a", 1)
    b, _ = ttfts("b", 1)
    c, _ = ttfts("c", 2)
    assert a == b and a != c
    assert all(0.012 - 1e-9 <= x <= 0.022 + 1e-9 for x in a + c)  # 2-12 ms path + 10 ms step
    assert len({round(x, 6) for x in a}) > 10  # drawn, not one value
    assert summary["run"]["step_time"]["request_path_quantiles_s"] == [0.002, 0.004, 0.012]
    model = parse_step_time(step)
    assert model.request_path_quantiles_s == (0.002, 0.004, 0.012)
    with pytest.raises(ValueError, match=r"request_path_quantiles_s\[1\].*must not decrease"):
        parse_step_time({**step, "request_path_quantiles_s": [0.002, 0.001]})
    with pytest.raises(ValueError, match="request_path_quantiles_s: expected a list"):
        parse_step_time({**step, "request_path_quantiles_s": [0.002]})


def test_the_twin_replays_what_each_real_run_sent():
    """``as_sent``: the workload with each request at the moment a replay's
    client sent it (by the client's id of it), limit changes kept; a
    request the replay did not send keeps its planned time."""
    wl = runs.tiers(1, 30.0)
    events = runs.replay_events(wl)
    requests = [(i, e) for i, (_, e) in enumerate(events) if not isinstance(e, str)]
    sent = {runs.client_id(i, e["user"]): e["t"] + 0.2 for i, e in requests[:-1]}
    moved = runs.as_sent(wl, sent)
    assert moved.changes == wl.changes and moved.limits == wl.limits
    assert len(moved.lines) == len(wl.lines)
    assert sorted(x["t"] for x in moved.lines) == sorted(
        [round(e["t"] + 0.2, 6) for _, e in requests[:-1]] + [requests[-1][1]["t"]])
    assert [x["t"] for x in moved.lines] == sorted(x["t"] for x in moved.lines)


def test_the_twins_runs_median_is_compared():
    """Several twin runs: their median against the real median, each run's
    value kept in the row."""
    real = [{"u": {"rate_tok_s": 10.0}}, {"u": {"rate_tok_s": 10.2}}, {"u": {"rate_tok_s": 9.9}}]
    twins = [{"u": {"rate_tok_s": 10.5}}, {"u": {"rate_tok_s": 10.1}}, {"u": {"rate_tok_s": 9.0}}]
    row = ta.compare(real, twins, set())[0]
    assert row["twin"] == 10.1 and row["twin_runs"] == [10.5, 10.1, 9.0]
    assert row["error"] == pytest.approx(0.01) and row["met"] is True


def test_the_kv_size_is_read_from_the_engine_log():
    assert runs.kv_tokens_of("INFO ... [kv_cache_utils.py:1234] GPU KV cache size: 131,072 tokens") \
        == 131072
    assert runs.kv_tokens_of("nothing") is None


from hypothesis import given, strategies as st  # noqa: E402


@given(st.lists(st.integers(0, 50), min_size=1, max_size=60), st.floats(0, 1))
def test_counted_samples_give_the_quantile_of_the_samples(values, q):
    """The twin's spacings kept as value -> count: the same quantile as
    the list of samples, in the same order, with memory per distinct value."""
    from vllm_output_rate.tools.common.stats import CountedSamples, quantile

    counted = CountedSamples()
    for v in values[::2]:
        counted.append(v * 1000)
    for v in values[1::2]:
        counted.add(v * 1000, 1)
    counted.add(7, 0)
    samples = [v * 1000 for v in values]
    assert len(counted) == len(samples) and list(counted) == sorted(samples)
    assert counted.quantile(q) == pytest.approx(quantile(samples, q), abs=1e-6)
    assert len(counted.counts) == len(set(values))


def test_real_from_scores_the_twin_against_earlier_real_runs(tmp_path):
    """``--real-from DIR``: no engine starts; the earlier run's real runs
    are taken as they were (their figures, their send times), the step time
    is fitted again on its calibration log, and the twin runs once per real
    run. Here the "real" runs are a twin run's own figures: the twin on the
    same send times reproduces them exactly."""
    import shutil

    from harness import REPO

    earlier = tmp_path / "earlier"
    cal = earlier / "calibration"
    cal.mkdir(parents=True)
    data = REPO / "tests" / "data"
    shutil.copy(data / "calibration-events.jsonl", cal / "events.jsonl")
    shutil.copy(data / "calibration-prompts.jsonl", cal / "step_time.prompts.jsonl")
    wl = runs.tiers(1, 6.0)
    step = {"version": 1, "kind": "linear", "base_s": 0.002, "source": "hand"}
    (tmp_path / "step.json").write_text(json.dumps(step))
    planned = {runs.client_id(i, e["user"]): e["t"] for i, (_, e) in enumerate(runs.replay_events(wl))
               if not isinstance(e, str)}
    summary = runs.twin_run(wl, tmp_path / "made", tiny_model(), tmp_path / "step.json",
                          False, None, 1)
    real = {"figures": summary["users"], "sent_s": planned, "errors": [],
            "async_scheduling": False, "kv_tokens": None}
    (earlier / "accuracy.json").write_text(json.dumps(
        {"workloads": {"tiers": {"real": [real, real]}}}))
    out = tmp_path / "out"
    assert ta.main(["--out", str(out), "--real-from", str(earlier), "--workload", "tiers",
                    "--duration", "6", "--model", tiny_model(), "--step-time",
                    str(tmp_path / "step.json")]) == 0
    doc = json.loads((out / "accuracy.json").read_text())
    assert doc["real_from"] == str(earlier)
    wl_doc = doc["workloads"]["tiers"]
    assert wl_doc["replays"] == 2 and len(wl_doc["twin"]) == 2
    assert all(r["met"] for r in wl_doc["rows"] if r["met"] is not None)
    assert all(r["error"] == 0 for r in wl_doc["rows"] if r["error"] is not None)
    assert not (out / "tiers" / "real-1").exists()  # no engine ran
    # without --step-time: fitted again on the earlier calibration log
    assert ta.main(["--out", str(tmp_path / "out2"), "--real-from", str(earlier), "--workload",
                    "tiers", "--duration", "6", "--model", tiny_model()]) == 0
    refit = json.loads((tmp_path / "out2" / "calibration" / "step_time.json").read_text())
    assert refit["source"] == "measured" and "fitted again on earlier" in refit["note"]
