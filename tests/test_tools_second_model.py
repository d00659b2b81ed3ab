"""End to end: the launch tools on a model they never saw.

The second generated model (another tokenizer: several tokens per word;
another shape) through the demo, the load generator and the profiler;
``verify``, ``stress`` and ``soak`` run on it in their own tests. Sizes are
in tokens of that model's tokenizer, never in words.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from harness import scrape_until, second_model
from vllm_output_rate.tools import demo
from vllm_output_rate.tools.loadgen import run as loadgen
from vllm_output_rate.tools.bench import profile_engine as prof
from vllm_output_rate.tools.bench import profile_stacks
from vllm_output_rate.tools.common.client import Server, metric_value
from vllm_output_rate.tools.loadgen.scenario import load_scenario

pytestmark = pytest.mark.e2e

SCENARIO = {
    "name": "second-model",
    "timeout_s": 120,
    "server": {"default_limit": 100000, "args": ["--max-num-seqs", "16", "--max-model-len", "1024"]},
    "users": {"user-a": 20, "user-c": "unlimited"},
    # 900 tokens of this model's tokenizer: with 64 to generate, within the
    # 1,024 positions only when counted in tokens (in words it would not fit)
    "prompts": {"short": "Explain continuous batching.", "long": {"tokens": 900, "seed": 3}},
    "phases": [{"name": "mixed", "streams": [
        {"user": "user-a", "count": 2, "prompt": "short", "max_tokens": 40},
        {"user": "user-a", "prompt": "long", "max_tokens": 64},
        {"user": "user-c", "prompt": "short", "max_tokens": 200}]}],
}


def test_the_demo_on_a_second_model(capsys):
    code = demo.main(["--model", second_model()])
    out = capsys.readouterr().out
    print(out)
    assert code == 0
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(
        r"^(user-[abc])\s+(\S+)\s+(\d+)\s+(\d+)\s+\S+\s+\S+\s+\S+\s+(\d+)/(\d+)\s+(\S+)\s+(\S+)\s*$",
        out, re.M)}
    assert set(rows) == {"user-a", "user-b", "user-c"}, out
    for user, (limit, streams, tokens, done, sent, charged, spacing_ms) in rows.items():
        assert done == sent and float(charged) == int(tokens), (user, rows[user])
        if user != "user-c":
            # held at the limit, read engine-side (the client's rate/limit
            # column sees chunks bunched on two shared cores: 1.57 once under
            # a busy process): a stream's mean spacing at least streams /
            # limit (the burst's few tokens aside), far from what an
            # unlimited stream does; the exact rate is test_telemetry_scenarios'
            assert float(spacing_ms) >= 0.9 * int(streams) * 1000 / float(limit), (user, rows[user])


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    path = tmp_path_factory.mktemp("scenario") / "second.yaml"
    path.write_text(yaml.safe_dump(SCENARIO, sort_keys=False))
    return path


def test_loadgen_and_profile_on_a_second_model(scenario, tmp_path):
    sc = load_scenario(scenario)
    args = sc.server_args(sc.server_limits())
    with Server(second_model(), args, tmp_path / "server.log",
                extra_env={"OUTPUT_RATE_TELEMETRY": "1"}) as server:
        record = tmp_path / "run.json"
        code = loadgen.main(["--server", server.base_url, "--scenario", str(scenario),
                             "--out", str(record), "--no-progress"])
        assert code == 0
        run = json.loads(record.read_text())
        requests = run["requests"]
        assert len(requests) == 4
        assert all(r["error"] is None for r in requests), [r["error"] for r in requests]
        assert all(r["completion_tokens"] == r["max_tokens"] for r in requests)
        long = [r for r in requests if r["prompt"] == "long"]
        assert long and all(r["prompt_tokens"] >= 900 for r in long)  # the model's own tokens
        charged = metric_value(scrape_until(server.base_url, lambda s: metric_value(  # one export
            s, "vllm_output_rate_tokens_charged_total", user="user-a") >= 2 * 40 + 64),
            "vllm_output_rate_tokens_charged_total", user="user-a")
        assert charged == 2 * 40 + 64
        # the profiler on the same engine core, under load of its own (at
        # 250 Hz, as test_profile: py-spy pauses the engine for each sample)
        core = prof.find_engine_core(server.proc.pid, timeout_s=30)
        for attempt in range(3):
            out = tmp_path / f"profile-{attempt}"
            out.mkdir()
            report = prof.profile_engine(core, out, "on", seconds=4, base_url=server.base_url,
                                         plan=[("user-a", 4, 120), ("user-c", 2, 400)],
                                         warmup_s=1.0, rate=250)
            if report.inclusive_counts[profile_stacks.LIMITER] > 0:
                break
    print("\n" + profile_stacks.format_table({"on": report}))
    assert report.total > 0
    counts = report.inclusive_counts
    assert counts[profile_stacks.SCHEDULE] > 0 and counts[profile_stacks.LIMITER] > 0
    assert report.meta["tokens"].get("user-c", 0) > 0

