"""The what-if twin (``vllm-output-rate twin``): vLLM's real schedulers, the
limiter and the engine telemetry on generated workloads in virtual time.
Everything is read in virtual time: nothing here depends on the wall clock."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from prometheus_client.parser import text_string_to_metric_families
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from harness import REPO, spend_rate, tiny_model
from test_live_limits import check_piecewise_bound
from vllm_output_rate.limiter import BURST_NS
from vllm_output_rate.scheduler import OutputRateAsyncScheduler, OutputRateScheduler
from vllm_output_rate.telemetry.events import EngineLog
from vllm_output_rate.telemetry.metrics import series_name
from vllm_output_rate.tools.twin import cli as twin
from vllm_output_rate.tools.twin import workload
from vllm_output_rate.tools.twin.step_time import StepTimeError, load_step_time
from vllm_output_rate.tools.twin import Twin, TwinConfig, TwinError
from vllm_output_rate.tools.twin.run import T0_NS
from vllm_output_rate.tools.verify.gcra import gcra_max_excess
from vllm_output_rate.tools.twin.workload import WorkloadError, read_workload

NS = 1_000_000_000
LIMITS = {"flooder": 15, "steady-0": 40, "steady-1": 40}
FLOOD = ["flood", "--duration", "4", "--streams", "6", "--users", "2", "--rate", "1",
         "--prompt-tokens", "40", "--max-tokens", "48", "--flood-max-tokens", "60"]


def gen(tmp_path, args, seed=1, name="wl.jsonl"):
    path = tmp_path / name
    assert workload.main([*args, "--out", str(path), "--seed", str(seed)]) == 0
    return path


def run_twin(tmp_path, wl, *options, out="out", keep_charges=True):
    t = Twin(TwinConfig.from_argv(
        ["--workload", str(wl), "--out", str(tmp_path / out), "--model", tiny_model(),
         "--max-num-seqs", "16", "--max-model-len", "512", *options],
        keep_charges=keep_charges))
    return t, t.run()


def user_charges(t, user):
    return [(ns, n) for ns, u, n in t.stats.charges if u == user]


MODES = [pytest.param(a, lim, id=f"{'async' if a else 'sync'}-{'limits' if lim else 'none'}")
         for a in (False, True) for lim in (True, False)]


@pytest.mark.parametrize("is_async,limited", MODES)
def test_each_mode_runs_the_scheduler_serve_would(tmp_path, is_async, limited):
    wl = gen(tmp_path, FLOOD)
    options = ["--async-scheduling"] if is_async else []
    if limited:
        options += ["--default-user-output-tokens-per-second", "1000",
                    "--user-output-tokens-per-second", json.dumps(LIMITS)]
    t, summary = run_twin(tmp_path, wl, *options)
    expected = {(True, True): OutputRateAsyncScheduler, (False, True): OutputRateScheduler,
                (True, False): AsyncScheduler, (False, False): Scheduler}[(is_async, limited)]
    # the class itself, or (limited) that class as a host that says no to
    # the limits file's watch thread, and nothing more
    cls = type(t.scheduler)
    assert cls is expected or (limited and cls.__bases__ == (expected,)
                               and {name for name in vars(cls) if not name.startswith("__")}
                               <= {"_orl_watch_thread", "_abc_impl"})
    run = summary["run"]
    assert run["upstream_scheduler"] is (not limited) and run["async_scheduling"] is is_async
    assert run["step_time"]["is_estimate"] and run["step_time"]["source"] == "estimate"
    assert run["scheduler"].endswith(expected.__name__)
    # every request finished with exactly max_tokens (ignore_eos)
    wanted: dict[str, int] = {}
    for r in read_workload(str(wl)).requests:
        wanted[r.user] = wanted.get(r.user, 0) + r.max_tokens
    assert {u: s["output_tokens"] for u, s in summary["users"].items()} == wanted
    assert all(s["finished"] == s["requests"] and s["unstarted"] == 0
               for s in summary["users"].values())
    assert run["until_s"] is None
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert written == summary and written["schema"] == 1
    assert "What-if twin run" in (tmp_path / "out" / "report.md").read_text()
    if not limited:
        assert not (tmp_path / "out" / "events.jsonl").exists()
        # unthrottled: the flooder's 6 streams get a token every step
        assert summary["users"]["flooder"]["rate_tok_s"] > 5 * LIMITS["flooder"]
        return
    lag = 2 if is_async else 1
    log = EngineLog.read(tmp_path / "out" / "events.jsonl")
    assert not log.bad_lines and log.starts[0]["async_scheduling"] is is_async
    metrics = (tmp_path / "out" / "metrics.txt").read_text()
    for user, limit in LIMITS.items():
        rate = Fraction(limit)
        # the limiter's bound, exactly: in every window of charges, tokens
        # <= (W + burst) x limit + 1
        charges = user_charges(t, user)
        assert sum(n for _, n in charges) == wanted[user]
        assert gcra_max_excess(charges, rate)[0] <= 0, user
        # the telemetry's event log (tokens when their step's output came)
        # holds it too, with verify's step slack
        spends = log.user_spends(user)
        starts = log.dispatch_lower_bounds([s for s, _ in spends], lag)
        assert gcra_max_excess(spends, rate, starts)[0] <= 0, user
        # the summary's rate is the event log's, first to last token
        assert summary["users"][user]["rate_tok_s"] == pytest.approx(spend_rate(spends), abs=1e-3)
        assert (f'vllm_output_rate_tokens_charged_total{{engine="0",model_name="{tiny_model()}",'
                f'user="{user}"}} {float(wanted[user])}') in metrics
    flooder = summary["users"]["flooder"]
    # six streams against 15 tok/s: at the limit, each stream's tokens 6/15 s apart
    assert flooder["rate_tok_s"] == pytest.approx(LIMITS["flooder"], rel=0.02)
    assert flooder["itl_s"]["p50"] == pytest.approx(6 / LIMITS["flooder"], rel=0.05)
    assert flooder["throttled_s"] > 0.9 * run["virtual_s"] - 1
    assert flooder["kv_blocks_throttled"]["max"] >= 5  # 5 of 6 resident streams wait


def write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_limits_change_in_the_workload_is_in_force_at_its_virtual_time(tmp_path, is_async):
    limits = write(tmp_path / "limits.yaml", "default: 1000\nusers: {user-a: 20}\n")
    write(tmp_path / "after.yaml", "default: 1000\nusers: {user-a: 5}\n")
    lines = [{"t": 0.0, "user": "user-a", "prompt_tokens": 16, "max_tokens": 200}] * 4
    lines += [{"t": 0.0, "user": "user-b", "prompt_tokens": 16, "max_tokens": 100},
              {"t": 3.0, "limits_file": "after.yaml"}]
    wl = write(tmp_path / "wl.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    options = ["--output-rate-limits-file", str(limits)] + (["--async-scheduling"] if is_async else [])
    t, summary = run_twin(tmp_path, wl, *options)
    [change] = summary["run"]["limits_changes"]
    assert change["result"] == "loaded"
    assert 3.0 <= change["in_force_t"] <= 3.0 + 0.05  # the first step at or after it
    in_force_ns = T0_NS + round(change["in_force_t"] * NS)
    log = EngineLog.read(tmp_path / "out" / "events.jsonl")
    [logged] = log.limit_changes
    assert logged["t_ns"] == in_force_ns and logged["limits"] == {"user-a": 5.0}
    # the telemetry's wall clock moves with the virtual one (the twin passes
    # its clock in), and so does the limits file's load time
    [start] = log.starts
    offset_ns = start["unix_ns"] - start["t_ns"]
    assert logged["unix_ns"] - logged["t_ns"] == offset_ns
    text = (tmp_path / "out" / "metrics.txt").read_text()
    [loaded] = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == series_name("limits_loaded_timestamp_seconds")]
    assert loaded == pytest.approx((T0_NS + offset_ns) / NS + change["in_force_t"], abs=0.05)
    # the user's file was copied, never written
    assert limits.read_text() == "default: 1000\nusers: {user-a: 20}\n"
    charges = [(ns, "user-a", n) for ns, n in user_charges(t, "user-a")]
    check_piecewise_bound(charges, "user-a", [(T0_NS, Fraction(20)), (in_force_ns, Fraction(5))])
    before = sum(n for ns, _, n in charges if ns < in_force_ns)
    after = [(ns, n) for ns, _, n in charges if ns >= in_force_ns + 2 * NS]
    assert 20 * 3 - 1 <= before <= 20 * (3 + BURST_NS / NS) + 1
    assert spend_rate(after) == pytest.approx(5, rel=0.02)
    assert summary["users"]["user-a"]["output_tokens"] == 800


BAD_LINES = [
    ('{"t": 0, "user": "a", "prompt_tokens": 8, "max_tokens": -3}',
     "max_tokens: expected a positive integer, got -3"),
    ('{"t": 0, "user": "a", "prompt_tokens": 8.5, "max_tokens": 3}',
     "prompt_tokens: expected a positive integer, got 8.5"),
    ('{"t": -1, "user": "a", "prompt_tokens": 8, "max_tokens": 3}',
     "t: expected a number of seconds >= 0, got -1"),
    ('{"user": "a", "prompt_tokens": 8, "max_tokens": 3}', "t: missing"),
    ('{"t": 0, "user": "", "prompt_tokens": 8, "max_tokens": 3}',
     "user: expected a non-empty string, got ''"),
    ('{"t": 0, "prompt_tokens": 8, "max_tokens": 3}', "user: missing"),
    ('{"t": 0, "user": "a", "prompt_tokens": 8, "max_tokens": 3, "prio": 1}',
     "prio: unknown field in a request line"),
    ('{"t": 1, "limits_file": "missing.yaml"}', "limits_file: cannot read 'missing.yaml'"),
    ('{"t": 1, "limits_file": "x.yaml", "user": "a"}', "user: unknown field in a limits line"),
    ('[1, 2]', "expected a JSON object, got list"),
    ('{"t": 0, "user": "a",', "not JSON"),
]


@pytest.mark.parametrize("line,message", BAD_LINES, ids=[m.split(":")[0] for _, m in BAD_LINES])
def test_bad_workload_lines_are_refused_with_line_and_field(tmp_path, line, message):
    good = '{"t": 0, "user": "a", "prompt_tokens": 8, "max_tokens": 3}'
    path = write(tmp_path / "workload.jsonl", f"{good}\n# a comment\n\n{good}\n{line}\n{good}\n")
    with pytest.raises(WorkloadError) as info:
        read_workload(str(path))
    assert str(info.value).startswith(f"{path}:5: {message}"), str(info.value)


def test_the_command_refuses_bad_input_in_one_line(tmp_path, capsys):
    good = '{"t": 0, "user": "a", "prompt_tokens": 8, "max_tokens": 3}'
    wl = write(tmp_path / "workload.jsonl", f"{good}\n" + good.replace("3}", "-3}") + "\n")
    out = ["--out", str(tmp_path / "out"), "--model", tiny_model()]
    assert twin.main(["run", "--workload", str(wl), *out]) == 2
    assert capsys.readouterr().err.strip() == (
        f"vllm-output-rate twin run: error: {wl}:2: max_tokens: expected a positive "
        f"integer, got -3")
    long = write(tmp_path / "long.jsonl", good.replace("3}", "600}") + "\n")
    with pytest.raises(TwinError, match=r"long.jsonl:1: prompt_tokens \+ max_tokens = 608 "
                                        r"exceeds the model length 512"):
        Twin(TwinConfig.from_argv(["--workload", str(long), *out, "--max-model-len", "512"]))
    change = write(tmp_path / "change.jsonl", f'{good}\n{{"t": 1, "limits_file": "change.jsonl"}}\n')
    with pytest.raises(TwinError, match="change.jsonl:2: limits_file: the run has no limits file"):
        Twin(TwinConfig.from_argv(["--workload", str(change), *out,
                                   "--default-user-output-tokens-per-second", "5"]))
    step = write(tmp_path / "step.json", '{"version": 1, "kind": "linear", "base_s": -1}')
    with pytest.raises(StepTimeError, match="step.json: base_s: expected a number >= 0, got -1"):
        load_step_time(str(step))


def test_same_seed_same_summary(tmp_path):
    summaries = []
    for i in range(2):
        wl = gen(tmp_path, ["tiers", "--tiers", "free:3,gold:1", "--duration", "3", "--rate", "2",
                            "--prompt-tokens", "24", "--max-tokens", "24"], seed=7, name=f"{i}.jsonl")
        _, s = run_twin(tmp_path, wl, "--default-user-output-tokens-per-second", "30",
                        "--user-output-tokens-per-second", '{"gold-0": 200}', "--seed", "3",
                        out=f"out{i}", keep_charges=False)
        s["run"].pop("wall_s")
        s["run"].pop("workload")
        summaries.append(s)
    assert summaries[0] == summaries[1]
    assert (tmp_path / "0.jsonl").read_text() == (tmp_path / "1.jsonl").read_text()


@pytest.mark.parametrize("kind", list(workload.GENERATORS))
def test_generators_are_deterministic_and_valid(tmp_path, kind):
    args = [kind, "--duration", "5", "--clients", "20", "--streams", "4"]
    a, b, c = (gen(tmp_path, args, seed=s, name=f"{n}.jsonl") for n, s in (("a", 5), ("b", 5), ("c", 6)))
    assert a.read_text() == b.read_text() != c.read_text()
    requests = read_workload(str(a)).requests
    assert requests and [r.t for r in requests] == sorted(r.t for r in requests)


def test_a_hand_written_step_time_sets_the_spacing(tmp_path):
    step = write(tmp_path / "step.json", json.dumps({
        "version": 1, "kind": "linear", "base_s": 0.01, "per_decode_s": 0.002,
        "per_prefill_token_s": 0.0, "per_context_token_s": 0.0, "source": "hand"}))
    wl = write(tmp_path / "wl.jsonl", '{"t": 0, "user": "solo", "prompt_tokens": 8, '
                                      '"max_tokens": 50}\n')
    _, summary = run_twin(tmp_path, wl, "--step-time", str(step))
    solo = summary["users"]["solo"]
    assert summary["run"]["step_time"]["is_estimate"] is False
    assert solo["itl_s"] == {"p50": 0.012, "p90": 0.012, "p99": 0.012}
    # one step, prefill and first token: base_s (the prompt's tokens cost 0 here)
    assert solo["ttft_s"]["p50"] == pytest.approx(0.01)
    assert solo["rate_tok_s"] == pytest.approx(1 / 0.012, rel=1e-6)


def test_the_docs_page_holds_the_schemas():
    from vllm_output_rate.tools.twin.step_time import DEFAULT, STEP_TIME_SCHEMA
    from vllm_output_rate.tools.twin.report import SUMMARY_SCHEMA

    doc = (REPO / "docs" / "twin.md").read_text()
    for schema in (workload.WORKLOAD_SCHEMA, STEP_TIME_SCHEMA, DEFAULT.to_json(), SUMMARY_SCHEMA):
        assert f"```json\n{json.dumps(schema, indent=2)}\n```" in doc


def test_until_cuts_the_run_and_counts_what_never_started(tmp_path):
    """A flooder held at 15 tok/s with 60 streams of 60 tokens needs about
    four minutes to drain; cut at 3 virtual seconds, the run stops there,
    the tokens so far count, the flooder's requests without a first token
    (at 15 tok/s, most of the 60) are counted ``unstarted`` (not in its
    TTFT samples). (A run without ``--until`` goes on until every request
    finished: ``until_s`` null, every other test here.)"""
    wl = gen(tmp_path, [*FLOOD[:3], "--streams", "60", *FLOOD[5:]])
    options = ["--default-user-output-tokens-per-second", "1000",
               "--user-output-tokens-per-second", json.dumps(LIMITS),
               "--max-num-active-seqs", "2"]
    t, cut = run_twin(tmp_path, wl, *options, "--until", "3", out="cut")
    assert cut["run"]["until_s"] == 3 and 3 <= cut["run"]["virtual_s"] <= 3.1
    flooder = cut["users"]["flooder"]
    assert flooder["requests"] == 60 and flooder["finished"] == 0
    assert 0 < flooder["output_tokens"] <= (3 + 0.1) * 15 + 1
    started = flooder["requests"] - flooder["unstarted"]
    assert flooder["unstarted"] > 0 and len(t.stats.users["flooder"].ttft_ns) == started
    waits = t.stats.unstarted_waits()["flooder"]
    end_ns = cut["run"]["virtual_s"] * NS  # (the run's last step, at 3 s or just past it)
    assert len(waits) == flooder["unstarted"] and all(0 < w <= end_ns for w in waits)


def test_a_config_built_in_memory_runs_as_its_command_line(tmp_path):
    """``Twin(TwinConfig(...))`` with the workload, the engine options and
    the limits' text in memory runs exactly what the same options on the
    command line run: the same summary (wall time aside) and event log."""
    from vllm_output_rate.tools.twin import TwinLimits, engine_args
    from vllm_output_rate.tools.twin.workload import workload_of_lines

    lines = [{"t": round(0.05 * i, 6), "user": f"user-{i % 3}", "prompt_tokens": 24,
              "max_tokens": 40} for i in range(30)]
    limits = "default: 30\nusers: {user-1: 8}\n"
    (tmp_path / "cli").mkdir()
    wl = write(tmp_path / "cli" / "workload.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    write(tmp_path / "cli" / "limits.yaml", limits)
    by_argv = Twin(TwinConfig.from_argv(
        ["--workload", str(wl), "--out", str(tmp_path / "a"), "--model", tiny_model(),
         "--max-num-seqs", "8", "--max-model-len", "512", "--seed", "3", "--no-plots",
         "--output-rate-limits-file", str(tmp_path / "cli" / "limits.yaml")])).run()
    in_memory = Twin(TwinConfig(
        workload=workload_of_lines(lines), out=tmp_path / "b",
        engine=engine_args(model=tiny_model(), max_num_seqs=8, max_model_len=512, seed=3),
        limits=TwinLimits(limits_text=limits), plots=False)).run()
    for summary in (by_argv, in_memory):
        summary["run"].pop("wall_s")
    assert in_memory == by_argv and by_argv["run"]["limits"]["users"] == {"user-1": 8.0}

    def events(out):
        return [{k: v for k, v in json.loads(line).items() if k != "unix_ns"}
                for line in (tmp_path / out / "events.jsonl").read_text().splitlines()]

    assert events("a") == events("b") and len(events("a")) > 10


def test_the_python_example_of_the_docs_runs(tmp_path, monkeypatch):
    doc = (REPO / "docs" / "twin.md").read_text()
    example = doc.split("### From Python", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(example, "docs/twin.md", "exec"), scope)
    summary = scope["summary"]
    assert set(summary["users"]) == {"user-0", "user-1"}
    assert summary["users"]["user-1"]["rate_tok_s"] == pytest.approx(10, rel=0.02)
    assert (tmp_path / "twin-out" / "summary.json").exists()
