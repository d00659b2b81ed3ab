"""How close the what-if twin comes to the real engine:
``vllm-output-rate twin accuracy``.

``vllm-output-rate twin accuracy [--model DIR] [--replays N] [--workload NAME ...]
[--calibration-s S | --step-time FILE] [--real-from DIR] --out DIR``

``--real-from DIR`` takes the real runs (and the calibration's log, fitted
again) of an earlier run's ``--out`` and runs only the twin: a change to the
twin is scored against the same real runs.

1. Calibrates the twin's step time on a real engine (``twin calibrate``'s
   load against a fresh ``vllm-output-rate serve``, its event log fitted).
2. For each workload (``WORKLOADS``: a flood beside steady users; tiers with
   a live limit change; on/off bursts; each beside an unlimited user) replays
   it ``--replays`` times, each on a fresh engine started with the same
   options (``SERVE_ARGS`` and the workload's limits file) after a short
   warm-up, and runs the twin on each replay's own arrivals (when the client
   sent each request: its event loop runs late by up to a few hundred ms at
   times, and a request sent late may find its user's next token free) with
   the calibrated step time (the request path drawn from its measured
   spread, a seed per replay) and the same options, cut at the same moment
   (``GRACE_S`` after the arrivals).
3. Compares per user the figures of the twin's ``summary.json``: rate
   (first token to last), TTFT p50/p90 (arrival to first token) and
   spacing p50/p90, the median of the twin's runs against the median of
   the real runs, beside the real runs' own spread (each real run against
   the median of the others).

The real figures are engine-side, computed as the twin computes its own
(``figures_from_log``; a test checks that both agree on a twin run): a
token's time is its step's line in the engine event log
(``OUTPUT_RATE_EVENTS``), a request's arrival the client's send, both on
the machine's monotonic clock (the engine core stamps with
``time.monotonic_ns``; one clock for every process of a machine). A live
change is written where the twin writes it, at its time, and the server is
sent SIGHUP (the engine re-reads at once instead of at its next 250 ms poll).
Requests are ``/v1/completions`` streams of token ids (sizes in tokens,
whatever the tokenizer), ``ignore_eos``, the user named by
``vllm_xargs.output_rate_user``.

Writes ``accuracy.json`` (every run's figures, the table) and
``accuracy.md`` (the table, the goals met or not) to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_output_rate.tools.workload import _poisson, _request

NS = 1_000_000_000
#: the engine's options, the same for the real engine and the twin: the
#: project's capped configuration (resident set 4x the active one)
SERVE_ARGS = ["--max-model-len", "1024", "--max-num-seqs", "32", "--max-num-active-seqs", "8"]
#: an unlimited user's limit (far above what the CPU engine can do)
UNLIMITED = 100000
#: seconds after the arrivals end at which both runs are cut
GRACE_S = 10.0
USER_FIELD = "output_rate_user"
WARMUP_USER = "warmup"
#: the figures compared: (name in the table, summary key, quantile or None)
FIGURES = (("rate", "rate_tok_s", None),
           ("TTFT p50", "ttft_s", "p50"), ("TTFT p90", "ttft_s", "p90"),
           ("spacing p50", "itl_s", "p50"), ("spacing p90", "itl_s", "p90"))
#: issue 28's goals: relative error of a figure, and the absolute error
#: (seconds) that passes a small figure ("or 10 ms where smaller")
GOALS = {"rate limited": 0.02, "rate unlimited": 0.10, "p50": 0.10, "p90": 0.15}
ABS_S = 0.010


# --------------------------------------------------------------------------- workloads


@dataclass
class AccuracyWorkload:
    """A workload of the comparison: its requests (the twin's format), the
    limits file at the start, limit changes ``(t, yaml)``, its arrivals'
    duration."""
    name: str
    lines: list[dict[str, Any]]
    limits: str
    changes: list[tuple[float, str]] = field(default_factory=list)
    duration_s: float = 30.0

    def unlimited_users(self) -> set[str]:
        return {"open"}


#: a request line of the twin's workload format, and Poisson arrival times
#: (``tools.workload``'s generators')
_req = _request


def _paced(rng: random.Random, users: list[str], rate: float, duration: float,
           max_tokens: int) -> list[dict[str, Any]]:
    """Each of ``users`` sending ``rate`` requests/s of 64-token prompts and
    ``max_tokens`` answers over ``duration`` s, user after user."""
    return [_req(t, user, 64, max_tokens) for user in users
            for t in _poisson(rng, rate, 0.0, duration)]


def _limits_yaml(default: float, users: dict[str, float]) -> str:
    body = ", ".join(f"{u}: {r:g}" for u, r in sorted(users.items()))
    return f"default: {default:g}\nusers: {{{body}}}\n"


def _open_user(rng: random.Random, duration: float) -> list[dict[str, Any]]:
    """The unlimited user: a request a second, 96 tokens each."""
    return _paced(rng, ["open"], 1.0, duration, 96)


def flood(seed: int, duration: float = 30.0) -> AccuracyWorkload:
    """A user opening 16 long streams at once (limit 40 tok/s) beside three
    steady users below their limit (20 tok/s) and the unlimited one."""
    rng = random.Random(seed)
    lines = [_req(rng.uniform(0, 0.1), "flooder", 64, 512) for _ in range(16)]
    lines += _paced(rng, [f"steady-{i}" for i in range(3)], 0.5, duration, 32)
    lines += _open_user(rng, duration)
    limits = _limits_yaml(20, {"flooder": 40, "open": UNLIMITED})
    return AccuracyWorkload("flood", sorted(lines, key=lambda x: x["t"]), limits,
                            duration_s=duration)


def tiers(seed: int, duration: float = 30.0) -> AccuracyWorkload:
    """Two gold users (40 tok/s) and three free ones (10 tok/s, lowered to
    5 halfway, live), each sending about 32 tok/s of demand, beside the
    unlimited user."""
    rng = random.Random(seed)
    users = [f"gold-{i}" for i in range(2)] + [f"free-{i}" for i in range(3)]
    lines = _paced(rng, users, 0.5, duration, 64)
    lines += _open_user(rng, duration)

    def limits(free: float) -> str:
        rates = {u: (40 if u.startswith("gold") else free) for u in users}
        return _limits_yaml(20, {**rates, "open": UNLIMITED})

    return AccuracyWorkload("tiers", sorted(lines, key=lambda x: x["t"]), limits(10),
                            [(round(duration / 2, 3), limits(5))], duration)


def bursts(seed: int, duration: float = 30.0) -> AccuracyWorkload:
    """A user sending 4 requests/s for 5 s in every 10 (limit 50 tok/s)
    beside two steady users (20 tok/s) and the unlimited one."""
    rng = random.Random(seed)
    lines = []
    start = 0.0
    while start < duration:
        lines += [_req(t, "bursty", 64, 64) for t in _poisson(rng, 4.0, start,
                                                               min(start + 5.0, duration))]
        start += 10.0
    lines += _paced(rng, [f"steady-{i}" for i in range(2)], 0.5, duration, 32)
    lines += _open_user(rng, duration)
    limits = _limits_yaml(20, {"bursty": 50, "open": UNLIMITED})
    return AccuracyWorkload("bursts", sorted(lines, key=lambda x: x["t"]), limits,
                            duration_s=duration)


WORKLOADS = {"flood": flood, "tiers": tiers, "bursts": bursts}


def replay_events(wl: AccuracyWorkload) -> list[tuple[float, Any]]:
    """The workload's requests and limit changes in the order they are
    sent: ``(t, request line)`` or ``(t, limits text)``; the client's id of
    the request at index i is ``acc-{i:05d}-{user}``."""
    events: list[tuple[float, Any]] = [(x["t"], x) for x in wl.lines]
    events += [(t, text) for t, text in wl.changes]
    events.sort(key=lambda e: e[0])
    return events


def client_id(i: int, user: str) -> str:
    return f"acc-{i:05d}-{user}"


def as_sent(wl: AccuracyWorkload, sent_s: dict[str, float]) -> AccuracyWorkload:
    """The workload as a replay sent it: each request at the moment the
    client sent it (``sent_s``: client id -> seconds from the start; a
    request missing there keeps its planned time), the limit changes at
    theirs."""
    lines = []
    for i, (t, event) in enumerate(replay_events(wl)):
        if isinstance(event, str):
            continue
        lines.append({**event, "t": round(sent_s.get(client_id(i, event["user"]), t), 6)})
    return AccuracyWorkload(wl.name, sorted(lines, key=lambda x: x["t"]), wl.limits,
                            list(wl.changes), wl.duration_s)


def write_workload(wl: AccuracyWorkload, work: Path) -> tuple[Path, Path]:
    """The twin's files: the workload (JSON Lines, its limit changes as
    ``limits_file`` lines) and the limits file at the start."""
    work.mkdir(parents=True, exist_ok=True)
    limits = work / "limits.yaml"
    limits.write_text(wl.limits)
    events: list[dict[str, Any]] = list(wl.lines)
    for i, (t, text) in enumerate(wl.changes):
        name = f"limits-{i + 1}.yaml"
        (work / name).write_text(text)
        events.append({"t": t, "limits_file": name})
    events.sort(key=lambda x: x["t"])
    path = work / "workload.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path, limits


# --------------------------------------------------------------------------- figures


def _quantiles(values_ns: list[int]) -> dict[str, float | None]:
    from vllm_output_rate.tools.twin_report import QUANTILES, quantile

    return {name: (round(quantile(values_ns, q) / NS, 6) if values_ns else None)
            for name, q in QUANTILES}


def figures_from_log(log: Any, arrivals: dict[str, tuple[str, int]], end_ns: int | None = None,
                     ) -> dict[str, dict[str, Any]]:
    """Per user, the twin's ``summary.json`` figures of a run from its
    engine event log: ``arrivals`` maps a client request id (found inside
    the engine's id, as vLLM wraps it) to (user, arrival ns on the log's
    clock). Requests of the log not in ``arrivals`` (a warm-up) are left
    out; tokens after ``end_ns`` (the cut) too."""
    from vllm_output_rate.tools.twin_calibrate import _matcher

    index = {rid: i for i, rid in enumerate(arrivals)}
    ids = list(arrivals)
    match = _matcher(index)
    users: dict[str, dict[str, Any]] = defaultdict(lambda: {
        "requests": 0, "finished": 0, "tokens": 0, "first_ns": None, "first_n": 0,
        "last_ns": 0, "ttft": [], "itl": []})
    for user, _ in arrivals.values():
        users[user]["requests"] += 1
    last: dict[str, int] = {}
    for t, tokens in log.steps:
        if end_ns is not None and t > end_ns:
            break
        for rid, _user, k in tokens:
            i = match(rid)
            if i is None or not k:
                continue
            cid = ids[i]
            user, arrival = arrivals[cid]
            u = users[user]
            if cid not in last:
                u["ttft"].append(t - arrival)
            else:
                u["itl"].append(t - last[cid])
            if k > 1:
                u["itl"].extend([0] * (k - 1))
            last[cid] = t
            u["tokens"] += k
            if u["first_ns"] is None:
                u["first_ns"] = t
            if t == u["first_ns"]:
                u["first_n"] += k
            u["last_ns"] = t
    for rid, ev in log.finished.items():
        i = match(rid)
        if i is not None and (end_ns is None or ev["t_ns"] <= end_ns) \
                and ev.get("reason") != "abort":
            users[arrivals[ids[i]][0]]["finished"] += 1
    unstarted: dict[str, int] = defaultdict(int)
    for cid, (user, _) in arrivals.items():
        if cid not in last:
            unstarted[user] += 1
    out = {}
    for user in sorted(users):
        u = users[user]
        span = u["last_ns"] - (u["first_ns"] or 0)
        rate = ((u["tokens"] - u["first_n"]) / (span / NS)
                if u["first_ns"] is not None and span else None)
        out[user] = {"requests": u["requests"], "finished": u["finished"],
                     "unstarted": unstarted.get(user, 0), "output_tokens": u["tokens"],
                     "rate_tok_s": None if rate is None else round(rate, 4),
                     "ttft_s": _quantiles(u["ttft"]), "itl_s": _quantiles(u["itl"])}
    return out


def figure(user: dict[str, Any], key: str, q: str | None) -> float | None:
    value = user.get(key)
    return value if q is None else (value or {}).get(q)


def goal_of(name: str, unlimited: bool) -> float:
    if name == "rate":
        return GOALS["rate unlimited" if unlimited else "rate limited"]
    return GOALS[name.split()[-1]]


def compare(real_runs: list[dict[str, dict[str, Any]]],
            twin_runs: list[dict[str, dict[str, Any]]] | dict[str, dict[str, Any]],
            unlimited: set[str]) -> list[dict[str, Any]]:
    """One row per user and figure: the real runs' values, their median,
    the real runs' own spread (each against the median of the others, the
    largest relative difference), the twin's runs' values and their median
    (``twin_runs``: each run's users, or one run's), its error against the
    real median (relative and absolute), the goal and whether it is met,
    and whether the error is no larger than the real runs' own spread (the
    twin as far from the real median as a real run is from the others')."""
    if isinstance(twin_runs, dict):
        twin_runs = [twin_runs]
    rows = []
    users = sorted({u for run in twin_runs for u in run} | {u for run in real_runs for u in run})
    for user in users:
        for name, key, q in FIGURES:
            values = [figure(run.get(user, {}), key, q) for run in real_runs]
            values = [v for v in values if v is not None]
            tvs = [figure(run.get(user, {}), key, q) for run in twin_runs]
            tvs = [v for v in tvs if v is not None]
            tv = statistics.median(tvs) if tvs else None
            row: dict[str, Any] = {"user": user, "figure": name, "real": values, "twin": tv,
                                   "twin_runs": tvs,
                                   "median": statistics.median(values) if values else None}
            spread = []
            for i, v in enumerate(values):
                others = values[:i] + values[i + 1:]
                if others:
                    m = statistics.median(others)
                    if m:
                        spread.append(abs(v - m) / m)
            row["real_spread"] = max(spread) if spread else None
            med = row["median"]
            goal = goal_of(name, user in unlimited)
            row["goal"] = goal
            if tv is None or not med:
                row.update(error=None, abs_error_s=None, met=None, within_spread=None)
            else:
                row["error"] = (tv - med) / med
                row["abs_error_s"] = None if name == "rate" else abs(tv - med)
                row["met"] = abs(row["error"]) <= goal or (
                    name != "rate" and abs(tv - med) <= ABS_S)
                row["within_spread"] = (row["real_spread"] is not None
                                        and abs(row["error"]) <= row["real_spread"])
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- the real engine


def kv_tokens_of(log_text: str) -> int | None:
    """The KV cache's size in tokens, from vLLM's start-up log line."""
    m = re.search(r"KV cache size: ([\d,]+) tokens", log_text)
    return int(m.group(1).replace(",", "")) if m else None


async def replay(wl: AccuracyWorkload, server: Any, limits_path: Path, vocab: int, seed: int,
                 ) -> tuple[dict[str, tuple[str, int]], int, int, list[str]]:
    """Warm the engine up, then send every request at its time (and write
    each limit change, with SIGHUP); cut ``GRACE_S`` after the arrivals.
    Returns the arrivals (client id -> user, monotonic ns sent), the
    workload's start and its cut (monotonic ns) and the errors."""
    import httpx

    from vllm_output_rate.tools.fairness_engine import Record, _one, prompt_ids

    rng = random.Random(seed)
    url = f"{server.base_url}/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    def body(user: str, prompt: int, max_tokens: int) -> dict[str, Any]:
        return {"model": "tiny", "prompt": prompt_ids(rng, prompt, vocab),
                "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "vllm_xargs": {USER_FIELD: user}}

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        # warm-up: the CPU backend builds kernels for new batch shapes on
        # first sight; one request alone, then eight at once
        warm = [Record(WARMUP_USER, 0.0) for _ in range(9)]
        await _one(client, url, {}, body(WARMUP_USER, 64, 16), {}, warm[0])
        await asyncio.gather(*(_one(client, url, {}, body(WARMUP_USER, 64, 32), {}, r)
                               for r in warm[1:]))
        arrivals: dict[str, tuple[str, int]] = {}
        records: list[Record] = []
        tasks = []
        events = replay_events(wl)
        start = time.monotonic_ns()
        for i, (t, event) in enumerate(events):
            await asyncio.sleep(max(0.0, (start + t * NS - time.monotonic_ns()) / NS))
            if isinstance(event, str):  # a live change: the file, then SIGHUP
                tmp = limits_path.with_suffix(".tmp")
                tmp.write_text(event)
                os.replace(tmp, limits_path)
                os.kill(server.proc.pid, signal.SIGHUP)
                continue
            cid = client_id(i, event["user"])
            rec = Record(event["user"], 0.0)
            records.append(rec)
            arrivals[cid] = (event["user"], time.monotonic_ns())
            tasks.append(asyncio.create_task(_one(
                client, url, event, body(event["user"], event["prompt_tokens"],
                                         event["max_tokens"]),
                {"X-Request-Id": cid}, rec)))
        cut = start + round((wl.duration_s + GRACE_S) * NS)
        await asyncio.sleep(max(0.0, (cut - time.monotonic_ns()) / NS))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    errors = [r.error for r in warm + records if r.error]
    return arrivals, start, cut, errors


def real_run(wl: AccuracyWorkload, work: Path, model: str, vocab: int, seed: int,
             extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """One replay on a fresh engine: its figures (``figures_from_log``),
    the engine's facts (async scheduling, KV cache tokens) and errors."""
    from vllm_output_rate.telemetry.events import EngineLog
    from vllm_output_rate.tools.common.client import Server

    work.mkdir(parents=True, exist_ok=True)
    limits = work / "limits.yaml"
    limits.write_text(wl.limits)
    events = work / "events.jsonl"
    events.unlink(missing_ok=True)
    env = {"OUTPUT_RATE_EVENTS": str(events), **(extra_env or {})}
    with Server(model, [*SERVE_ARGS, "--output-rate-limits-file", str(limits)],
                work / "engine.log", extra_env=env) as server:
        arrivals, start_ns, cut, errors = asyncio.run(replay(wl, server, limits, vocab, seed))
        time.sleep(2.5)  # the engine appends its log about once a second
    (work / "arrivals.json").write_text(json.dumps(
        {"start_ns": start_ns, "cut_ns": cut,
         "requests": {cid: [user, t - start_ns] for cid, (user, t) in arrivals.items()}}))
    log = EngineLog.read(events)
    start = log.starts[0] if log.starts else {}
    return {"figures": figures_from_log(log, arrivals, cut), "errors": errors,
            "sent_s": {cid: (t - start_ns) / NS for cid, (_, t) in arrivals.items()},
            "async_scheduling": bool(start.get("async_scheduling")),
            "kv_tokens": kv_tokens_of((work / "engine.log").read_text(errors="replace")),
            "limit_changes": [(e["t_ns"] - start_ns) / NS for e in log.limit_changes]}


def fit_calibration(cal: Path, note: str, work: Path) -> dict[str, Any]:
    """The step time fitted on the calibration log in ``cal`` (its
    ``events.jsonl`` and ``step_time.prompts.jsonl``, after the warm-up),
    ``note`` added to its note, written to ``work/step_time.json``."""
    from vllm_output_rate.telemetry.events import EngineLog
    from vllm_output_rate.tools.twin_calibrate import calibrate_from_log, warmup_end_ns

    events, prompts = cal / "events.jsonl", cal / "step_time.prompts.jsonl"
    since = warmup_end_ns(EngineLog.read(events), str(prompts))
    model_json = calibrate_from_log(str(events), str(prompts), since)
    model_json["note"] += note
    work.mkdir(parents=True, exist_ok=True)
    (work / "step_time.json").write_text(json.dumps(model_json, indent=1) + "\n")
    return model_json


def calibrate(work: Path, model: str, seconds: float) -> dict[str, Any]:
    """``twin calibrate``'s load against a fresh engine, fitted."""
    from vllm_output_rate.tools.common.client import Server
    from vllm_output_rate.tools.twin_calibrate import run_calibration_load

    work.mkdir(parents=True, exist_ok=True)
    events = work / "events.jsonl"
    events.unlink(missing_ok=True)
    prompts = work / "step_time.prompts.jsonl"
    with Server(model, [*SERVE_ARGS, "--output-rate-default-tokens-per-second", str(UNLIMITED)],
                work / "engine.log", extra_env={"OUTPUT_RATE_EVENTS": str(events)}) as server:
        # the replays' kind of request: completions of token ids
        load = run_calibration_load(server.base_url, "tiny", prompts, seconds,
                                    show_progress=False, api="completions")
        time.sleep(2.5)
    return fit_calibration(
        work, f"; calibration load {load['requests']} requests, {load['errors']} errors", work)


def refit(earlier: Path, work: Path) -> dict[str, Any]:
    """The step time fitted again on an earlier run's calibration log."""
    return fit_calibration(earlier / "calibration",
                           f"; fitted again on {earlier.name}'s calibration log", work)


def earlier_runs(earlier: Path, name: str) -> list[dict[str, Any]]:
    """An earlier run's real runs of workload ``name`` (their figures and
    facts), each with its send times (from its ``arrivals.json`` when the
    earlier ``accuracy.json`` predates them)."""
    doc = json.loads((earlier / "accuracy.json").read_text())
    if name not in doc["workloads"]:
        raise SystemExit(f"--real-from {earlier}: no real runs of {name!r} there")
    runs = doc["workloads"][name]["real"]
    for k, run in enumerate(runs):
        if "sent_s" not in run:
            arr = json.loads((earlier / name / f"real-{k + 1}" / "arrivals.json").read_text())
            run["sent_s"] = {cid: off / NS for cid, (_, off) in arr["requests"].items()}
    return runs


def twin_run(twin_cls: Any, wl: AccuracyWorkload, work: Path, model: str, step_time: Path,
             is_async: bool, kv_tokens: int | None, seed: int) -> dict[str, Any]:
    """The twin (``twin_cls``: ``tools.twin.Twin``, given by its caller)
    on the workload with the real engine's options, cut where the real
    runs were."""
    Twin = twin_cls
    workload, limits = write_workload(wl, work)
    argv = ["--workload", str(workload), "--out", str(work / "twin"), "--model", model,
            "--step-time", str(step_time), "--no-plots", "--seed", str(seed),
            "--until", str(wl.duration_s + GRACE_S), *SERVE_ARGS,
            "--output-rate-limits-file", str(limits)]
    if is_async:
        argv.append("--async-scheduling")
    twin = Twin(argv)
    if kv_tokens:  # the real engine's KV cache, in the twin's blocks
        twin = Twin(argv + ["--num-gpu-blocks-override", str(kv_tokens // twin.block_size)])
    return twin.run()


# --------------------------------------------------------------------------- report


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _val(x: float | None, name: str) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if name == "rate" else f"{1000 * x:.1f}"


def overview(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per figure (the rate split into limited and unlimited users), over
    every workload and user: the twin's median and largest |error|, the
    real runs' median and largest own spread, the goals met, and the figures
    within the goal or the real runs' own spread."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for wl in result["workloads"].values():
        unlimited = set(wl.get("unlimited", ["open"]))
        for row in wl["rows"]:
            if row["met"] is None:
                continue
            name = row["figure"]
            if name == "rate":
                name = "rate, unlimited" if row["user"] in unlimited else "rate, limited"
            groups[name].append(row)
    out = []
    for name in ("rate, limited", "rate, unlimited", *(f for f, _, _ in FIGURES[1:])):
        rows = groups.get(name)
        if not rows:
            continue
        errors = sorted(abs(r["error"]) for r in rows)
        spread = sorted(r["real_spread"] for r in rows if r["real_spread"] is not None)
        out.append({"figure": name, "n": len(rows), "met": sum(bool(r["met"]) for r in rows),
                    "met_or_within_spread": sum(bool(r["met"] or r.get("within_spread"))
                                                for r in rows),
                    "error_median": statistics.median(errors), "error_max": errors[-1],
                    "spread_median": statistics.median(spread) if spread else None,
                    "spread_max": spread[-1] if spread else None,
                    "goal": rows[0]["goal"]})
    return out


def render(result: dict[str, Any]) -> str:
    lines = [f"Step time: {result['step_time'].get('note', '')}", "",
             "| figure | users x workloads | goal met | goal met or within the real spread "
             "| twin's \\|error\\| median | largest "
             "| real runs' own spread median | largest | goal |",
             "|---|---|---|---|---|---|---|---|---|"]
    for o in overview(result):
        lines.append(f"| {o['figure']} | {o['n']} | {o['met']} | {o['met_or_within_spread']} "
                     f"| {100 * o['error_median']:.1f}% "
                     f"| {100 * o['error_max']:.1f}% | {_pct(o['spread_median']).lstrip('+')} "
                     f"| {_pct(o['spread_max']).lstrip('+')} | {100 * o['goal']:.0f}% |")
    lines.append("")
    met = total = near = 0
    for name, wl in result["workloads"].items():
        lines += [f"### {name}", "",
                  f"{wl['replays']} real runs (errors: {wl['errors']}), the twin on each "
                  f"one's arrivals; rate in tok/s, times in ms; error: the twin's median "
                  f"against the real median; real spread: the largest difference of a real run "
                  f"from the median of the others.", "",
                  "| user | figure | real median | real runs | real spread | twin median "
                  "| twin runs | error | goal | met |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in wl["rows"]:
            if row["median"] is None and row["twin"] is None:
                continue
            runs = ", ".join(_val(v, row["figure"]) for v in row["real"])
            ok = {True: "yes", False: "**no**", None: "-"}[row["met"]]
            if row["met"] is False and row.get("within_spread"):
                ok += " (within the real spread)"
            if row["met"] is not None:
                total += 1
                met += bool(row["met"])
                near += bool(row["met"] or row.get("within_spread"))
            twins = ", ".join(_val(v, row["figure"]) for v in row.get("twin_runs", ()))
            lines.append(f"| {row['user']} | {row['figure']} | {_val(row['median'], row['figure'])} "
                         f"| {runs} | {_pct(row['real_spread'])} | {_val(row['twin'], row['figure'])} "
                         f"| {twins} | {_pct(row['error'])} | {100 * row['goal']:.0f}% | {ok} |")
        lines.append("")
    lines.insert(1, f"Goals met: {met} of {total} figures (a time figure also passes within "
                    f"{1000 * ABS_S:.0f} ms); within the goal or the real runs' own spread "
                    f"(the twin's error no larger than the largest difference of a real run "
                    f"from the others' median): {near} of {total}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str], twin_cls: Any) -> int:
    """``vllm-output-rate twin accuracy`` (``tools.twin`` calls it with its
    ``Twin``: this module does not import that one, which imports it)."""
    parser = argparse.ArgumentParser(
        prog="vllm-output-rate twin accuracy",
        description="Replay workloads on fresh real engines and in the twin (calibrated on the "
                    "same engine) and compare per user: rate, TTFT and spacing.")
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default=None, help="a local model directory (default: the "
                        "generated tiny model)")
    parser.add_argument("--replays", type=int, default=3, help="real runs of each workload")
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS),
                        help="a workload (repeatable; default: all)")
    parser.add_argument("--calibration-s", type=float, default=60.0,
                        help="seconds of calibration load")
    parser.add_argument("--step-time", default=None,
                        help="a step-time file to use instead of calibrating")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--real-from", default=None, metavar="DIR",
                        help="the real runs and calibration log of an earlier --out: run only "
                        "the twin against them (its step time fitted again on that log unless "
                        "--step-time)")
    args = parser.parse_args(argv)
    from vllm_output_rate.tools.fairness_engine import model_vocab
    from vllm_output_rate.tools.common.tiny_model import ensure_tiny_model

    model = args.model or str(ensure_tiny_model())
    vocab = model_vocab(model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    earlier = Path(args.real_from) if args.real_from else None
    if args.step_time:
        step_path = Path(args.step_time)
        step = json.loads(step_path.read_text())
    elif earlier is not None:
        step = refit(earlier, out / "calibration")
        step_path = out / "calibration" / "step_time.json"
        print(f"  {step['note']}", flush=True)
    else:
        print(f"calibrating ({args.calibration_s:.0f} s of load) ...", flush=True)
        step = calibrate(out / "calibration", model, args.calibration_s)
        step_path = out / "calibration" / "step_time.json"
        print(f"  {step['note']}", flush=True)
    result: dict[str, Any] = {"model": Path(model).name, "serve_args": SERVE_ARGS,
                              "step_time": step, "workloads": {},
                              "real_from": str(earlier) if earlier is not None else None}
    for name in args.workload or list(WORKLOADS):
        wl = WORKLOADS[name](args.seed, args.duration)
        if earlier is not None:
            runs = earlier_runs(earlier, name)
        else:
            runs = []
            for k in range(args.replays):
                print(f"{name}: real run {k + 1} of {args.replays} ...", flush=True)
                runs.append(real_run(wl, out / name / f"real-{k + 1}", model, vocab,
                                     args.seed + k))
        print(f"{name}: the twin on each replay's arrivals ...", flush=True)
        twins = [twin_run(twin_cls, as_sent(wl, run["sent_s"]), out / name / f"twin-{k + 1}",
                          model, step_path, runs[0]["async_scheduling"], runs[0]["kv_tokens"],
                          args.seed + k)
                 for k, run in enumerate(runs)]
        rows = compare([r["figures"] for r in runs], [t["users"] for t in twins],
                       wl.unlimited_users())
        result["workloads"][name] = {
            "replays": len(runs), "errors": sum(len(r["errors"]) for r in runs),
            "first_error": next((e for r in runs for e in r["errors"]), None),
            "real": runs, "twin": [t["users"] for t in twins],
            "twin_run": twins[0]["run"], "rows": rows,
            "unlimited": sorted(wl.unlimited_users())}
        (out / "accuracy.json").write_text(json.dumps(result, indent=1) + "\n")
    result["wall_s"] = round(time.monotonic() - began, 1)
    (out / "accuracy.json").write_text(json.dumps(result, indent=1) + "\n")
    text = render(result)
    (out / "accuracy.md").write_text(text)
    print(text)
    print(f"{result['wall_s']:.0f} s; {out / 'accuracy.md'}")
    return 0

