"""The fault and bad-input runner: named cases against a real CPU engine.

``vllm-output-rate stress [--model DIR] [--profile quick|full] [--out DIR] [--groups G,...] [--no-progress]``
starts ``vllm-output-rate serve`` on the model (default: the tiny model,
generated locally) with per-user limits and runs named cases, each with what
it sends, what it expects and what it measured; it writes ``report.md`` and
``report.json`` to ``--out`` and exits non-zero when a case fails. A line on
stderr as each group starts and each case ends (``--no-progress``: none).

Groups of cases:

``config``
    Every bad value of every option, each refused at start-up naming the
    option and the value: the arguments go through the same parser and the
    same checks as ``vllm-output-rate serve`` (vLLM's serve parser with the
    plugin's options, ``from_cli_args``, ``create_engine_config``) in this
    process, no engine started. The full profile also starts a real server
    for each case and checks that the process exits non-zero with the same
    message.
``user_field``
    The request's user field as empty string, 10,000 characters, control
    characters and quotes, emoji, integer, float, boolean, list, object,
    null and absent, streamed and not: each served or refused with HTTP 400,
    never a 5xx; then ``/metrics`` still parses and no ``user`` label is
    longer than 64 characters.
``requests``
    Requests the limiter must handle: ``n`` > 1 (every sample charged; the
    samples of a user at its limit share its budget: the rate and the GCRA
    bound over the stream),
    structured output for a throttled user, a prompt longer than the
    model's length (a clear 400), a long prompt under chunked prefill for a
    throttled user, ``max_tokens`` 1, non-streaming, ``stop`` strings, beam
    search (400 with the reason).
``identity_churn``
    Distinct user ids through the real scheduler and telemetry, no server
    (20,000; a million in the full profile): labels capped, state bounded
    and dropped when idle, memory flat. Then through the server (300; 2,000
    in the full profile): every request served, the ``user`` label capped,
    the engine core's state sizes (``vllm_output_rate_state_entries``) and
    RSS (psutil) bounded and flat.
``tenants`` (full profile: a server of its own)
    Tenant isolation, the threat model of RELIABILITY.md: customers with
    their own keys (``--output-rate-api-keys``), an operator's admin key,
    hashed user labels. A customer reads its own state and is refused
    another's, the list and the limits (403, naming no one); a request of
    one customer naming another (body field, user header) is charged to
    itself and leaves the other's budget untouched; no response to one
    customer (bodies, RateLimit headers, refusals) holds another's id, and
    ``/metrics`` holds no id.
``telemetry_faults`` (full profile)
    A server each: the OTLP endpoint dead, accepting and never answering, or
    flapping (2 s up, 2 s down); the event log unwritable; the snapshot
    directory unwritable at start or gone mid-run; the snapshot directory or
    the event log on a full disk (a filled 64 KiB tmpfs: needs the right to
    mount); ``/metrics`` scraped by five clients aiming at 50 a second. The
    limit holds, every request completes,
    drops are counted (or logged once), and the engine's inter-token
    latency and wake-up lateness are reported.
``client_faults``
    Streams of throttled users cancelled after their first token, clients
    that stop reading for a while (slow consumers), connections dropped
    mid-prefill; afterwards nothing running, waiting or throttled, the KV
    cache back to empty, no user left with live requests in the limiter's
    and the telemetry's view (``GET /output-rate/users``).

Sizes are in tokens of the model under test (its tokenizer, through the
server's ``/tokenize``), never in words.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from vllm_output_rate.tools.reliability.cases import (
    CaseResult,
    Live,
    Report,
    model_and_logs,
    progress_line,
    server_args,
    write_report,
)
from vllm_output_rate.tools.reliability.client_faults import client_fault_cases
from vllm_output_rate.tools.reliability.config_cases import CONFIG_CASES, check_config_case, serve_refuses
from vllm_output_rate.tools.reliability.identity_churn import http_churn_case, identity_churn
from vllm_output_rate.tools.reliability.request_cases import request_cases, user_field_cases
from vllm_output_rate.tools.reliability.telemetry_faults import telemetry_fault_cases
from vllm_output_rate.tools.reliability.tenants import run_tenant_cases


GROUPS = ("config", "identity_churn", "user_field", "requests", "client_faults", "tenants",
          "telemetry_faults")


async def live_cases(base_url: str, profile: str, server_pid: int,
                     groups: frozenset[str] = frozenset(GROUPS),
                     add: Callable[[list[CaseResult]], None] | None = None) -> list[CaseResult]:
    """The groups run against the live server; ``add`` is given each group's
    cases as the group ends."""
    from vllm_output_rate.tools.common.client import http_limits

    limits = http_limits(None)  # idle connections dropped before the server's keep-alive
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        live = Live(base_url, client)
        cases: list[CaseResult] = []

        def record(group_cases: list[CaseResult]) -> None:
            cases.extend(group_cases)
            if add is not None:
                add(group_cases)

        if "user_field" in groups:
            record(await user_field_cases(live, (True, False)))
        if "requests" in groups:
            record(await request_cases(live))
        if "client_faults" in groups:
            record(await client_fault_cases(live, 100 if profile == "full" else 20))
        if "identity_churn" in groups:
            record([await http_churn_case(live, 2000 if profile == "full" else 300, server_pid)])
    return cases


def run(model: str, profile: str, out_dir: Path, log_dir: Path,
        groups: frozenset[str] = frozenset(GROUPS), progress: bool = False) -> Report:
    """The cases of ``groups`` (telemetry faults: full profile only), with a
    progress line on stderr as each group starts and each case is recorded."""
    from vllm_output_rate.tools.common.client import Server

    report = Report(model, profile, server_args())

    def starting(what: str) -> None:
        progress_line(progress, f"stress: {time.time() - report.started_unix:5.0f} s, {what}")

    if "config" in groups:
        starting(f"config: {len(CONFIG_CASES)} refused configurations")
        with tempfile.TemporaryDirectory(prefix="output-rate-stress-") as scratch:
            for case in CONFIG_CASES:
                report.add([check_config_case(case, model, Path(scratch))], progress)
            if profile == "full":
                starting(f"config: the same {len(CONFIG_CASES)} as real servers")
                for case in CONFIG_CASES:
                    report.add([serve_refuses(case, model, Path(scratch), log_dir)], progress)
    if "identity_churn" in groups:
        starting("identity churn in the engine core")
        report.add([identity_churn(1_000_000 if profile == "full" else 20_000, model)], progress)
    live = [g for g in ("user_field", "requests", "client_faults", "identity_churn") if g in groups]
    if live:
        starting(f"starting a server for {', '.join(live)} (log: {log_dir / 'stress-server.log'})")
        with Server(model, report.server_args, log_dir / "stress-server.log",
                    extra_env={"OUTPUT_RATE_TELEMETRY": "1"}) as server:
            starting("the server is up")
            asyncio.run(live_cases(server.base_url, profile, server.proc.pid, groups,
                                   lambda cases: report.add(cases, progress)))
    if profile == "full" and "tenants" in groups:
        starting("tenants")
        report.add(run_tenant_cases(model, log_dir), progress)
    if profile == "full" and "telemetry_faults" in groups:
        starting("telemetry faults")
        report.add(telemetry_fault_cases(model, log_dir), progress)
    write_report(out_dir, report)
    return report


def main(argv: list[str] | None = None) -> int:
    from vllm_output_rate.tools.common.help_text import PlainHelpFormatter  # the docstring, no markup

    parser = argparse.ArgumentParser(prog="vllm-output-rate stress", description=__doc__,
                                     formatter_class=PlainHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the tiny model, made here)")
    parser.add_argument("--profile", choices=("quick", "full"), default="quick",
                        help="quick: a few minutes; full: every config case also as a real server, "
                             "100 cancelled streams")
    parser.add_argument("--out", default=None, help="report directory (default: reports/stress)")
    parser.add_argument("--groups", default=",".join(GROUPS),
                        help=f"comma-separated groups to run (default: all; {', '.join(GROUPS)})")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress lines on stderr (a line per group and per case)")
    args = parser.parse_args(argv)
    groups = frozenset(g.strip() for g in args.groups.split(",") if g.strip())
    if not groups or groups - set(GROUPS):
        parser.error(f"--groups: unknown {sorted(groups - set(GROUPS)) or 'empty'}; "
                     f"choose from {', '.join(GROUPS)}")
    model, log_dir = model_and_logs(args.model)
    out = Path(args.out or "reports/stress")
    report = run(model, args.profile, out, log_dir, groups, not args.no_progress)
    for c in report.cases:
        print(f"{'pass' if c.ok else 'FAIL'}  {c.group:<14} {c.name:<50} {c.measured[:120]}")
    print(f"\n{len(report.cases) - len(report.failed)} passed, {len(report.failed)} failed; "
          f"report: {out / 'report.md'}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
