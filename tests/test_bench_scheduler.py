"""The scheduler benchmark runs (a tiny grid; its figures are not checked:
no wall-clock thresholds in tests, see BENCHMARKS.md for the measurements)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness import REPO


@pytest.mark.parametrize("args", [
    ["--same-scheduler"],
    ["--same-scheduler", "--telemetry", "--throttled-rate", "10"],
    ["--same-scheduler", "--telemetry", "--cpu", "--no-traces"],
    ["--same-scheduler", "--telemetry", "--thread-cpu", "--throttled-rate", "10"],
    ["--control"],
])
def test_the_benchmark_runs_and_prints_its_table(args):
    run = subprocess.run(
        [sys.executable, "-m", "vllm_output_rate.tools.bench_scheduler", "--sizes", "8", "--users", "1", "2", "--shares", "0", "0.5",
         "--blocks", "2", "--block-steps", "2", "--pairs", "1", *args],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| 8 |")]
    # R=8: one user unthrottled; two users at 0% and 50% throttled
    assert len(rows) == 3, run.stdout
    for row in rows:
        cells = row.split("|")
        assert float(cells[7]) > 0
        if "--cpu" in args:
            # the ratio with the metrics export charged in full, the
            # scheduler thread's own ratio, the background threads' share
            assert len(cells) == 14, row
            assert float(cells[10]) > 0 and float(cells[11]) > 0 and float(cells[12]) >= 0, row
