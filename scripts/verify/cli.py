"""``vllm-output-rate verify``: run a scenario (against a running server,
or a server started here on ``--model``), then analyse, check and report
(what it checks: the package's docstring, ``tools.verify``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from vllm_output_rate import settings
from vllm_output_rate.telemetry.events import EngineLog
from vllm_output_rate.tools.loadgen.run import RunRecord, run_with_progress
from vllm_output_rate.tools.loadgen.scenario import Scenario, ScenarioError, load_scenario
from vllm_output_rate.tools.verify.analysis import EVENTS_ENV, Analysis, Metrics, base_request_id
from vllm_output_rate.tools.verify.checks import run_checks
from vllm_output_rate.tools.verify.report import print_summary, write_report



def _scrape(base_url: str) -> tuple[dict | None, str | None]:
    from vllm_output_rate.tools.common.client import scrape_metrics

    try:
        return scrape_metrics(base_url), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _probe(base_url: str, model: str) -> None:
    import httpx

    try:
        httpx.post(f"{base_url}/v1/completions",
                   json={"model": model, "prompt": "probe", "max_tokens": 1}, timeout=30)
    except httpx.HTTPError:
        pass


def _wait_for_engine_log(path: Path, run: RunRecord, timeout_s: float = 20.0) -> EngineLog:
    """Read the log until every sent request has finished in it and an idle
    throttled-state line came after the last of them (the engine writes about
    once a second)."""
    deadline = time.monotonic() + timeout_s
    wanted = {r.rid for r in run.requests if r.sent}
    log = EngineLog()
    while True:
        if path.exists():
            log = EngineLog.read(path)
            done = {base_request_id(eid) for eid in log.finished}
            last_fin = max((int(e["t_ns"]) for eid, e in log.finished.items()
                            if base_request_id(eid) in wanted), default=None)
            idle_after = last_fin is not None and any(
                int(e["t_ns"]) > last_fin and not sum((e.get("requests") or {}).values())
                for e in log.throttled[-3:])
            if wanted <= done and idle_after:
                return log
        if time.monotonic() > deadline:
            return log
        time.sleep(0.5)


def is_async(scenario: Scenario, start: dict[str, Any] | None) -> bool:
    """Whether the engine ran async scheduling: its event log's start line
    says so; a log without the field (an older engine's) is read by the
    scenario's flags (a guess: vLLM's CPU platform turns
    ``--async-scheduling`` off unless the project's setting forces it)."""
    if start and "async_scheduling" in start:
        return bool(start["async_scheduling"])
    env = dict(scenario.server.env)
    return "--async-scheduling" in scenario.server.args or \
        settings.get("FORCE_ASYNC_SCHEDULING", env)


def verify_run(scenario: Scenario, base_url: str, events_path: Path, report_dir: Path,
               show_progress: bool = True, notes: list[str] = ()) -> int:
    """Run the scenario against a live server, check, report; the exit code."""
    before, err = _scrape(base_url)
    run = run_with_progress(base_url, scenario, show_progress)
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "run.json").write_text(json.dumps(run.to_json()))
    time.sleep(2.5)  # the engine exports its telemetry about once a second
    after, err2 = _scrape(base_url)
    _probe(base_url, scenario.model_name)
    # a server that is gone writes nothing more: do not wait long for it
    log = _wait_for_engine_log(events_path, run, 20.0 if after is not None else 3.0)
    final, err3 = _scrape(base_url)
    metrics = Metrics(before, after, final, err or err2 or err3)
    return analyze_and_report(scenario, run, log, metrics, report_dir, notes)


def analyze_and_report(scenario: Scenario, run: RunRecord, log: EngineLog, metrics: Metrics,
                       report_dir: Path, notes: list[str] = ()) -> int:
    a = Analysis(scenario, run, log, metrics)
    a.lag = 2 if is_async(scenario, a.start_event()) else 1
    checks, stats = run_checks(a)
    path = write_report(a, checks, stats, report_dir, list(notes))
    print_summary(checks, stats, a)
    ok = all(c.ok for c in checks)
    print(f"verify: {'PASS' if ok else 'FAIL'}; report: {path}")
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-output-rate verify",
        description="Engine-side ITL verification: run a scenario, check per-user spacing, "
                    "rate and completeness from the engine's own timestamps.")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", help="base URL of a running server (needs --events)")
    where.add_argument("--model", help="start a server on this model directory for the run")
    parser.add_argument("--events", help=f"the event log the running server's engine writes "
                                         f"(its {EVENTS_ENV}); with --server")
    parser.add_argument("--scenario", help="scenario file (YAML or JSON); default: built-in")
    parser.add_argument("--report", default="verify-report", help="report directory")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--pictures", metavar="DIR",
                        help="with --model: also let a Prometheus on loopback scrape the server "
                             "every second (`prometheus` on PATH: make tools) and write what an "
                             "operator sees into DIR: the key dashboard panels (spacing.png, "
                             "rate_vs_limit.png, throttled_kv.png, summary.md, as "
                             "vllm_output_rate.tools.prom_pictures draws them) and the report's "
                             "timeline.png, as small palette PNGs (make pictures: docs/img)")
    args = parser.parse_args(argv)
    if args.pictures and not args.model:
        parser.error("--pictures needs --model (with --server, point "
                     "vllm_output_rate.tools.prom_pictures at the Prometheus that scrapes it)")
    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as exc:
        print(f"vllm-output-rate verify: {exc}", file=sys.stderr)
        return 2
    report = Path(args.report)
    report.mkdir(parents=True, exist_ok=True)
    if args.server:
        if not args.events:
            parser.error("--server needs --events: the engine event log that server writes")
        return verify_run(scenario, args.server.rstrip("/"), Path(args.events), report,
                          not args.no_progress)

    from vllm_output_rate.tools.common.client import Server

    events = report / "engine-events.jsonl"
    events.unlink(missing_ok=True)
    env = {**settings.child_env(EVENTS=events.resolve(), TELEMETRY=True),
           **dict(scenario.server.env)}
    server_args = [*scenario.server_args(), "--served-model-name", scenario.model_name]
    server = Server(args.model, server_args, report / "server.log", extra_env=env)
    print(f"starting the server on {args.model} (log: {server.log_path})", file=sys.stderr)
    try:
        server.start()
    except (RuntimeError, TimeoutError) as exc:
        print(f"vllm-output-rate verify: {exc}", file=sys.stderr)
        return 2
    prometheus = None
    try:
        if args.pictures:
            from vllm_output_rate.tools.prom_pictures import LocalPrometheus

            prometheus = LocalPrometheus(report / "prometheus",
                                         server.base_url.split("://", 1)[1]).start()
        started = time.time()
        code = verify_run(scenario, server.base_url, events, report, not args.no_progress,
                          [f"server started by verify: `{' '.join(server_args)}`"])
        if prometheus is not None:
            time.sleep(3)  # the last scrapes
            write_pictures(prometheus.url, started, time.time(), report, Path(args.pictures))
        return code
    except (RuntimeError, TimeoutError) as exc:
        print(f"vllm-output-rate verify: {exc}", file=sys.stderr)
        return 2
    finally:
        if prometheus is not None:
            prometheus.stop()
        server.stop()


def write_pictures(prometheus: str, start: float, end: float, report: Path, out: Path) -> None:
    """The key dashboard panels from ``prometheus`` over the run, and the
    report's timeline, into ``out`` as small PNGs."""
    import shutil

    from vllm_output_rate.tools import prom_pictures

    prom_pictures.pictures(prometheus, start, end, out)
    if (report / "timeline.png").exists():
        shutil.copyfile(report / "timeline.png", out / "timeline.png")
    for name in ("timeline.png", *prom_pictures.PICTURES):
        if (out / name).exists():
            prom_pictures.shrink_png(out / name)
    print(f"verify: pictures in {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
