"""The soak: mixed load against a real CPU engine for a long while.

``vllm-output-rate soak [--model DIR] [--minutes 30] [--sample-s 60] [--out DIR] [--no-progress]``
starts ``vllm-output-rate serve`` on the model (default: the tiny model,
generated locally) with per-user limits, telemetry and the engine's event
log, and keeps a mixed load on it until the time is up:

- limited users pacing at their limits (``soak-slow``: 5 tok/s over two
  streams; ``soak-mid``: 20 tok/s over three), and an unlimited user
  (``soak-free``, a limit far above what the engine serves) beside them;
- churn of new user ids (``churn-N``: one new id per ``--churn-s``, one short
  request each, at the default limit);
- cancels (a ``soak-mid`` stream closed after its first token, every 5 s);
- long prompts (a prompt of ``max_model_len - 64`` tokens of the model's own
  tokenizer for ``soak-slow`` every 10 s, through chunked prefill).

Every ``--sample-s`` it samples the engine core's and the API server's RSS
and the project's own state sizes (``vllm_output_rate_state_entries`` on
``/metrics``), a progress line on stderr each (``--no-progress``: none). At the end it waits for the engine to go quiet and checks:

- **conformance**: every limited user (the churn ids too) within the GCRA
  bound in every window of the whole run, engine-side from the event log
  with one engine step of slack (as ``verify``);
- **completion**: every request that completed has exactly the
  ``max_tokens`` it asked for (``ignore_eos``), and every kind of load
  ran; no HTTP error status, and at most 0.1% (at least one) of the
  requests ended by a transport error at the client (each one listed with
  when it was sent);
- **memory**: the engine core's RSS after warm-up (the first fifth of the
  run) as a slope (MiB per hour, least squares) and its growth from the
  first post-warm-up sample to the last (at most ``RSS_GROWTH_MIB``); state
  sizes bounded (per-request containers empty once quiet, the limiter's
  users and the per-user ones capped);
- **step time**: the engine's step-to-step time while busy (event log) in
  the first and the last tenth of the run: p50, p90, p99; the last p50 at
  most 1.5 times the first plus 5 ms (a loop that slows as state grows
  fails this).

``--feature-off`` runs the same load on a server without limits (vLLM as
upstream; the plugin installed does nothing): the control arm for the
memory slope, with the requests, quiet and RSS checks only.

Writes ``report.md`` and ``report.json`` to ``--out``; exits non-zero when
a check fails. ``make test`` runs a short variant (``tests/test_soak.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx

from vllm_output_rate.config import DEFAULT_OPTION, USERS_OPTION
from vllm_output_rate.tools.common.stats import quantile
from vllm_output_rate.tools.reliability.cases import model_and_logs, progress_line, write_report

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 1024
MAX_BATCHED_TOKENS = 256
DEFAULT_LIMIT = 50
#: (user, limit tok/s, concurrent streams, max_tokens per request)
PACED = (("soak-slow", 5, 2, 30), ("soak-mid", 20, 3, 60))
UNLIMITED = ("soak-free", 100_000, 1, 120)
CANCEL_EVERY_S = 5.0
LONG_PROMPT_EVERY_S = 10.0
CHURN_TOKENS = 8
#: the most the engine core's RSS may grow after warm-up
RSS_GROWTH_MIB = 64.0
#: state containers bounded by the label cap / users-state cap, and their bound
USER_STATE_BOUND = 2_000


@dataclass
class Request:
    kind: str
    user: str
    max_tokens: int
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    cancelled: bool = False
    #: when it was sent, seconds from the start of the load
    t_s: float = 0.0


@dataclass
class Sample:
    t_s: float
    engine_rss_mib: float
    api_rss_mib: float
    state: dict[str, float] = field(default_factory=dict)
    running: float = 0.0
    waiting: float = 0.0


@dataclass
class Check:
    name: str
    measured: str
    ok: bool


def server_args(feature_off: bool = False) -> list[str]:
    """The server's flags; ``feature_off``: the same without any limit (the
    plugin does nothing: vLLM as upstream), the control arm of a memory
    comparison."""
    args = ["--max-num-seqs", "32", "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]
    if feature_off:
        return args
    users = {u: limit for u, limit, _, _ in PACED}
    users[UNLIMITED[0]] = UNLIMITED[1]
    return args + [DEFAULT_OPTION, str(DEFAULT_LIMIT), USERS_OPTION, json.dumps(users)]


def limits() -> dict[str, Fraction]:
    out = {u: Fraction(limit) for u, limit, _, _ in PACED}
    out[UNLIMITED[0]] = Fraction(UNLIMITED[1])
    return out


# -- processes and samples ------------------------------------------------------


async def sample(client: httpx.AsyncClient, base_url: str, procs: tuple[Any, Any], t0: float) -> Sample:
    from vllm_output_rate.tools.common.client import rss_mib
    from vllm_output_rate.tools.reliability.cases import Live, state_entries

    api, engine = procs
    out = Sample(time.monotonic() - t0, rss_mib(engine), rss_mib(api))
    samples, _ = await Live(base_url, client).metrics()
    out.state = state_entries(samples)
    out.running = sum(v for (n, _), v in samples.items() if n == "vllm:num_requests_running")
    out.waiting = sum(v for (n, _), v in samples.items() if n == "vllm:num_requests_waiting")
    return out


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per hour (0 for
    fewer than two points or no spread in time)."""
    points = [(t, v) for t, v in points if v == v]  # (NaN: a process gone)
    if len(points) < 2 or len({t for t, _ in points}) < 2:
        return 0.0
    return statistics.linear_regression([t for t, _ in points], [v for _, v in points]).slope * 3600.0


def quantiles_ms(values_ns: list[int]) -> dict[str, float]:
    """Count, p50, p90, p99 and max (ms) of durations in ns (``stats.quantile``)."""
    if not values_ns:
        return {}
    ms = [v / 1e6 for v in values_ns]
    return {"n": len(ms), **{f"p{round(q * 100)}": quantile(ms, q) for q in (0.5, 0.9, 0.99)},
            "max": max(ms)}


def step_times(steps: list[int], lo: int, hi: int, busy_gap_ns: int = 500_000_000) -> list[int]:
    """Step-to-step times (ns) of the engine between ``lo`` and ``hi`` while
    busy (gaps longer than ``busy_gap_ns`` are idle time, not a step)."""
    ts = [t for t in steps if lo <= t <= hi]
    return [b - a for a, b in zip(ts, ts[1:]) if b - a <= busy_gap_ns]


# -- the load --------------------------------------------------------------------


class Load:
    def __init__(self, client: httpx.AsyncClient, base_url: str, deadline: float,
                 long_prompt: str, churn_s: float) -> None:
        self.client = client
        self.base_url = base_url
        self.deadline = deadline
        self.long_prompt = long_prompt
        self.churn_s = churn_s
        self.t0 = time.monotonic()
        self.requests: list[Request] = []

    async def one(self, kind: str, user: str, max_tokens: int, prompt: str = "Tell me a story.",
                  cancel: bool = False) -> None:
        from vllm_output_rate.tools.common.client import StreamResult, chat_body, stream_into

        req = Request(kind, user, max_tokens, t_s=time.monotonic() - self.t0)
        self.requests.append(req)
        rec = StreamResult(user, max_tokens, started=time.monotonic())
        try:
            req.cancelled = await stream_into(
                self.client, self.base_url, chat_body(MODEL_NAME, prompt, max_tokens, user), rec,
                cancel_after_tokens=1 if cancel else None)
        except Exception as exc:  # noqa: BLE001 - recorded
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        req.completion_tokens = rec.completion_tokens
        req.finish_reason = rec.finish_reason
        req.error = rec.error

    async def stream_loop(self, kind: str, user: str, max_tokens: int) -> None:
        while time.monotonic() < self.deadline:
            await self.one(kind, user, max_tokens)

    async def every(self, period_s: float, make: Any) -> None:
        tasks = []
        while time.monotonic() + period_s < self.deadline:
            await asyncio.sleep(period_s)
            tasks.append(asyncio.ensure_future(make(len(tasks))))
        await asyncio.gather(*tasks)

    async def run(self) -> None:
        jobs = [self.stream_loop("paced", user, tokens)
                for user, _, streams, tokens in PACED for _ in range(streams)]
        user, _, streams, tokens = UNLIMITED
        jobs += [self.stream_loop("unlimited", user, tokens) for _ in range(streams)]
        jobs.append(self.every(self.churn_s, lambda i: self.one("churn", f"churn-{i}", CHURN_TOKENS)))
        jobs.append(self.every(CANCEL_EVERY_S, lambda i: self.one("cancel", "soak-mid", 200, cancel=True)))
        jobs.append(self.every(LONG_PROMPT_EVERY_S, lambda i: self.one(
            "long prompt", "soak-slow", 16, prompt=self.long_prompt)))
        await asyncio.gather(*jobs)


# -- the run ---------------------------------------------------------------------


@dataclass
class Report:
    model: str
    minutes: float
    server_args: list[str]
    checks: list[Check] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    requests: dict[str, dict[str, int]] = field(default_factory=dict)
    conformance: dict[str, Any] = field(default_factory=dict)
    step_time_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    rss_slope_mib_per_hour: float = 0.0
    state_slopes_per_hour: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["passed"] = len(self.checks) - len(self.failed)
        doc["failed"] = len(self.failed)
        return doc

    def to_markdown(self) -> str:
        lines = [f"# Soak ({self.minutes:g} minutes)", "",
                 f"Model `{self.model}`; server flags `{' '.join(self.server_args)}`.", "",
                 f"{len(self.checks) - len(self.failed)} checks passed, {len(self.failed)} failed.", "",
                 "| check | measured | result |", "|---|---|---|"]
        for c in self.checks:
            lines.append(f"| {c.name} | {c.measured.replace('|', '/')} | {'pass' if c.ok else '**FAIL**'} |")
        lines += ["", "## Requests", "", "| kind | sent | completed | cancelled | errors |",
                  "|---|---:|---:|---:|---:|"]
        for kind, n in self.requests.items():
            lines.append(f"| {kind} | {n['sent']} | {n['completed']} | {n['cancelled']} | {n['errors']} |")
        lines += ["", "## Samples", "", "| t (s) | engine core RSS (MiB) | API server RSS (MiB) | "
                  "running | waiting | limiter users | per-request entries | per-user entries |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for s in self.samples:
            per_request = sum(v for k, v in s.state.items() if k.startswith("requests."))
            per_user = sum(v for k, v in s.state.items() if k.startswith("users."))
            lines.append(f"| {s.t_s:.0f} | {s.engine_rss_mib:.1f} | {s.api_rss_mib:.1f} | {s.running:.0f} | "
                         f"{s.waiting:.0f} | {s.state.get('limiter.users', 0):.0f} | {per_request:.0f} | "
                         f"{per_user:.0f} |")
        lines += ["", "## Step time while busy (ms)", "", "| part of the run | steps | p50 | p90 | p99 | max |",
                  "|---|---:|---:|---:|---:|---:|"]
        for part, q in self.step_time_ms.items():
            if q:
                lines.append(f"| {part} | {q['n']:.0f} | {q['p50']:.2f} | {q['p90']:.2f} | {q['p99']:.2f} | "
                             f"{q['max']:.2f} |")
        return "\n".join(lines) + "\n"


def sample_line(s: Sample, minutes: float, requests: list[Request]) -> str:
    """A sample as a progress line: how far the run is, RSS, the engine's
    queues, requests sent and failed, the limiter's users."""
    errors = sum(r.error is not None for r in requests)
    return (f"soak: {s.t_s / 60:.1f}/{minutes:g} min, engine core RSS {s.engine_rss_mib:.0f} MiB, "
            f"API server {s.api_rss_mib:.0f} MiB, running {s.running:.0f}, waiting {s.waiting:.0f}, "
            f"{len(requests)} requests sent, {errors} failed, "
            f"limiter users {s.state.get('limiter.users', 0):.0f}")


async def drive(base_url: str, server_pid: int, minutes: float, sample_s: float, churn_s: float,
                report: Report, progress: bool = False) -> float:
    """The load and the samples (a progress line each); returns the run's
    start (monotonic s)."""
    from vllm_output_rate.tools.loadgen.prompts import text_of_tokens
    from vllm_output_rate.tools.reliability.cases import Live, wait_quiet

    import psutil

    from vllm_output_rate.tools.bench.profile_engine import find_engine_core

    procs = psutil.Process(server_pid), psutil.Process(find_engine_core(server_pid, timeout_s=30))
    from vllm_output_rate.tools.common.client import http_limits

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=http_limits(None)) as client:
        long_prompt = await text_of_tokens(client, base_url, MODEL_NAME, MAX_MODEL_LEN - 64, 11)
        t0 = time.monotonic()
        load = Load(client, base_url, t0 + minutes * 60.0, long_prompt, churn_s)

        async def sampler() -> None:
            while time.monotonic() < load.deadline:
                report.samples.append(await sample(client, base_url, procs, t0))
                progress_line(progress, sample_line(report.samples[-1], minutes, load.requests))
                await asyncio.sleep(max(0.0, min(sample_s, load.deadline - time.monotonic())))

        await asyncio.gather(load.run(), sampler())
        quiet, seen = await wait_quiet(Live(base_url, client), timeout_s=60.0)
        await asyncio.sleep(2.5)  # one telemetry export after going quiet
        report.samples.append(await sample(client, base_url, procs, t0))
    report.checks.append(Check("quiet afterwards", seen, quiet))
    analyse_requests(report, load.requests)
    return t0


def analyse_requests(report: Report, requests: list[Request]) -> None:
    """The completion and error checks of the requests the load sent."""
    kinds: dict[str, dict[str, int]] = {}
    wrong, refused, transport = [], [], []
    for r in requests:
        n = kinds.setdefault(r.kind, {"sent": 0, "completed": 0, "cancelled": 0, "errors": 0})
        n["sent"] += 1
        if r.error:
            n["errors"] += 1
            # an HTTP error status is the server's answer; anything else ended
            # the exchange at the client (a read error, a stream cut mid-line)
            (refused if r.error.startswith("HTTP ") else transport).append(
                f"{r.user} at {r.t_s:.0f} s: {r.error}")
        elif r.cancelled:
            n["cancelled"] += 1
        elif r.completion_tokens == r.max_tokens and r.finish_reason == "length":
            n["completed"] += 1
        else:
            wrong.append(f"{r.user}: {r.completion_tokens} of {r.max_tokens} tokens, finish {r.finish_reason}")
    report.requests = kinds
    sent = sum(n["sent"] for n in kinds.values())
    report.checks.append(Check(
        "every request that completed has the tokens it asked for; every kind of load ran",
        f"{sent} requests; " + ", ".join(f"{k}: {n['completed']} completed, {n['cancelled']} cancelled, "
                                         f"{n['errors']} errors" for k, n in kinds.items())
        + (f"; wrong counts: {wrong[:3]}" if wrong else ""),
        not wrong and all(kinds.get(k, {}).get("completed", 0) > 0 for k in ("paced", "unlimited", "churn"))
        and kinds.get("cancel", {}).get("cancelled", 0) > 0
        and kinds.get("long prompt", {}).get("completed", 0) > 0))
    allowed = max(1, sent // 1000)
    report.checks.append(Check(
        f"no HTTP error; transport errors at the client at most {allowed} (0.1%, at least 1)",
        f"{len(refused)} HTTP errors, {len(transport)} transport errors of {sent} requests"
        + (f": {(refused + transport)[:4]}" if refused or transport else ""),
        not refused and len(transport) <= allowed))


def analyse_events(report: Report, events_path: Path, start_ns: int, end_ns: int) -> None:
    from vllm_output_rate.telemetry.events import EngineLog
    from vllm_output_rate.tools.verify.gcra import gcra_max_excess

    log = EngineLog.read(events_path)
    rates = limits()
    worst: dict[str, Any] = {}
    violations = []
    for user, spends in sorted(log.all_user_spends(start_ns).items()):
        rate = rates.get(user, Fraction(DEFAULT_LIMIT))
        if rate >= UNLIMITED[1]:
            continue
        excess, (i, j) = gcra_max_excess(spends, rate, log.dispatch_lower_bounds(t for t, _ in spends))
        group = "churn-*" if user.startswith("churn-") else user
        tokens = sum(n for _, n in spends)
        span_s = (spends[-1][0] - spends[0][0]) / 1e9
        entry = worst.setdefault(group, {"users": 0, "tokens": 0, "worst_excess": None, "limit": float(rate)})
        entry["users"] += 1
        entry["tokens"] += tokens
        if entry["worst_excess"] is None or excess > entry["worst_excess"]:
            entry["worst_excess"] = excess
        if group == user:
            entry["rate"] = round((tokens - spends[0][1]) / span_s, 3) if span_s > 0 else 0.0
        if excess > 0:
            violations.append(f"{user}: {float(excess):.2f} tokens over in events {i}..{j}")
    report.conformance = {g: {**e, "worst_excess": float(e["worst_excess"])} for g, e in worst.items()}
    summary = "; ".join(
        f"{g}: {e['users']} user(s), {e['tokens']} tokens"
        + (f", {e['rate']:.2f} tok/s" if "rate" in e else "")
        + f" (limit {e['limit']:g}), worst window {float(e['worst_excess']):+.2f} tokens against the bound"
        for g, e in worst.items())
    report.checks.append(Check(
        "every limited user within the GCRA bound in every window of the run (engine-side, one step of slack)",
        summary + (f"; violations: {violations[:5]}" if violations else ""),
        not violations and all(g in worst for g, _, _, _ in PACED) and "churn-*" in worst))
    stamps = [t for t, _ in log.steps]
    tenth = (end_ns - start_ns) // 10
    first = quantiles_ms(step_times(stamps, start_ns, start_ns + tenth))
    last = quantiles_ms(step_times(stamps, end_ns - tenth, end_ns))
    report.step_time_ms = {"first tenth": first, "last tenth": last}
    ok = bool(first and last) and last["p50"] <= 1.5 * first["p50"] + 5.0
    report.checks.append(Check(
        "step time while busy: the last tenth's p50 within 1.5x the first's + 5 ms",
        (f"first p50 {first['p50']:.2f} / p99 {first['p99']:.2f} ms, last p50 {last['p50']:.2f} / "
         f"p99 {last['p99']:.2f} ms") if first and last else "no busy steps",
        ok))


def analyse_samples(report: Report, minutes: float, state: bool = True) -> None:
    samples = report.samples
    warm = minutes * 60.0 / 5.0
    # under load: after warm-up, without the last sample (taken once quiet)
    after = [s for s in samples[:-1] if s.t_s >= warm] or samples[-3:-1] or samples
    report.rss_slope_mib_per_hour = round(slope_per_hour([(s.t_s, s.engine_rss_mib) for s in after]), 2)
    names = sorted({k for s in samples for k in s.state})
    report.state_slopes_per_hour = {k: round(slope_per_hour([(s.t_s, s.state.get(k, 0.0)) for s in after]), 1)
                                    for k in names}
    rss = [s.engine_rss_mib for s in after if s.engine_rss_mib == s.engine_rss_mib]
    growth = rss[-1] - rss[0] if len(rss) >= 2 else float("nan")
    report.checks.append(Check(
        f"engine core RSS flat after warm-up (growth <= {RSS_GROWTH_MIB:g} MiB)",
        f"{len(after)} samples from {after[0].t_s:.0f} s: {rss[0] if rss else float('nan'):.1f} -> "
        f"{rss[-1] if rss else float('nan'):.1f} MiB ({growth:+.1f} MiB), slope "
        f"{report.rss_slope_mib_per_hour:+.1f} MiB/hour",
        bool(rss) and growth <= RSS_GROWTH_MIB))
    if not state:
        return
    final = samples[-1].state
    per_request = {k: v for k, v in final.items() if k.startswith("requests.")}
    peak_users = {k: max(s.state.get(k, 0.0) for s in samples)
                  for k in names if k.startswith("users.") or k in ("limiter.users", "labels")}
    report.checks.append(Check(
        "state bounded: per-request containers empty once quiet, per-user ones capped",
        f"once quiet: {sum(per_request.values()):.0f} per-request entries; peaks: "
        + ", ".join(f"{k} {v:.0f}" for k, v in peak_users.items())
        + "; slopes after warm-up per hour: "
        + ", ".join(f"{k} {v:+.0f}" for k, v in report.state_slopes_per_hour.items() if v),
        bool(final) and not any(per_request.values())
        and all(v <= USER_STATE_BOUND for v in peak_users.values())))


def run(model: str, minutes: float, sample_s: float, churn_s: float, out_dir: Path, log_dir: Path,
        feature_off: bool = False, progress: bool = False) -> Report:
    """The soak; with ``feature_off`` the same load on a server without
    limits (no limits, no event log, no state of ours: the requests, quiet
    and RSS checks only)."""
    from vllm_output_rate import settings
    from vllm_output_rate.tools.common.client import Server

    out_dir.mkdir(parents=True, exist_ok=True)
    events = out_dir / "events.jsonl"
    if events.exists():
        events.unlink()
    report = Report(model, minutes, server_args(feature_off))
    env = {} if feature_off else {settings.name("TELEMETRY"): "1", settings.name("EVENTS"): str(events)}
    with Server(model, report.server_args, log_dir / "soak-server.log", extra_env=env) as server:
        t0 = asyncio.run(drive(server.base_url, server.proc.pid, minutes, sample_s, churn_s, report,
                               progress))
        time.sleep(1.5)  # the event log's last append
    # (time.monotonic and the engine's monotonic_ns stamps are one clock)
    start_ns, end_ns = int(t0 * 1e9), int((t0 + minutes * 60.0) * 1e9)
    if not feature_off:
        analyse_events(report, events, start_ns, end_ns)
    analyse_samples(report, minutes, state=not feature_off)
    write_report(out_dir, report)
    return report


def main(argv: list[str] | None = None) -> int:
    from vllm_output_rate.tools.common.help_text import PlainHelpFormatter  # the docstring, no markup

    parser = argparse.ArgumentParser(prog="vllm-output-rate soak", description=__doc__,
                                     formatter_class=PlainHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the tiny model, made here)")
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the load runs (default 30)")
    parser.add_argument("--sample-s", type=float, default=60.0,
                        help="seconds between samples of RSS and state sizes (default 60)")
    parser.add_argument("--churn-s", type=float, default=1.0,
                        help="seconds between two new user ids (default 1)")
    parser.add_argument("--out", default=None, help="report directory (default: reports/soak)")
    parser.add_argument("--feature-off", action="store_true",
                        help="the same load on a server without limits (vLLM as upstream): the "
                             "control arm of a memory comparison; requests, quiet and RSS checks only")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress lines on stderr (a line per sample)")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.sample_s <= 0 or args.churn_s <= 0:
        parser.error("--minutes, --sample-s and --churn-s must be positive")
    model, log_dir = model_and_logs(args.model)
    out = Path(args.out or "reports/soak")
    report = run(model, args.minutes, args.sample_s, args.churn_s, out, log_dir, args.feature_off,
                 not args.no_progress)
    for c in report.checks:
        print(f"{'pass' if c.ok else 'FAIL'}  {c.name}: {c.measured[:300]}")
    print(f"\n{len(report.checks) - len(report.failed)} passed, {len(report.failed)} failed; "
          f"report: {out / 'report.md'}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
