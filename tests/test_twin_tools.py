"""The what-if twin's tools beside ``twin run``: ``twin compare``, the
BurstGPT converter, ``twin scale`` (a tiny grid) and ``twin calibrate`` (the fit on a synthetic log made
by the twin from a known model, the fit on a log recorded once from a real
CPU engine, the roofline estimate). No engine is started, nothing depends
on the wall clock."""

from __future__ import annotations

import csv
import json

import pytest

from harness import REPO, tiny_model
from vllm_output_rate.tools.twin import cli as twin
from vllm_output_rate.tools.twin import calibrate as twin_calibrate, roofline, scale as twin_scale, workload
from vllm_output_rate.tools.twin.step_time import TERMS, load_step_time
from vllm_output_rate.tools.twin import Twin, TwinConfig
from vllm_output_rate.tools.twin.calibrate import CalibrationError, calibrate_from_log
from vllm_output_rate.tools.twin.compare import CompareError, parse_configs, run_compare
from vllm_output_rate.tools.twin.workload import WorkloadError, convert_burstgpt, read_workload

from test_twin import FLOOD, gen

DATA = REPO / "tests" / "data"


# --------------------------------------------------------------------------- compare


def test_compare_puts_configurations_side_by_side(tmp_path, capsys):
    wl = gen(tmp_path, FLOOD)
    (tmp_path / "strict.yaml").write_text("default: 1000\nusers: {flooder: 5}\n")
    out = tmp_path / "cmp"
    doc = run_compare([
        "--workload", str(wl), "--out", str(out), "--model", tiny_model(),
        "--max-num-seqs", "16", "--max-model-len", "512",
        "--config", 'base=--default-user-output-tokens-per-second 1000 '
                    '--user-output-tokens-per-second \'{"flooder": 15}\'',
        "--config", f"strict=--output-rate-limits-file {tmp_path / 'strict.yaml'}",
        "--config=none="], plots=True)
    assert [c["name"] for c in doc["configs"]] == ["base", "strict", "none"]
    assert doc["baseline"] == "base"
    assert doc["configs"][2]["limits"] is None and doc["configs"][2]["scheduler"].endswith(
        ".Scheduler")
    for name in ("base", "strict", "none"):  # each configuration's own run folder
        summary = json.loads((out / name / "summary.json").read_text())
        assert summary["users"].keys() == doc["users"].keys()
    assert (out / "strict" / "events.jsonl").exists() and (out / "strict" / "limits.yaml").exists()
    flooder = doc["users"]["flooder"]
    assert flooder["base"]["rate_tok_s"] == pytest.approx(15, rel=0.02)
    assert flooder["strict"]["rate_tok_s"] == pytest.approx(5, rel=0.02)
    assert flooder["none"]["rate_tok_s"] > 5 * 15
    d = flooder["strict"]["diff"]["rate_tok_s"]
    assert d["abs"] == pytest.approx(flooder["strict"]["rate_tok_s"] - flooder["base"]["rate_tok_s"],
                                     abs=1e-5)
    assert d["rel"] == pytest.approx(-2 / 3, abs=0.02)
    assert "diff" not in flooder["base"]
    assert flooder["none"]["throttled_s"] == 0 < flooder["strict"]["throttled_s"]
    assert json.loads((out / "compare.json").read_text()) == doc
    md = (out / "compare.md").read_text()
    assert "| user | config | rate tok/s | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | " \
           "spacing p50 ms | spacing p90 ms | throttled s |" in md
    assert "| flooder | base | 15." in md and "|  | strict | 5.01 (-10.0" in md
    assert "flooder's rate tok/s goes from" not in md  # titles read as words
    assert "flooder's rate goes from 15." in md and "with strict" in md
    # plots: the configurations side by side, and each run's own in its report
    for name in ("compare-rate.png", "compare-ttft.png", "base/plot-rate.png",
                 "base/plot-ttft.png", "base/plot-kv_throttled.png", "none/plot-rate.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG", name
    assert "![Per-user rate](compare-rate.png)" in md
    report = (out / "strict" / "report.md").read_text()
    assert "![KV blocks held by throttled requests](plot-kv_throttled.png)" in report
    assert not (out / "none" / "plot-kv_throttled.png").exists()  # none throttled


def test_compare_refuses_bad_configurations(tmp_path, capsys):
    with pytest.raises(CompareError, match="two or more --config"):
        parse_configs(["--config", "a=", "--workload", "w"])
    with pytest.raises(CompareError, match="--config a: given twice"):
        parse_configs(["--config", "a=", "--config", "a=--seed 1"])
    with pytest.raises(CompareError, match="expected NAME=OPTIONS"):
        parse_configs(["--config", "no-equals", "--config", "b="])
    with pytest.raises(CompareError, match="--out: give it once"):
        parse_configs(["--config", "a=--out x", "--config", "b="])
    configs, rest = parse_configs(["--workload", "w", "--config", "a=--seed 1 --x 'y z'",
                                   "--config=b=", "--out", "o"])
    assert configs == [("a", ["--seed", "1", "--x", "y z"]), ("b", [])]
    assert rest == ["--workload", "w", "--out", "o"]
    assert twin.main(["compare", "--config", "a=", "--out", str(tmp_path)]) == 2
    assert "twin compare: error: give two or more" in capsys.readouterr().err


# --------------------------------------------------------------------------- BurstGPT

ROWS = [  # Timestamp, Model, Request tokens, Response tokens, Total tokens, Log Type
    (5, "ChatGPT", 472, 18, 490, "Conversation log"),
    (45, "ChatGPT", 1087, 230, 1317, "Conversation log"),
    (45, "GPT-4", 417, 0, 417, "Conversation log"),  # a failure: no response
    (118, "GPT-4", 417, 276, 693, "API log"),
    (120, "ChatGPT", 20, 5, 25, "API log"),
]


def write_trace(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens",
                    "Log Type"])
        w.writerows(rows)
    return path


def test_burstgpt_rows_become_requests(tmp_path, capsys):
    trace = write_trace(tmp_path / "trace.csv", ROWS)
    out = tmp_path / "wl.jsonl"
    assert workload.main(["burstgpt", "--trace", str(trace), "--out", str(out),
                          "--users", "column:Model", "--time-scale", "0.5"]) == 0
    assert "4 requests of 2 users over 57.5 s" in capsys.readouterr().out
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines == [
        {"t": 0.0, "user": "ChatGPT", "prompt_tokens": 472, "max_tokens": 18},
        {"t": 20.0, "user": "ChatGPT", "prompt_tokens": 1087, "max_tokens": 230},
        {"t": 56.5, "user": "GPT-4", "prompt_tokens": 417, "max_tokens": 276},
        {"t": 57.5, "user": "ChatGPT", "prompt_tokens": 20, "max_tokens": 5}]
    assert len(read_workload(str(out)).requests) == 4  # a valid workload
    lines, counts = convert_burstgpt(str(trace), "column:Log Type", limit_rows=2, max_len=512,
                                     model="ChatGPT")
    assert [x["user"] for x in lines] == ["Conversation-log", "Conversation-log"]
    assert [(x["prompt_tokens"], x["max_tokens"]) for x in lines] == [(472, 18), (282, 230)]
    assert counts == {"rows": 2, "kept": 2, "failed": 0, "other_model": 0, "clipped": 1}


def test_burstgpt_user_rules_are_deterministic_and_stated(tmp_path):
    rows = [(i * 0.5, "ChatGPT", 10 + i % 7, 1 + i % 5, 0, "API log") for i in range(400)]
    trace = write_trace(tmp_path / "big.csv", rows)

    def users(rule, seed):
        return [x["user"] for x in convert_burstgpt(str(trace), rule, seed)[0]]

    assert users("hash:4", 1) == users("hash:4", 1) != users("hash:4", 2)
    share = {u: users("hash:4", 1).count(u) for u in set(users("hash:4", 1))}
    assert set(share) == {"user-0", "user-1", "user-2", "user-3"}
    assert all(60 <= n <= 140 for n in share.values())  # about even
    zipf = users("zipf:5:1.5", 3)
    assert zipf == users("zipf:5:1.5", 3) != users("zipf:5:1.5", 4)
    counts = [zipf.count(f"user-{k}") for k in range(5)]
    assert counts[0] > counts[1] > counts[4] and counts[0] > 0.4 * len(zipf)
    for bad in ("hash:0", "zipf:3", "zipf:3:-1", "round-robin:3", "column:Nope"):
        with pytest.raises(WorkloadError, match=f"--users {bad}:"):
            convert_burstgpt(str(trace), bad)
    broken = write_trace(tmp_path / "broken.csv", [(1, "ChatGPT", "x", 3, 0, "API log")])
    with pytest.raises(WorkloadError, match=r"broken.csv:2: Timestamp, Request tokens"):
        convert_burstgpt(str(broken), "hash:2")
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(WorkloadError, match=r"other.csv:1: Timestamp: missing column"):
        convert_burstgpt(str(tmp_path / "other.csv"), "hash:2")


# --------------------------------------------------------------------------- calibrate

KNOWN = {"base_s": 0.004, "per_decode_s": 0.0003, "per_prefill_token_s": 0.00002,
         "per_context_token_s": 2e-7}


def test_the_fit_recovers_a_known_model_from_a_twin_log(tmp_path):
    """The twin, stepping by a known model, writes the event log a real
    engine would; the fit on it (prompt lengths from the workload) gives
    that model back."""
    step = tmp_path / "known.json"
    step.write_text(json.dumps({"version": 1, "kind": "linear", **KNOWN, "source": "hand"}))
    wl = gen(tmp_path, ["clients", "--clients", "6", "--duration", "6", "--rate", "1.5",
                        "--prompt-tokens", "60", "--max-tokens", "40", "--cap", "200"], seed=4)
    Twin(TwinConfig.from_argv(
        ["--workload", str(wl), "--out", str(tmp_path / "out"), "--model", tiny_model(),
         "--max-num-seqs", "32", "--max-model-len", "512", "--max-num-batched-tokens", "8192",
         "--step-time", str(step), "--default-user-output-tokens-per-second", "100000",
         "--no-plots"])).run()
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:  # the twin's request ids: twin-<index>-<user>
        for i, r in enumerate(read_workload(str(wl)).requests):
            f.write(json.dumps({"request_id": f"twin-{i}-{r.user}",
                                "prompt_tokens": r.prompt_tokens}) + "\n")
    model = calibrate_from_log(str(tmp_path / "out" / "events.jsonl"), str(prompts))
    fit = model["fit"]
    assert fit["steps"] > 300 and fit["fitted"] == list(TERMS) and not fit["fixed_at_zero"]
    for term, value in KNOWN.items():
        assert model[term] == pytest.approx(value, rel=1e-3), term
    assert fit["r2"] > 0.9999 and fit["p90_rel_error"] < 1e-3
    assert model["source"] == "measured"
    # without prompt lengths: base and per-decode only, said so
    bare = calibrate_from_log(str(tmp_path / "out" / "events.jsonl"))
    assert bare["fit"]["not_in_log"] == ["per_prefill_token_s", "per_context_token_s"]
    assert bare["per_prefill_token_s"] == bare["per_context_token_s"] == 0.0
    assert "no prompt lengths" in bare["note"]


def test_the_fit_on_a_recorded_cpu_engine_log(tmp_path, capsys):
    """A log recorded once from a real CPU engine on the tiny model
    (``tests/data/record_calibration_log.py``): the fit is sane and says
    how good it is."""
    out = tmp_path / "step.json"
    assert twin.main(["calibrate", "--events", str(DATA / "calibration-events.jsonl"),
                      "--prompts", str(DATA / "calibration-prompts.jsonl"),
                      "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "measured step-time model" in printed and "R²" in printed
    model = load_step_time(str(out))  # the twin reads it
    assert model.source == "measured" and not model.is_estimate
    fit = model.fit
    assert fit["steps"] >= 500 and fit["step_counts"]["unknown_prompt"] == 0
    assert 0.0002 < model.base_s < 0.02  # a CPU engine's step: a few ms
    assert model.per_decode_s > 0  # more requests, longer steps
    assert fit["r2"] > 0.3 and fit["median_rel_error"] < 0.35
    assert fit["median_step_s"] > model.base_s


def test_calibrate_refuses_what_it_cannot_fit(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text('{"kind": "start", "t_ns": 1, "unix_ns": 1}\n')
    with pytest.raises(CalibrationError, match="no tokens lines"):
        calibrate_from_log(str(tmp_path / "empty.jsonl"))
    assert twin.main(["calibrate", "--events", str(tmp_path / "missing.jsonl"),
                      "--out", str(tmp_path / "x.json")]) == 2
    assert "twin calibrate: error:" in capsys.readouterr().err
    assert twin.main(["calibrate", "--model", tiny_model(), "--gpu", "z80",
                      "--out", str(tmp_path / "x.json")]) == 2
    assert "--gpu z80: not known" in capsys.readouterr().err


def test_roofline_estimate_from_a_config_and_a_gpu(tmp_path):
    out = tmp_path / "est.json"
    assert twin.main(["calibrate", "--model", tiny_model(), "--gpu", "h100",
                      "--out", str(out)]) == 0
    model = load_step_time(str(out))
    assert model.is_estimate and model.estimate["gpu"] == "h100"
    # the tiny model's shapes: 2 layers of attention (q, o 256x256; k, v
    # 256x128) and a gated MLP (3 x 256x512), embeddings and head 1024x256
    assert model.estimate["params"] == 2 * (196_608 + 393_216) + 2 * 1024 * 256
    assert model.estimate["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 4  # float32
    assert model.base_s > roofline.STEP_OVERHEAD_S
    assert 0 < model.per_context_token_s < model.per_decode_s
    llama7b = tmp_path / "llama7b"
    llama7b.mkdir()
    (llama7b / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
        "torch_dtype": "float16"}))
    est = roofline.roofline_estimate(str(llama7b), "A100")
    assert est["estimate"]["params"] == pytest.approx(6.74e9, rel=0.01)
    # weights streamed once a step: 13.5 GB at 0.8 x 2039 GB/s, about 8 ms
    assert est["base_s"] == pytest.approx(0.002 + 13.48e9 / (0.8 * 2039e9), rel=0.01)


def test_the_docs_page_holds_the_compare_schema():
    from vllm_output_rate.tools.twin.compare import COMPARE_SCHEMA

    doc = (REPO / "docs" / "twin.md").read_text()
    assert f"```json\n{json.dumps(COMPARE_SCHEMA, indent=2)}\n```" in doc
    assert " ".join(roofline.GPUS) in doc


# --------------------------------------------------------------------------- scale


def test_scale_keeps_r_resident_and_samples_memory(tmp_path):
    """``twin scale`` on a tiny grid, in this process: every cell keeps R
    requests resident for the virtual seconds asked, the limited arm
    throttles the heavy users' streams and upstream none, the memory run
    samples at each virtual interval; scale.json and scale.md hold it all.
    Wall times are recorded, never checked."""
    out = tmp_path / "scale"
    doc = twin_scale.run_scale([
        "--out", str(out), "--sizes", "8", "--users", "2", "50", "--virtual-s", "3",
        "--memory-s", "4", "--memory-every-s", "1", "--memory-size", "8",
        "--memory-users", "4", "--in-process"])
    cells = doc["cells"]
    assert [(c["size"], c["users"], c["arm"]) for c in cells] == [
        (8, 2, "limited"), (8, 2, "upstream"), (8, 50, "limited"), (8, 50, "upstream")]
    for c in cells:
        assert c["virtual_s"] == pytest.approx(3.0, abs=twin_scale.STEP_S)
        # a step every 25 ms, each running the model: R held throughout
        assert c["steps"] == c["model_steps"] == pytest.approx(3.0 / twin_scale.STEP_S, abs=1)
        assert c["resident_min"] == c["resident_max"] == 8 and c["waiting_mean"] > 0
        assert c["speed"] > 0 and c["steps_per_s"] > 0 and c["peak_rss_mib"] > 0
        # the scheduler's own calls are part of the run's wall time, so
        # alone they run at least as fast as the whole twin
        assert c["schedule_ms_per_step"] > 0 and c["update_ms_per_step"] > 0
        assert 0 < c["scheduler_share"] <= 1
        assert c["scheduler_bound_speed"] >= c["speed"]
        assert (c["limit_tok_s"] == 80.0) == (c["arm"] == "limited")
        assert (c["scheduler"].endswith("OutputRateScheduler")) == (c["arm"] == "limited")
        assert (out / "runs" / f"R8-U{c['users']}-{c['arm']}.summary.json").exists()
    assert cells[0]["throttled_share"] > 0.3 and cells[1]["throttled_share"] == 0
    mem = doc["memory"]
    assert [s["t"] for s in mem["samples"]] == [1.0, 2.0, 3.0, 4.0]
    assert all(s["resident"] == 8 and s["rss_mib"] > 0 for s in mem["samples"])
    assert mem["samples"][-1]["kept_samples"] > mem["samples"][0]["kept_samples"]
    assert mem["growth_mib"] == pytest.approx(mem["last_mib"] - mem["first_mib"], abs=0.11)
    saved = json.loads((out / "scale.json").read_text())
    assert set(saved) == {"facts", "cells", "memory"}
    assert {"command", "date", "commit", "load_before", "cpus"} <= set(saved["facts"])
    table = (out / "scale.md").read_text()
    assert "| 8 | 50 | upstream |" in table and "Memory: R=8" in table


def test_scale_workload_and_child_process():
    """The workload: R + R/8 at 0 s, then arrivals at 1.1 times what the arm
    serves, users drawn by Zipf weight; a cell's child process hands back
    its result, or its error."""
    lines = twin_scale.workload_lines(64, 16, "upstream", 30.0, seed=1)
    assert sum(1 for line in lines if line["t"] == 0) == 64 + 8
    rate = twin_scale.OVERLOAD * 64 / twin_scale.STEP_S / 400  # mean output 400 tokens
    assert len(lines) - 72 == pytest.approx(30 * rate, rel=0.1)
    users = [line["user"] for line in lines]
    assert users.count("user-0") > 3 * users.count("user-15")
    assert all(32 <= line["prompt_tokens"] <= 128 and 200 <= line["max_tokens"] <= 600
               for line in lines)
    # limited: each user's expected streams (64 x its Zipf weight), up to 2
    h = sum(1 / (k + 1) for k in range(16))
    streams = sum(min(64 / ((k + 1) * h), 2.0) for k in range(16))
    assert twin_scale.served_tok_s(64, 16, "limited", 2.0) == pytest.approx(
        streams / twin_scale.STEP_S)
    assert twin_scale.served_tok_s(64, 16, "upstream", 2.0) == 64 / twin_scale.STEP_S
    assert twin_scale.in_child(pow, 2, 10) == 1024
    with pytest.raises(twin_scale.ScaleError, match="ZeroDivisionError"):
        twin_scale.in_child(divmod, 1, 0)
