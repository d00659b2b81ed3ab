"""Load generator: drive an OpenAI-compatible vLLM server with a scenario file.

A scenario (YAML or JSON) names users and their expected limits, prompts
(literal, generated long ones, shared prefixes for prefix-cache hits) and
phases of streams run one after the other. Each stream: user, how many
copies, prompt, ``max_tokens``, ``ignore_eos`` or an early stop (EOS /
``stop_token_ids``), a client cancel after N tokens or T seconds, a start
time within its phase. The run records, per request, the client-side arrival
time of every chunk with the completion tokens the server had counted by then
(``continuous_usage_stats``), the server's final ``completion_tokens`` and the
finish reason. It stops by itself: every request has a deadline and the whole
run has one (``timeout_s``).

Every request carries an ``X-Request-Id`` of the form ``orl-<run>-<seq>``;
vLLM 0.32 turns it into the engine request id ``chatcmpl-<that>-<8 hex>``,
which is how ``vllm_output_rate.tools.verify`` matches client streams to engine events.

``vllm-output-rate loadgen --server URL [--scenario FILE] [--out results.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from vllm_output_rate.config import ANONYMOUS_USER
from vllm_output_rate.tools.common.client import chat_body, http_limits, stream_into
from vllm_output_rate.tools.loadgen.scenario import (
    UNLIMITED,
    Scenario,
    ScenarioError,
    StreamSpec,
    load_scenario,
    resolve_prompts,
)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times: seconds on the client's
    monotonic clock; ``RunRecord.t0_unix_ns`` maps them to wall time."""

    rid: str
    phase: str
    user: str
    prompt: str
    max_tokens: int
    ignore_eos: bool
    cancel_after_tokens: int | None
    cancel_after_s: float | None
    start_s: float
    sent: float = 0.0
    #: (arrival time s, completion tokens counted so far) per chunk that added tokens
    chunks: list[tuple[float, int]] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    #: the client closed the stream on purpose (cancel_after_*)
    cancelled: bool = False
    error: str | None = None
    done: float = 0.0


@dataclass
class RunRecord:
    scenario: str
    run_id: str
    base_url: str
    #: wall-clock ns and monotonic s taken at the same moment
    t0_unix_ns: int
    t0_mono: float
    requests: list[RequestRecord] = field(default_factory=list)
    #: phase -> (start, end) in client monotonic s
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)
    timed_out: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunRecord:
        reqs = [RequestRecord(**{**r, "chunks": [tuple(c) for c in r["chunks"]]})
                for r in data.get("requests", [])]
        phases = {k: tuple(v) for k, v in data.get("phases", {}).items()}
        return cls(**{**data, "requests": reqs, "phases": phases})


def request_body(scenario: Scenario, spec: StreamSpec, text: str) -> dict[str, Any]:
    """The stream's request; the scenario's anonymous user (config's
    ANONYMOUS_USER) sends no user field."""
    options: dict[str, Any] = {}
    if spec.stop_token_ids:
        options["stop_token_ids"] = list(spec.stop_token_ids)
    if spec.temperature is not None:
        options["temperature"] = spec.temperature
    user = None if spec.user == ANONYMOUS_USER else spec.user
    return chat_body(scenario.model_name, text, spec.max_tokens, user, spec.ignore_eos, **options)


async def _stream_one(client: Any, base_url: str, rec: RequestRecord, body: dict[str, Any],
                      timeout_s: float, on_tokens: Any) -> None:
    """One streaming request; never raises (errors are recorded)."""
    rec.sent = time.monotonic()
    limit = timeout_s if rec.cancel_after_s is None else min(timeout_s, rec.cancel_after_s)
    try:
        async with asyncio.timeout(limit):
            rec.cancelled = await stream_into(client, base_url, body, rec,
                                              headers={"X-Request-Id": rec.rid},
                                              on_tokens=on_tokens,
                                              cancel_after_tokens=rec.cancel_after_tokens)
    except TimeoutError:
        if rec.cancel_after_s is not None and rec.cancel_after_s <= timeout_s:
            rec.cancelled = rec.finish_reason is None
        else:
            rec.error = f"no answer within the request timeout ({timeout_s:g} s)"
    except asyncio.CancelledError:
        rec.error = "run timeout: stopped before the end"
        raise
    except Exception as exc:  # recorded, never raised: one stream must not kill a run
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        rec.done = time.monotonic()


async def run_scenario(base_url: str, scenario: Scenario, progress: Any = None,
                       run_id: str | None = None, transport: Any = None) -> RunRecord:
    """Run every phase of ``scenario`` against ``base_url``, one after the other.

    ``transport``: an httpx transport in place of the network (tests)."""
    import httpx

    run_id = run_id or uuid.uuid4().hex[:8]
    run = RunRecord(scenario.name, run_id, base_url, time.time_ns(), time.monotonic())
    on_tokens = progress.update if progress is not None else None
    seq = 0
    limits = http_limits(512)
    timeout = httpx.Timeout(scenario.request_timeout_s, connect=30.0)

    async def delayed(rec: RequestRecord, body: dict[str, Any]) -> None:
        await asyncio.sleep(rec.start_s)
        await _stream_one(client, base_url, rec, body, scenario.request_timeout_s, on_tokens)

    async def run_phases() -> None:
        nonlocal seq
        for phase in scenario.phases:
            tasks = []
            start = time.monotonic()
            for spec in phase.streams:
                base = scenario.prompts[spec.prompt]
                for _ in range(spec.count):
                    rid = f"orl-{run_id}-{seq:04d}"
                    text = base.text + (f" [request {seq}]" if base.unique else "")
                    seq += 1
                    rec = RequestRecord(rid, phase.name, spec.user, spec.prompt, spec.max_tokens,
                                        spec.ignore_eos, spec.cancel_after_tokens,
                                        spec.cancel_after_s, spec.start_s)
                    run.requests.append(rec)
                    tasks.append(asyncio.create_task(delayed(rec, request_body(scenario, spec, text))))
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                run.phases[phase.name] = (start, time.monotonic())
            await asyncio.sleep(phase.gap_s)

    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
        scenario = await resolve_prompts(client, base_url, scenario)
        try:
            await asyncio.wait_for(run_phases(), scenario.timeout_s)
        except TimeoutError:
            run.timed_out = True
            for rec in run.requests:
                if rec.sent and not rec.done:
                    rec.error = rec.error or "run timeout: stopped before the end"
    return run


def run_with_progress(base_url: str, scenario: Scenario, show_progress: bool = True,
                      run_id: str | None = None) -> RunRecord:
    """``run_scenario`` with a tqdm token bar on stderr."""
    from tqdm import tqdm

    with tqdm(total=scenario.expected_tokens(), unit="tok", desc=f"load {scenario.name}",
              mininterval=0.5, disable=not show_progress, file=sys.stderr) as bar:
        return asyncio.run(run_scenario(base_url, scenario, progress=bar, run_id=run_id))


def summary_lines(run: RunRecord, scenario: Scenario) -> list[str]:
    """Per phase and user: requests, tokens, cancels, errors, client-side rate."""
    lines = [f"{'phase':<10} {'user':<12} {'limit':>8} {'reqs':>4} {'tokens':>7} {'cancel':>6} "
             f"{'errors':>6} {'client tok/s':>12}"]
    groups: dict[tuple[str, str], list[RequestRecord]] = {}
    for r in run.requests:
        groups.setdefault((r.phase, r.user), []).append(r)
    for (phase, user), rs in groups.items():
        limit = scenario.users.get(user)
        firsts = [r.chunks[0][0] for r in rs if r.chunks]
        lasts = [r.chunks[-1][0] for r in rs if r.chunks]
        tokens = sum(r.completion_tokens for r in rs)
        span = max(lasts) - min(firsts) if firsts else 0.0
        rate = (tokens - 1) / span if span > 0 else 0.0
        lines.append(f"{phase:<10} {user:<12} {_fmt_limit(limit):>8} {len(rs):>4} {tokens:>7} "
                     f"{sum(r.cancelled for r in rs):>6} {sum(r.error is not None for r in rs):>6} "
                     f"{rate:>12.1f}")
    return lines


def _fmt_limit(limit: Fraction | None) -> str:
    return UNLIMITED if limit is None else f"{float(limit):g}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-output-rate loadgen",
        description="Drive an OpenAI-compatible vLLM server with a scenario file "
                    "and record client-side timing of every chunk.")
    parser.add_argument("--server", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--scenario", help="scenario file (YAML or JSON); default: the built-in one")
    parser.add_argument("--out", help="write the per-request record (JSON) here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as exc:
        print(f"vllm-output-rate loadgen: {exc}", file=sys.stderr)
        return 2
    run = run_with_progress(args.server.rstrip("/"), scenario, not args.no_progress)
    print("\n".join(summary_lines(run, scenario)))
    if args.out:
        Path(args.out).write_text(json.dumps(run.to_json(), indent=1))
        print(f"record: {args.out}")
    bad = [r for r in run.requests if r.error]
    for r in bad:
        print(f"error {r.rid} ({r.user}): {r.error}", file=sys.stderr)
    return 1 if bad or run.timed_out else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
