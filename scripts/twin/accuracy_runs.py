"""The runs of ``twin accuracy`` (``twin.accuracy``): the workloads it
replays, each replay on a fresh real engine (the engine's figures read
from its event log as the twin computes its own: ``figures_from_log``), the
step-time calibration on that engine, and the twin on each replay's own
arrivals with the same options (``SERVE_ARGS``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_output_rate.tools.twin.workload import _poisson, _request

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
#: (``tools.twin.workload``'s generators')
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
    from vllm_output_rate.tools.twin.report import QUANTILES, quantile

    return {name: (round(quantile(values_ns, q) / NS, 6) if values_ns else None)
            for name, q in QUANTILES}


def figures_from_log(log: Any, arrivals: dict[str, tuple[str, int]], end_ns: int | None = None,
                     ) -> dict[str, dict[str, Any]]:
    """Per user, the twin's ``summary.json`` figures of a run from its
    engine event log: ``arrivals`` maps a client request id (found inside
    the engine's id, as vLLM wraps it) to (user, arrival ns on the log's
    clock). Requests of the log not in ``arrivals`` (a warm-up) are left
    out; tokens after ``end_ns`` (the cut) too."""
    from vllm_output_rate.tools.twin.calibrate import _matcher

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

    from vllm_output_rate.tools.fairness.engine import Record, _one, prompt_ids

    rng = random.Random(seed)
    url = f"{server.base_url}/v1/completions"
    from vllm_output_rate.tools.common.client import http_limits

    limits = http_limits(None)

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
    from vllm_output_rate.tools.twin.calibrate import calibrate_from_log, warmup_end_ns

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
    from vllm_output_rate.tools.twin.calibration_load import run_calibration_load

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


def twin_run(wl: AccuracyWorkload, work: Path, model: str, step_time: Path,
             is_async: bool, kv_tokens: int | None, seed: int) -> dict[str, Any]:
    """The twin on the workload with the real engine's options (the same
    flags as ``serve``'s, ``SERVE_ARGS``), cut where the real runs were."""
    from vllm_output_rate.tools.twin.config import TwinConfig
    from vllm_output_rate.tools.twin.run import Twin

    workload, limits = write_workload(wl, work)
    argv = ["--workload", str(workload), "--out", str(work / "twin"), "--model", model,
            "--step-time", str(step_time), "--no-plots", "--seed", str(seed),
            "--until", str(wl.duration_s + GRACE_S), *SERVE_ARGS,
            "--output-rate-limits-file", str(limits)]
    if is_async:
        argv.append("--async-scheduling")
    twin = Twin(TwinConfig.from_argv(argv))
    if kv_tokens:  # the real engine's KV cache, in the twin's blocks
        blocks = str(kv_tokens // twin.block_size)
        twin = Twin(TwinConfig.from_argv(argv + ["--num-gpu-blocks-override", blocks]))
    return twin.run()

