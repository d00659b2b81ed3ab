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
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from vllm_output_rate.tools.twin.accuracy_runs import (
    SERVE_ARGS, WORKLOADS, as_sent, calibrate, earlier_runs, real_run, refit, twin_run)

#: the figures compared: (name in the table, summary key, quantile or None)
FIGURES = (("rate", "rate_tok_s", None),
           ("TTFT p50", "ttft_s", "p50"), ("TTFT p90", "ttft_s", "p90"),
           ("spacing p50", "itl_s", "p50"), ("spacing p90", "itl_s", "p90"))
#: issue 28's goals: relative error of a figure, and the absolute error
#: (seconds) that passes a small figure ("or 10 ms where smaller")
GOALS = {"rate limited": 0.02, "rate unlimited": 0.10, "p50": 0.10, "p90": 0.15}
ABS_S = 0.010


# --------------------------------------------------------------------------- figures


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


def main(argv: list[str]) -> int:
    """``vllm-output-rate twin accuracy``."""
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
    from vllm_output_rate.tools.fairness.engine import model_vocab
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
        twins = [twin_run(as_sent(wl, run["sent_s"]), out / name / f"twin-{k + 1}",
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

