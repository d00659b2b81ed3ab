"""The what-if twin's speed and memory at scale: virtual seconds per wall
second with R requests resident over U users, and its memory over a long
virtual run.

``vllm-output-rate twin scale --out DIR [--sizes R ...] [--users U ...]
[--arms limited upstream] [--virtual-s S] [--memory-s S] [--memory-size R]
[--memory-users U] [--no-memory] [--in-process] [--seed N]``

Each cell of the grid (R in ``--sizes``, default 256 1,024 4,096; U in
``--users``, default 16 1,000 10,000) runs the twin (``twin.run.Twin``,
vLLM's scheduler and KV cache manager in this process, a fixed 25 ms step)
for ``--virtual-s`` virtual seconds (default 60) on a workload that keeps R
requests resident (``--max-num-seqs R``): R of them at 0 s and R/8 more
waiting, then Poisson arrivals at 1.1 times what the arm serves, prompts of
32 to 128 tokens, outputs of 200 to 600 (a request decodes for 5 to 15 s at
full speed), each request's user drawn among U with Zipf weights (user k
with weight 1/(k+1): a few heavy users with many streams beside many light
ones). Two arms:

* ``limited``: the plugin's scheduler with its telemetry (the event log
  written), every user at 80 tok/s (``--output-rate-default-tokens-per-second``:
  two streams at full speed), so a user with more than two streams
  resident is paced (19% to 98% of the resident request-seconds throttled
  in BENCHMARKS.md's grid); arrivals at 1.1 times what the users' expected
  streams may take under their limits (an estimate: the waiting queue
  grows when they take less);
* ``upstream``: vLLM's own scheduler, no limits; arrivals at 1.1 times the
  capacity (R tokens every 25 ms).

With users drawn uniformly, more of them than resident slots and every
one limited below a single stream's speed, residency preempts a throttled
stream for each waiting request with budget at every step, and the resident
set falls well below R (BENCHMARKS.md); the Zipf users keep it at R.

Per cell: virtual s per wall s (1.0 keeps up with real time), steps per
wall s, wall ms per step and how much of it the scheduler's own
``schedule()`` and ``update_from_output()`` took (vLLM's; in the limited arm
with the limiter's wrapper inside them): the virtual s per wall s of those
calls alone is what no twin running that scheduler can beat on this
machine; the resident and waiting requests (mean of a
sample per virtual second), the share of resident request-seconds
throttled, the peak RSS. Each cell runs in a child process forked for it
(``--in-process``: in this one), so that one cell's heap neither slows nor
swells the next; the peak RSS is the child's (with what it inherits: vLLM
imported). Then the memory check (``--no-memory`` skips it): one run at
R = ``--memory-size`` (1,024) and U = ``--memory-users`` (1,000), the
limited arm, for ``--memory-s`` virtual seconds (600), its RSS sampled every
virtual minute beside the requests resident and waiting and the samples
the twin keeps; the growth from the first minute's sample to the last.

Written to ``DIR``: ``scale.json`` (every figure, the command, the date,
the commit, the machine's load before and after each cell) and
``scale.md`` (the tables); each run's ``summary.json`` in ``DIR/runs/``.
Wall times are this machine's, shared with whatever else runs: read them
with the load printed beside them.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import math
import multiprocessing
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: the step time of every run (a GPU's decode step at these batch sizes)
STEP_S = 0.025
SIZES = (256, 1024, 4096)
USERS = (16, 1000, 10000)
ARMS = ("limited", "upstream")
#: prompt and output lengths (tokens), uniform in these ranges
PROMPT_TOKENS = (32, 128)
OUTPUT_TOKENS = (200, 600)
MAX_MODEL_LEN = 1024
BLOCK_SIZE = 16
#: arrivals per second over what the arm serves: the waiting queue grows
#: slowly, so every freed resident slot is taken at once
OVERLOAD = 1.1
#: the memory run's arrivals against what it serves: below it (the
#: estimate is rough), so that its waiting queue does not grow
MEMORY_LOAD = 0.7
#: the limited arm's rate of every user, in streams at full speed (one
#: token per step each)
LIMIT_STREAMS = 2.0
#: requests waiting at 0 s beside the R resident, as a share of R
BACKLOG = 0.125
NS = 1_000_000_000


class ScaleError(Exception):
    """A grid that cannot be run as asked (one line, no traceback)."""


def capacity(size: int) -> float:
    """Output tok/s with R requests decoding in every 25 ms step."""
    return size / STEP_S


def user_weights(users: int) -> list[float]:
    """Each user's share of the requests: Zipf, user k at 1/(k+1)."""
    weights = [1 / (k + 1) for k in range(users)]
    total = sum(weights)
    return [w / total for w in weights]


def served_tok_s(size: int, users: int, arm: str, limit_streams: float) -> float:
    """What the arm serves with R requests resident, each user holding its
    expected share of them: the capacity upstream; with limits, each
    user's streams up to its limit."""
    if arm != "limited":
        return capacity(size)
    return sum(min(size * w, limit_streams) for w in user_weights(users)) / STEP_S


def workload_lines(size: int, users: int, arm: str, virtual_s: float, seed: int,
                   limit_streams: float = LIMIT_STREAMS, load: float = OVERLOAD
                   ) -> list[dict[str, Any]]:
    """The cell's workload (``tools.twin.workload`` lines): R + R/8 requests at
    0 s, then Poisson arrivals at ``load`` (default ``OVERLOAD``) times
    what the arm serves until ``virtual_s``."""
    rng = random.Random(f"{seed}-{size}-{users}-{arm}")
    names = [f"user-{k}" for k in range(users)]
    cumulative = list(itertools.accumulate(user_weights(users)))
    mean_output = sum(OUTPUT_TOKENS) / 2
    rate = load * served_tok_s(size, users, arm, limit_streams) / mean_output

    def line(t: float) -> dict[str, Any]:
        user = names[min(bisect.bisect(cumulative, rng.random()), users - 1)]
        return {"t": round(t, 6), "user": user,
                "prompt_tokens": rng.randint(*PROMPT_TOKENS),
                "max_tokens": rng.randint(*OUTPUT_TOKENS)}

    lines = [line(0.0) for _ in range(size + math.ceil(BACKLOG * size))]
    t = rng.expovariate(rate)
    while t < virtual_s:
        lines.append(line(t))
        t += rng.expovariate(rate)
    return lines


def twin_argv(size: int, users: int, arm: str, workload: Path, step: Path, out: Path,
              until: float, seed: int, limit_streams: float = LIMIT_STREAMS) -> list[str]:
    """``twin run``'s options for the cell (the KV cache: every resident
    request at the model's full length)."""
    argv = ["--workload", str(workload), "--out", str(out), "--step-time", str(step),
            "--max-num-seqs", str(size),
            "--max-num-batched-tokens", str(max(8192, 4 * size)),
            "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
            "--num-gpu-blocks-override", str(size * MAX_MODEL_LEN // BLOCK_SIZE + 1), "--no-plots",
            "--until", f"{until:g}", "--seed", str(seed)]
    if arm == "limited":
        argv += ["--output-rate-default-tokens-per-second", f"{limit_streams / STEP_S:g}"]
    return argv


def rss_mib() -> float:
    """This process's resident set now (``VmRSS``), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mib() -> float:
    """This process's peak resident set (``ru_maxrss``, KiB on Linux), MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def sampled_twin(argv: list[str], every_s: float, memory: bool):
    """A ``Twin`` of ``twin run``'s options ``argv`` that, at the first update of
    every ``every_s`` virtual seconds, samples the requests resident and
    waiting (and, ``memory``, the RSS and the samples the twin keeps)."""

    from vllm_output_rate.tools.twin.config import TwinConfig
    from vllm_output_rate.tools.twin.run import Twin

    class SampledTwin(Twin):
        def _on_update(self, engine_outputs: Any, now: int) -> None:
            super()._on_update(engine_outputs, now)
            if now < self.next_sample_ns:
                return
            self.next_sample_ns += round(every_s * NS) * max(
                1, (now - self.next_sample_ns) // round(every_s * NS) + 1)
            sched = self.scheduler
            sample = {"t": round((now - self.stats.t0_ns) / NS, 3), "resident": len(sched.running),
                      "waiting": len(sched.waiting)}
            if memory:
                users = self.stats.users.values()
                sample.update(
                    rss_mib=round(rss_mib(), 1), wall_s=round(time.perf_counter() - self.wall0, 2),
                    kept_samples=sum(len(u.itl_ns) + len(u.ttft_ns) for u in users),
                    requests_seen=len(self.stats._reqs))
            self.samples.append(sample)

    twin = SampledTwin(TwinConfig.from_argv(argv))
    twin.samples = []
    twin.next_sample_ns = twin.stats.t0_ns + round(every_s * NS)
    twin.wall0 = time.perf_counter()
    return twin


def run_cell(size: int, users: int, arm: str, virtual_s: float, seed: int,
             work: Path,
             memory_every_s: float | None = None,
             limit_streams: float = LIMIT_STREAMS, load: float = OVERLOAD) -> dict[str, Any]:
    """One run of the twin: its facts, the samples, the peak RSS."""
    work.mkdir(parents=True, exist_ok=True)
    workload = work / "workload.jsonl"
    lines = workload_lines(size, users, arm, virtual_s, seed, limit_streams, load)
    with open(workload, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    step = work / "step_time.json"
    step.write_text(json.dumps({"version": 1, "kind": "linear", "base_s": STEP_S,
                                "source": "hand", "note": "twin scale: a fixed 25 ms step"}))
    argv = twin_argv(size, users, arm, workload, step, work / "twin", virtual_s, seed,
                     limit_streams)
    rss_before = rss_mib()
    load_before = os.getloadavg()
    twin = sampled_twin(argv, memory_every_s or 1.0, memory_every_s is not None)
    summary = twin.run()
    run = summary["run"]
    samples = twin.samples
    resident = [s["resident"] for s in samples]
    waiting = [s["waiting"] for s in samples]
    throttled_s = sum(u["throttled_request_s"] for u in summary["users"].values())
    tokens = sum(u["output_tokens"] for u in summary["users"].values())
    virtual, wall = run["virtual_s"], run["wall_s"]
    steps = run["steps"]
    # the scheduler's own calls: vLLM's schedule() and update_from_output()
    # (the limited arm's with the limiter's wrapper inside); the twin can
    # run no faster than these alone
    schedule_ns, update_ns = twin.driver.schedule_ns, twin.driver.update_ns
    scheduler_s = 1e-9 * (schedule_ns + update_ns)
    return {
        "size": size, "users": users, "arm": arm,
        "limit_tok_s": limit_streams / STEP_S if arm == "limited" else None,
        "argv": argv, "scheduler": run["scheduler"], "requests": run["requests"],
        "virtual_s": virtual, "wall_s": wall, "steps": run["steps"],
        "model_steps": run["model_steps"], "num_gpu_blocks": run["num_gpu_blocks"],
        "speed": round(virtual / wall, 3) if wall else None,
        "steps_per_s": round(run["steps"] / wall, 1) if wall else None,
        "ms_per_step": round(1e3 * wall / run["steps"], 3) if run["steps"] else None,
        "schedule_ms_per_step": round(1e-6 * schedule_ns / steps, 3) if steps else None,
        "update_ms_per_step": round(1e-6 * update_ns / steps, 3) if steps else None,
        "scheduler_share": round(scheduler_s / wall, 3) if wall else None,
        "scheduler_bound_speed": round(virtual / scheduler_s, 3) if scheduler_s else None,
        "resident_min": min(resident, default=0), "resident_max": max(resident, default=0),
        "resident_mean": round(sum(resident) / len(resident), 1) if resident else 0,
        "waiting_mean": round(sum(waiting) / len(waiting), 1) if waiting else 0,
        "waiting_last": waiting[-1] if waiting else 0,
        "throttled_share": (round(throttled_s / (virtual * sum(resident) / len(resident)), 3)
                            if resident and virtual and sum(resident) else 0.0),
        "output_tok_s": round(tokens / virtual, 1) if virtual else None,
        "rss_before_mib": round(rss_before, 1), "peak_rss_mib": round(peak_rss_mib(), 1),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "samples": samples if memory_every_s is not None else None,
        "summary": summary,
    }


def _child(conn: Any, fn: Any, args: tuple) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except BaseException as exc:  # sent back whole: the parent raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def in_child(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a child process forked for it (its heap its own);
    its result back through a pipe."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, args))
    proc.start()
    child.close()
    try:
        status, value = parent.recv()
    except EOFError:
        status, value = "error", "the child process died"
    proc.join()
    if status != "ok":
        raise ScaleError(f"{getattr(fn, '__name__', fn)}{args[1:4]}: {value}")
    return value


def git_commit() -> dict[str, Any]:
    """The checkout's commit and whether its tree has changes (None outside one)."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "--short", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "changes": bool(status) if status is not None else None}


def memory_check(cell: dict[str, Any]) -> dict[str, Any]:
    """The memory run's samples read: the growth from the first virtual
    minute's RSS to the last, and per minute after the first."""
    samples = cell["samples"] or []
    if len(samples) < 2:
        return {"samples": samples, "growth_mib": None, "growth_pct": None}
    first, last = samples[0], samples[-1]
    minutes = (last["t"] - first["t"]) / 60
    growth = last["rss_mib"] - first["rss_mib"]
    return {"samples": samples, "first_mib": first["rss_mib"], "last_mib": last["rss_mib"],
            "growth_mib": round(growth, 1),
            "growth_pct": round(100 * growth / first["rss_mib"], 2),
            "mib_per_min": round(growth / minutes, 2) if minutes else None}


def render(doc: dict[str, Any]) -> str:
    """``scale.md``: the facts, the grid's table, the memory check's."""
    facts = doc["facts"]
    lines = ["# The twin's speed and memory", "",
             f"- command: `{facts['command']}`",
             f"- date: {facts['date']}; commit: `{facts['commit']}`"
             + (" (with uncommitted changes)" if facts["changes"] else ""),
             f"- machine: {facts['cpus']} CPUs, Python {facts['python']}, "
             f"vLLM {facts['vllm']}; load average before: "
             + ", ".join(f"{x:.2f}" for x in facts["load_before"]),
             f"- step: {STEP_S * 1e3:g} ms fixed; {facts['virtual_s']:g} virtual s a cell; "
             f"each cell in {'this process' if facts['in_process'] else 'a child process'}",
             "", "| R | users | arm | limit tok/s | virtual s / wall s | steps / wall s | "
             "wall ms / step | of it schedule() + update_from_output() ms | "
             "scheduler alone: virtual s / wall s | resident mean (min) | waiting mean | "
             "throttled | peak RSS MiB | load 1 min after |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for c in doc["cells"]:
        limit = "–" if c["limit_tok_s"] is None else f"{c['limit_tok_s']:g}"
        lines.append(
            f"| {c['size']:,} | {c['users']:,} | {c['arm']} | {limit} | **{c['speed']:.2f}** | "
            f"{c['steps_per_s']:.1f} | {c['ms_per_step']:.1f} | "
            f"{c['schedule_ms_per_step'] + c['update_ms_per_step']:.1f} | "
            f"{c['scheduler_bound_speed']:.2f} | {c['resident_mean']:,.0f} "
            f"({c['resident_min']:,}) | {c['waiting_mean']:,.0f} | "
            f"{100 * c['throttled_share']:.0f}% | {c['peak_rss_mib']:,.0f} | "
            f"{c['load_after'][0]:.2f} |")
    mem = doc.get("memory")
    if mem:
        c = mem["cell"]
        lines += ["", f"Memory: R={c['size']:,}, {c['users']:,} users, {c['arm']}, "
                  f"{c['virtual_s']:g} virtual s in {c['wall_s']:g} wall s "
                  f"({c['speed']:.2f}x); RSS {mem['first_mib']:,} MiB at the first virtual "
                  f"minute, {mem['last_mib']:,} at the last: {mem['growth_mib']:+,} MiB "
                  f"({mem['growth_pct']:+.1f}%, {mem['mib_per_min']:+.2f} MiB a minute)", "",
                  "| virtual s | RSS MiB | resident | waiting | samples kept | requests seen | "
                  "wall s |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for s in mem["samples"]:
            lines.append(f"| {s['t']:g} | {s['rss_mib']:,} | {s['resident']:,} | "
                         f"{s['waiting']:,} | {s['kept_samples']:,} | {s['requests_seen']:,} | "
                         f"{s['wall_s']:g} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-output-rate twin scale",
        description="The twin's virtual seconds per wall second with R requests resident "
                    "over U users (limits on and off), and its memory over a long run.")
    parser.add_argument("--out", required=True, help="the output directory")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                        help="resident requests R (--max-num-seqs)")
    parser.add_argument("--users", type=int, nargs="+", default=list(USERS))
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--virtual-s", type=float, default=60.0,
                        help="virtual seconds of each cell (default 60)")
    parser.add_argument("--memory-s", type=float, default=600.0,
                        help="virtual seconds of the memory run (default 600)")
    parser.add_argument("--memory-every-s", type=float, default=60.0,
                        help="virtual seconds between its RSS samples (default 60)")
    parser.add_argument("--memory-size", type=int, default=1024)
    parser.add_argument("--memory-users", type=int, default=1000)
    parser.add_argument("--memory-load", type=float, default=MEMORY_LOAD,
                        help="the memory run's arrivals, as a share of what its users are "
                        f"estimated to be served (default {MEMORY_LOAD}: the waiting queue stays "
                        "short, so memory shows the twin's own, not a growing queue's)")
    parser.add_argument("--no-memory", action="store_true", help="no memory run")
    parser.add_argument("--in-process", action="store_true",
                        help="run every cell in this process (default: a child each)")
    parser.add_argument("--keep-runs", action="store_true",
                        help="keep each run's folder (event log, metrics) in DIR/runs/")
    parser.add_argument("--limit-streams", type=float, default=LIMIT_STREAMS,
                        help="the limited arm's rate of every user, in streams at full speed "
                        "(default 2: 80 tok/s with the 25 ms step)")
    parser.add_argument("--seed", type=int, default=1)
    return parser


def run_scale(argv: list[str]) -> dict[str, Any]:
    """The grid and the memory check with the twin (``twin.run.Twin``);
    writes ``scale.json`` and ``scale.md``."""
    from vllm_output_rate.internals import installed_vllm_version

    args = build_parser().parse_args(argv)
    if min(args.sizes + args.users) < 1 or args.virtual_s <= 0 or args.memory_s <= 0:
        raise ScaleError("--sizes, --users, --virtual-s and --memory-s must be positive")
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="twin-scale-")) if not args.keep_runs else out / "runs"

    def call(*cell_args: Any) -> dict[str, Any]:
        if args.in_process:
            return run_cell(*cell_args)
        return in_child(run_cell, *cell_args)

    facts = {"command": "vllm-output-rate twin scale " + " ".join(argv),
             "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), **git_commit(),
             "cpus": os.cpu_count(), "python": sys.version.split()[0],
             "vllm": installed_vllm_version(), "load_before": list(os.getloadavg()),
             "virtual_s": args.virtual_s, "in_process": args.in_process, "out": str(out)}
    doc: dict[str, Any] = {"facts": facts, "cells": [], "memory": None}
    try:
        for size in args.sizes:
            for users in args.users:
                for arm in args.arms:
                    name = f"R{size}-U{users}-{arm}"
                    cell = call(size, users, arm, args.virtual_s, args.seed, scratch / name,
                                None, args.limit_streams)
                    (out / "runs" / f"{name}.summary.json").write_text(
                        json.dumps(cell.pop("summary"), indent=1) + "\n")
                    print(f"{name}: {cell['virtual_s']:g} virtual s in {cell['wall_s']:g} wall s "
                          f"({cell['speed']:.2f}x), {cell['steps_per_s']:.1f} steps/s, resident "
                          f"{cell['resident_mean']:g}, peak RSS {cell['peak_rss_mib']:,.0f} MiB, "
                          f"load {cell['load_after'][0]:.2f}", flush=True)
                    doc["cells"].append(cell)
        if not args.no_memory:
            name = f"memory-R{args.memory_size}-U{args.memory_users}-limited"
            cell = call(args.memory_size, args.memory_users, "limited", args.memory_s,
                        args.seed, scratch / name, args.memory_every_s, args.limit_streams,
                        args.memory_load)
            (out / "runs" / f"{name}.summary.json").write_text(
                json.dumps(cell.pop("summary"), indent=1) + "\n")
            memory = memory_check(cell)
            memory["cell"] = {k: v for k, v in cell.items() if k != "samples"}
            doc["memory"] = memory
            print(f"{name}: RSS {memory.get('first_mib')} -> {memory.get('last_mib')} MiB "
                  f"({memory.get('growth_pct')}%)", flush=True)
    finally:
        if not args.keep_runs:
            shutil.rmtree(scratch, ignore_errors=True)
    (out / "scale.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "scale.md").write_text(render(doc))
    return doc

