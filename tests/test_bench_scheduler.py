"""The scheduler benchmark runs (a tiny grid; its figures are not checked:
no wall-clock thresholds in tests, see BENCHMARKS.md for the measurements).

The five argument sets run one after the other in ONE subprocess (the
benchmark sets process-wide state: its mode flags, the OTLP environment of
the span exporter); one import of vLLM instead of five."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness import REPO

GRID = ["--sizes", "8", "--users", "1", "2", "--shares", "0", "0.5", "--blocks", "2",
        "--block-steps", "2", "--pairs", "1"]
ARGS = [
    ["--same-scheduler", "--waiting", "16"],
    ["--same-scheduler", "--telemetry", "--throttled-rate", "10"],
    ["--same-scheduler", "--telemetry", "--cpu", "--no-traces"],
    ["--same-scheduler", "--telemetry", "--thread-cpu", "--throttled-rate", "10"],
    ["--control"],
]
MARK = "=== bench run "
RUNNER = f"""
import json, sys
from vllm_output_rate.tools.bench import scheduler as bench_scheduler
for i, args in enumerate(json.loads(sys.argv[1])):
    print({MARK!r} + str(i), flush=True)
    bench_scheduler.main(args)
"""


@pytest.fixture(scope="module")
def outputs() -> list[str]:
    run = subprocess.run([sys.executable, "-c", RUNNER, json.dumps([GRID + a for a in ARGS])],
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    parts = run.stdout.split(MARK)[1:]
    assert [p.split("\n", 1)[0] for p in parts] == [str(i) for i in range(len(ARGS))], run.stdout
    return [p.split("\n", 1)[1] for p in parts]


@pytest.mark.parametrize("index", range(len(ARGS)), ids=[" ".join(a) for a in ARGS])
def test_the_benchmark_runs_and_prints_its_table(outputs, index):
    args, out = ARGS[index], outputs[index]
    rows = [line for line in out.splitlines() if line.startswith("| 8 |")]
    # R=8: one user unthrottled; two users at 0% and 50% throttled
    assert len(rows) == 3, out
    for row in rows:
        cells = row.split("|")
        assert float(cells[7]) > 0
        if "--cpu" in args:
            # the ratio with the metrics export charged in full, the
            # scheduler thread's own ratio, the background threads' share
            assert len(cells) == 14, row
            assert float(cells[10]) > 0 and float(cells[11]) > 0 and float(cells[12]) >= 0, row
