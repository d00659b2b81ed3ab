"""The twin's step-time model from an engine's own per-step telemetry, or
a roofline estimate from a model's config and a named GPU.

``vllm-output-rate twin calibrate --events FILE [--prompts FILE] --out step_time.json``
fits the linear model of ``tools.twin.step_time`` to the engine event log a real
engine wrote (``OUTPUT_RATE_EVENTS``). With ``--url BASE_URL --model NAME
--events FILE`` it first drives a short, bounded calibration load against a
running ``vllm-output-rate serve`` that writes that log (concurrency from 1
up, prompts of several lengths; a progress bar), then fits.
``vllm-output-rate twin calibrate --model DIR --gpu h100 --out FILE`` writes
a roofline estimate instead (``"source": "estimate"``).

What the event log carries per step (``telemetry/events.py``): one
``tokens`` line per step that produced tokens, stamped when its output was
processed, with (engine request id, user, tokens) of each request that got
one. From it, per step: the time since the previous step's line (the step's
period, when the engine was busy in between: at least one request has a
token in both lines), the requests decoding (had a token before) and those
whose first token came in it (their prefill finished in it). It does not
carry prompt lengths, so neither prefill tokens nor context tokens: those
come from ``--prompts`` (JSON Lines ``{"request_id": id, "prompt_tokens":
N}``, the client's ids, found inside the engine's request ids; the online
calibration writes it beside the log). Without it only ``base_s`` and
``per_decode_s`` are fitted, on the steps without a first token. Steps with
a chunk of a prompt but no token of it are not seen.

The fit is least squares with every coefficient >= 0 (a term that comes
out negative is fixed at 0 and the rest refitted). Its error is reported
over the steps used: R², and the median and p90 of |predicted - measured| /
measured step time.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_output_rate.tools.twin.step_time import TERMS, VERSION, CalibrationError

NS = 1_000_000_000

# --------------------------------------------------------------------------- the fit


@dataclass
class StepSamples:
    """The steps a fit can use: per step its period (s) and the terms."""

    seconds: list[float]
    decodes: list[int]
    prefill_tokens: list[int]
    context_tokens: list[int]
    #: steps in the log, steps used, steps with a first token of a request
    #: whose prompt length is unknown (dropped), steps after an idle gap (dropped)
    counts: dict[str, int]
    prompts_known: bool


def read_prompts(path: str | None) -> tuple[dict[str, int], dict[str, int]]:
    """``--prompts``: client request id -> prompt tokens, and, for the
    lines that have it, client request id -> ``sent_ns`` (when the client
    sent it: the machine's monotonic clock, ns, the engine core's)."""
    if path is None:
        return {}, {}
    prompts, sent = {}, {}
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                rid = str(obj["request_id"])
                prompts[rid] = int(obj["prompt_tokens"])
            except (ValueError, KeyError, TypeError) as exc:
                raise CalibrationError(f"{path}:{i}: expected {{\"request_id\": ..., "
                                       f"\"prompt_tokens\": N}} ({exc})") from None
            if "sent_ns" in obj:
                if isinstance(obj["sent_ns"], bool) or not isinstance(obj["sent_ns"], int):
                    raise CalibrationError(f"{path}:{i}: sent_ns: expected an integer "
                                           f"(ns), got {obj['sent_ns']!r}")
                sent[rid] = obj["sent_ns"]
    return prompts, sent


#: the request path's spread in the model: p0, p1, ..., p100 (a draw between
#: two neighbours; coarser steps gave the largest path, one stall among a
#: hundred requests, a twentieth of the draws)
PATH_QUANTILES = 100


def request_path_fit(log: Any, sent: dict[str, int], prompts: dict[str, int],
                     terms: dict[str, float], since_ns: int = 0) -> dict[str, Any] | None:
    """The request path: from a request's send to the scheduler seeing it.
    Measured on the requests sent to an idle engine (no step ended between
    the send and the step of the request's first token): the log's
    ``queued`` line of the request minus the send (an older log without
    ``queued`` lines: the first token's time, minus that step's time by the
    fitted model, minus the send; that step began when the request reached
    the scheduler). The median is the model's ``request_path_s``, the
    quantiles p0, p1, ..., p100 its ``request_path_quantiles_s``; None with
    fewer than 8 such requests."""
    import bisect

    if not sent:
        return None
    match_sent = _matcher(sent)
    prompt_of = _matcher(prompts)
    stamps = [t for t, _ in log.steps]
    queued_of = {rid: t for rid, (t, _) in getattr(log, "queued", {}).items()}
    seen: set[str] = set()
    values = []
    by_queued = 0
    for i, (t, tokens) in enumerate(log.steps):
        decodes = prefill = 0
        firsts = []
        for rid, _, _ in tokens:
            if rid in seen:
                decodes += 1
                continue
            seen.add(rid)
            s_ns = match_sent(rid)
            if s_ns is None:
                continue
            prefill += prompt_of(rid) or 0
            firsts.append((rid, s_ns))
        if not firsts or t < since_ns:
            continue
        step_ns = 1e9 * (terms["base_s"] + terms["per_decode_s"] * decodes
                         + terms["per_prefill_token_s"] * prefill)
        for rid, s_ns in firsts:
            before = bisect.bisect_left(stamps, t) - 1  # the step before this one
            if before >= 0 and stamps[before] >= s_ns:
                continue  # the engine was busy when the request came
            queued = queued_of.get(rid)
            by_queued += queued is not None
            values.append(((queued - s_ns) if queued is not None else (t - step_ns - s_ns)) / NS)
    if len(values) < 8:
        return None
    values.sort()
    from vllm_output_rate.tools.common.stats import quantile

    return {"requests": len(values), "p10_s": round(quantile(values, 0.1), 6),
            "p50_s": round(quantile(values, 0.5), 6), "p90_s": round(quantile(values, 0.9), 6),
            "from_queued_lines": by_queued,
            "quantiles_s": [round(max(0.0, quantile(values, q / PATH_QUANTILES)), 6)
                            for q in range(PATH_QUANTILES + 1)]}


def _matcher(prompts: dict[str, int]):
    """engine request id -> prompt tokens or None: the id itself, or the
    longest client id inside it (vLLM wraps the client's X-Request-Id)."""
    if not prompts:
        return lambda rid: None
    pattern = re.compile("|".join(re.escape(k) for k in sorted(prompts, key=len, reverse=True)))
    cache: dict[str, int | None] = {}

    def prompt_of(rid: str) -> int | None:
        if rid in prompts:
            return prompts[rid]
        if rid not in cache:
            m = pattern.search(rid)
            cache[rid] = prompts[m.group(0)] if m else None
        return cache[rid]

    return prompt_of


def step_samples(log: Any, prompts: dict[str, int] | None = None,
                 since_ns: int = 0) -> StepSamples:
    """The fit's samples from an ``EngineLog``: step k's period is the time
    from step k-1's line to step k's, used when a request had a token in
    both (the engine ran between them)."""
    prompt_of = _matcher(prompts or {})
    known = bool(prompts)
    # a request's tokens before the log's first line of it (a log that
    # starts or was cut mid-run): its finished line's count minus the log's
    counted: dict[str, int] = {}
    for _, tokens in log.steps:
        for rid, _, n in tokens:
            counted[rid] = counted.get(rid, 0) + n
    seen: dict[str, int] = {}  # request id -> output tokens before this step
    for rid, fin in log.finished.items():
        missing = int(fin.get("output_tokens", 0)) - counted.get(rid, 0)
        if missing > 0:
            seen[rid] = missing
    # a start line begins another engine's lines: no step period across it
    starts = sorted(int(s["t_ns"]) for s in log.starts)
    samples = StepSamples([], [], [], [], {"steps": len(log.steps), "used": 0,
                                          "unknown_prompt": 0, "after_gap": 0,
                                          "before_since": 0}, known)
    prev_ids: set[str] = set()
    prev_t: int | None = None
    for t, tokens in log.steps:
        if prev_t is not None and _start_between(starts, prev_t, t):
            prev_t, prev_ids = None, set()
        ids = {rid for rid, _, _ in tokens}
        decodes = prefill = context = 0
        unknown = False
        for rid, _, n in tokens:
            before = seen.get(rid)
            prompt = prompt_of(rid)
            if before is None:
                if prompt is None:
                    unknown = True
                else:
                    prefill += prompt
                    context += prompt
            else:
                decodes += 1
                if prompt is not None:
                    context += prompt + before
                elif known:
                    unknown = True
            seen[rid] = (before or 0) + n
        usable = prev_t is not None and bool(ids & prev_ids)
        if t < since_ns:
            samples.counts["before_since"] += 1
        elif not usable:
            samples.counts["after_gap"] += 1
        elif unknown:
            samples.counts["unknown_prompt"] += 1
        else:
            samples.seconds.append((t - prev_t) / NS)
            samples.decodes.append(decodes)
            samples.prefill_tokens.append(prefill)
            samples.context_tokens.append(context)
            samples.counts["used"] += 1
        prev_ids, prev_t = ids, t
    return samples


def _start_between(starts: list[int], lo: int, hi: int) -> bool:
    import bisect

    i = bisect.bisect_right(starts, lo)
    return i < len(starts) and starts[i] <= hi


def fit_linear(samples: StepSamples) -> dict[str, Any]:
    """Least squares of the step period on the terms, coefficients >= 0;
    the coefficients (``TERMS``), the terms fitted and the fit's error."""
    import numpy as np

    y = np.asarray(samples.seconds, dtype=float)
    if len(y) < 8:
        raise CalibrationError(f"{len(y)} usable steps in the log: too few to fit "
                               f"(steps: {samples.counts})")
    columns = {"base_s": np.ones_like(y), "per_decode_s": np.asarray(samples.decodes, float)}
    if samples.prompts_known:
        columns["per_prefill_token_s"] = np.asarray(samples.prefill_tokens, float)
        columns["per_context_token_s"] = np.asarray(samples.context_tokens, float)
    # a term that never varies (but the base) cannot be told from the base
    names = [n for n, c in columns.items() if n == "base_s" or np.ptp(c) > 0]
    dropped = []
    while True:
        x = np.column_stack([columns[n] for n in names])
        # scaled columns: the terms differ by orders of magnitude
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
        coef = np.linalg.lstsq(x / scale, y, rcond=None)[0] / scale
        negative = [(c, n) for c, n in zip(coef, names) if c < 0]
        if not negative:
            break
        worst = min(negative)[1]
        names.remove(worst)
        dropped.append(worst)
        if not names:
            raise CalibrationError("no term of the model fits the log with a coefficient >= 0")
    pred = x @ coef
    resid = y - pred
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / total if total > 0 else float("nan")
    rel = np.abs(resid) / y
    terms = {n: 0.0 for n in TERMS}
    terms.update({n: float(c) for n, c in zip(names, coef)})
    return {
        "terms": terms,
        "fit": {
            "steps": len(y),
            "r2": round(r2, 4),
            "median_rel_error": round(float(np.median(rel)), 4),
            "p90_rel_error": round(float(np.quantile(rel, 0.9)), 4),
            "median_step_s": round(float(np.median(y)), 6),
            "fitted": names,
            "fixed_at_zero": dropped,
            "not_in_log": [] if samples.prompts_known else
            ["per_prefill_token_s", "per_context_token_s"],
            "step_counts": samples.counts,
        },
    }


def calibrate_from_log(events: str, prompts_path: str | None = None,
                       since_ns: int = 0) -> dict[str, Any]:
    """The step-time JSON (``"source": "measured"``) with a ``fit`` object."""
    from vllm_output_rate.telemetry.events import EngineLog

    try:
        log = EngineLog.read(events)
    except OSError as exc:
        raise CalibrationError(f"{events}: cannot read it ({exc.strerror or exc})") from None
    if not log.steps:
        raise CalibrationError(f"{events}: no tokens lines (is it an engine event log?)")
    prompts, sent = read_prompts(prompts_path)
    result = fit_linear(step_samples(log, prompts, since_ns))
    async_note = ""
    if log.starts and log.starts[0].get("async_scheduling"):
        async_note = "; the engine scheduled asynchronously (a step's period overlaps the next)"
    fit = result["fit"]
    path = request_path_fit(log, sent, prompts, result["terms"], since_ns)
    fit["request_path"] = path
    path_terms = ({"request_path_s": max(0.0, path["p50_s"]),
                   "request_path_quantiles_s": path["quantiles_s"]} if path else {})
    note = (f"fitted on {fit['steps']} steps of {Path(events).name}: R² {fit['r2']}, "
            f"median relative error {fit['median_rel_error']}" + async_note
            + ("" if prompts else "; no prompt lengths: prefill and context terms not fitted")
            + (f"; request path {1000 * path['p50_s']:.1f} ms (median of {path['requests']} "
               f"requests sent to an idle engine)" if path else ""))
    return {"version": VERSION, "kind": "linear", **result["terms"], **path_terms,
            "source": "measured",
            "note": note, "fit": fit}


def warmup_end_ns(log: Any, prompts_path: str) -> int:
    """The first step with a token of a request after the warm-up phase
    (the CPU backend builds kernels for new batch shapes during it)."""
    warm = set()
    with open(prompts_path) as f:
        for line in f:
            if line.strip():
                obj = json.loads(line)
                if obj.get("phase") == "warmup":
                    warm.add(obj["request_id"])
    prompt_of = _matcher({rid: 0 for rid in warm})
    for t, tokens in log.steps:
        if any(prompt_of(rid) is None for rid, _, _ in tokens):
            return t
    return 0


# --------------------------------------------------------------------------- the command


def _print_fit(model: dict[str, Any], out: str) -> None:
    fit = model.get("fit")
    terms = ", ".join(f"{n} {model[n]:.4g}" for n in TERMS)
    print(f"{out}: {model['source']} step-time model: {terms}")
    if fit:
        print(f"fit on {fit['steps']} steps (median {fit['median_step_s'] * 1e3:.2f} ms): "
              f"R² {fit['r2']}, relative error median {fit['median_rel_error']:.1%}, "
              f"p90 {fit['p90_rel_error']:.1%}; fitted {', '.join(fit['fitted'])}"
              + (f"; fixed at 0: {', '.join(fit['fixed_at_zero'])}" if fit['fixed_at_zero'] else "")
              + (f"; not in the log: {', '.join(fit['not_in_log'])}" if fit['not_in_log'] else ""))
        path = fit.get("request_path")
        if path:
            print(f"request path (send to scheduler, {path['requests']} requests sent to an idle "
                  f"engine): p10 {path['p10_s'] * 1e3:.1f} ms, p50 {path['p50_s'] * 1e3:.1f} ms "
                  f"(request_path_s), p90 {path['p90_s'] * 1e3:.1f} ms")


def main(argv: list[str]) -> int:
    from vllm_output_rate.tools.twin.calibration_load import APIS, run_calibration_load
    from vllm_output_rate.tools.twin.roofline import GPUS, roofline_estimate

    parser = argparse.ArgumentParser(
        prog="vllm-output-rate twin calibrate",
        description="Fit the twin's step-time model from an engine's event log (optionally "
                    "driving a calibration load first), or estimate one from a model's "
                    "config and a GPU.")
    parser.add_argument("--out", required=True, help="the step-time file to write (JSON)")
    parser.add_argument("--events", help="the engine event log (OUTPUT_RATE_EVENTS of the server)")
    parser.add_argument("--prompts", help="JSON Lines of request_id and prompt_tokens "
                        "(default with --url: written beside --out)")
    parser.add_argument("--url", help="a running vllm-output-rate serve: drive a calibration "
                        "load against it first")
    parser.add_argument("--model", help="with --url: the served model name; with --gpu: a "
                        "model directory (its config.json)")
    parser.add_argument("--gpu", help=f"a roofline estimate for this GPU ({', '.join(GPUS)})")
    parser.add_argument("--duration", type=float, default=120.0,
                        help="with --url: the calibration load's bound in seconds (at most 300)")
    parser.add_argument("--since-s", type=float, default=None,
                        help="fit only steps this many seconds after the log's first step")
    parser.add_argument("--api", choices=APIS, default="chat",
                        help="with --url: the load's requests, chat completions of text "
                        "(default) or completions of token ids: the API your traffic uses (the "
                        "request path measured differs)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.gpu:
            if not args.model:
                parser.error("--gpu needs --model DIR (its config.json)")
            model = roofline_estimate(args.model, args.gpu)
        else:
            if not args.events:
                parser.error("give --events FILE (with --url to drive a load first), "
                             "or --model DIR --gpu NAME")
            prompts = args.prompts
            since_ns = 0
            if args.url:
                if not args.model:
                    parser.error("--url needs --model NAME (the served model name)")
                if not 0 < args.duration <= 300:
                    parser.error("--duration: expected 0 < seconds <= 300")
                prompts = prompts or str(Path(args.out).with_suffix(".prompts.jsonl"))
                load = run_calibration_load(args.url.rstrip("/"), args.model, Path(prompts),
                                            args.duration, not args.no_progress, args.api)
                print(f"calibration load: {load['requests']} requests, {load['errors']} errors"
                      + (f" (first: {load['first_error']})" if load["errors"] else ""))
                import time

                time.sleep(2.5)  # the engine appends its log about once a second
            from vllm_output_rate.telemetry.events import EngineLog

            if prompts and args.url:
                since_ns = warmup_end_ns(EngineLog.read(args.events), prompts)
            if args.since_s is not None:
                log = EngineLog.read(args.events)
                if log.steps:
                    since_ns = max(since_ns, log.steps[0][0] + round(args.since_s * NS))
            model = calibrate_from_log(args.events, prompts, since_ns)
    except (CalibrationError, OSError) as exc:
        print(f"vllm-output-rate twin calibrate: error: {exc}", file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps(model, indent=1) + "\n")
    _print_fit(model, args.out)
    return 0
