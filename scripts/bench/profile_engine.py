"""``vllm-output-rate profile``: where the engine-core process spends its time.

Records the engine-core process of a running server with ``py-spy`` for N
seconds while a load runs, and reports the share of the engine loop's samples
(the engine core's main thread, the one running ``run_busy_loop``) in:

- ``schedule()``      vLLM's ``Scheduler.schedule`` (and the limiter's wrapper of it)
- ``limiter``         this plugin's scheduler code (``vllm_patch/scheduler.py``
                      and the modules its steps call: ``_LIMITER_FILES``),
                      wherever vLLM calls it
- ``telemetry``       this plugin's telemetry and tracing (``telemetry/``, ``tracing/``)
- ``update_from_output()``  vLLM's ``Scheduler.update_from_output``
- ``model wait``      the executor: sending the step to the worker process and
                      waiting for its result (or running the model, with an
                      in-process executor)
- ``idle wait``       the engine loop blocked with nothing to run: the
                      limiter's ``idle_wait`` on the input queue, vLLM's own
                      blocking ``input_queue.get`` when no request is left,
                      and vLLM's 1 ms nap after a step that ran no model
- ``input``           handling client requests (add, abort) outside an idle wait
- ``other``           the rest of the loop (step glue, output queue, ...)

*self*: the sample's innermost frame that belongs to a category decides
(frames of vLLM's ``vllm/v1/core`` called from ``schedule()`` count as
``schedule()``, standard-library frames count for their caller); self shares
add up to 100%. *inclusive*: the category is anywhere on the stack (the
limiter's code called from ``schedule()`` counts for both), so inclusive >=
self. ``py-spy`` runs with ``--idle`` so blocked waits are sampled too:
shares are of wall time of the engine loop.

``--compare-off`` starts two servers one after another (limiter on, then the
same command without the limit flags: vLLM's own scheduler) and runs the same
load on both. Raw collapsed stacks (``*.raw.txt``), a speedscope file per run
(open it in speedscope for the flame graph), a JSON report and the Markdown
table go to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from vllm_output_rate import settings
from vllm_output_rate.tools.bench.profile_stacks import (
    Report,
    build_report,
    format_table,
    parse_raw,
    to_speedscope,
)
from vllm_output_rate.tools.common.help_text import PlainHelpFormatter

DEFAULT_LIMITS = {"user-a": 20}
#: user-a (20 tok/s, 4 streams) is throttled; user-b (the default, far above
#: what a CPU engine does) is not
DEFAULT_DEFAULT_LIMIT = 100_000
DEFAULT_LOAD = [("user-a", 4, 200), ("user-b", 4, 900)]
DEFAULT_SERVE_ARGS = ["--max-num-seqs", "16", "--max-num-active-seqs", "8",
                      "--max-model-len", "1024"]

PERMISSION_HELP = """\
py-spy could not attach to the engine-core process (pid {pid}): no permission to
trace it (ptrace). Any one of these fixes it:
  - run the profile as root (or the same command under sudo);
  - allow tracing of your own processes: sudo sysctl kernel.yama.ptrace_scope=0
    (the Yama setting 1, "restricted", only lets a parent trace its children);
  - in a container, add the capability: docker run --cap-add SYS_PTRACE ...
    (Kubernetes: securityContext.capabilities.add: ["SYS_PTRACE"]).
py-spy said: {detail}"""


class ProfileError(RuntimeError):
    """Profiling could not be done; the message says why and what to do."""


# -- processes ---------------------------------------------------------------------


def _is_engine_core(proc: Any) -> bool:
    try:
        return "EngineCore" in proc.name() or "EngineCore" in " ".join(proc.cmdline())
    except Exception:
        return False


def find_engine_core(pid: int, timeout_s: float = 0.0) -> int:
    """The engine-core process: ``pid`` itself, or its child (vLLM names the
    process ``VLLM::EngineCore``)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            proc = psutil.Process(pid)
        except psutil.NoSuchProcess:
            raise ProfileError(f"no process with pid {pid}") from None
        if _is_engine_core(proc):
            return pid
        cores = [c for c in proc.children(recursive=True) if _is_engine_core(c)]
        if len(cores) == 1:
            return cores[0].pid
        if len(cores) > 1:
            raise ProfileError(
                f"pid {pid} has {len(cores)} engine-core processes "
                f"({', '.join(str(c.pid) for c in cores)}); pass one of them with --pid")
        if time.monotonic() >= deadline:
            raise ProfileError(
                f"pid {pid} is not a vLLM engine core and has no engine-core child "
                "(a process named VLLM::EngineCore); pass the API server's or the "
                "engine core's pid")
        time.sleep(0.5)


def _port_from_cmdline(pid: int) -> int | None:
    import psutil

    try:
        proc = psutil.Process(pid)
        for p in [proc, *proc.parents()]:
            cmd = p.cmdline()
            for i, arg in enumerate(cmd):
                if arg == "--port" and i + 1 < len(cmd):
                    return int(cmd[i + 1])
                if arg.startswith("--port="):
                    return int(arg.split("=", 1)[1])
    except Exception:
        return None
    return None


def py_spy_path(explicit: str | None = None) -> str:
    candidates = [explicit, settings.get("PY_SPY"),
                  str(Path(sys.executable).with_name("py-spy")), shutil.which("py-spy")]
    for c in candidates:
        if c and Path(c).exists():
            return c
    raise ProfileError("py-spy not found: install it in this environment "
                       "(pip install py-spy) or pass --py-spy PATH")


_PERMISSION_WORDS = ("permission denied", "operation not permitted", "eperm", "ptrace",
                     "elevated permissions", "are you root", "access is denied")


def record(pid: int, seconds: float, out_raw: Path, rate: int = 100,
           py_spy: str | None = None) -> None:
    """``py-spy record`` of ``pid`` into ``out_raw`` (raw format, threads, idle)."""
    exe = py_spy_path(py_spy)
    cmd = [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
           "--rate", str(rate), "--format", "raw", "--output", str(out_raw),
           "--threads", "--idle"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    detail = (proc.stderr or proc.stdout or "").strip()
    if proc.returncode != 0 or not out_raw.exists():
        if any(w in detail.lower() for w in _PERMISSION_WORDS):
            raise ProfileError(PERMISSION_HELP.format(pid=pid, detail=detail.splitlines()[-1]
                                                      if detail else "(nothing)"))
        raise ProfileError(f"py-spy failed (exit {proc.returncode}) on pid {pid}: {detail[-800:]}")


# -- load --------------------------------------------------------------------------


def parse_load(specs: list[str] | None) -> list[tuple[str, int, int]]:
    if not specs:
        return list(DEFAULT_LOAD)
    plan = []
    for spec in specs:
        try:
            user, streams, tokens = spec.split(":")
            plan.append((user, int(streams), int(tokens)))
        except ValueError:
            raise ProfileError(f"--load {spec!r}: expected USER:STREAMS:MAX_TOKENS") from None
    return plan


async def _record_under_load(base_url: str, model: str, plan: list[tuple[str, int, int]],
                             pid: int, seconds: float, warmup_s: float, out_raw: Path,
                             rate: int, py_spy: str | None) -> dict[str, Any]:
    """Keep ``plan``'s streams running (a finished stream is replaced) while
    py-spy records; returns the tokens streamed during the recording."""
    import httpx

    from vllm_output_rate.tools.common.client import http_limits, stream_chat

    counting = False
    tokens: Counter = Counter()
    errors: list[str] = []

    async def slot(client: Any, user: str, max_tokens: int) -> None:
        def on_tokens(n: int) -> None:
            if counting:
                tokens[user] += n
        while True:
            r = await stream_chat(client, base_url, model, user, max_tokens, on_tokens=on_tokens)
            if r.error:
                errors.append(r.error)
                await asyncio.sleep(0.5)

    limits = http_limits(256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        tasks = [asyncio.create_task(slot(client, user, n))
                 for user, streams, n in plan for _ in range(streams)]
        try:
            await asyncio.sleep(warmup_s)
            counting = True
            t0 = time.monotonic()
            await asyncio.to_thread(record, pid, seconds, out_raw, rate, py_spy)
            elapsed = time.monotonic() - t0
            counting = False
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    total = sum(tokens.values())
    return {"tokens": dict(tokens), "tokens_per_s": total / elapsed if elapsed else 0.0,
            "client_errors": errors[:5]}


def _model_name(base_url: str) -> str:
    import httpx

    try:
        data = httpx.get(f"{base_url}/v1/models", timeout=10).json()
        return data["data"][0]["id"]
    except Exception as exc:
        raise ProfileError(f"cannot reach the server's OpenAI API at {base_url} ({exc}); "
                           "pass --url, or --no-load to profile without driving load") from None


def profile_engine(pid: int, out_dir: Path, name: str, *, seconds: float = 10.0,
                   base_url: str | None = None, plan: list[tuple[str, int, int]] | None = None,
                   warmup_s: float = 3.0, rate: int = 100,
                   py_spy: str | None = None) -> Report:
    """Record engine core ``pid`` (under ``plan``'s load at ``base_url`` unless
    None) and write ``<name>.raw.txt``, ``<name>.speedscope.json``,
    ``<name>.report.json`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / f"{name}.raw.txt"
    if raw.exists():
        raw.unlink()
    meta: dict[str, Any] = {"seconds": seconds, "rate": rate, "pid": pid}
    if base_url is not None and plan:
        model = _model_name(base_url)
        meta["load"] = [list(p) for p in plan]
        meta.update(asyncio.run(_record_under_load(
            base_url, model, plan, pid, seconds, warmup_s, raw, rate, py_spy)))
    else:
        record(pid, seconds, raw, rate, py_spy)
    stacks = parse_raw(raw.read_text(encoding="utf-8", errors="replace").splitlines())
    report = build_report(stacks)
    report.meta = meta
    (out_dir / f"{name}.speedscope.json").write_text(json.dumps(to_speedscope(stacks, name)))
    (out_dir / f"{name}.report.json").write_text(json.dumps(report.to_json(), indent=2))
    return report


def serve_args(limited: bool, limits: dict[str, float], default_limit: float) -> list[str]:
    args = list(DEFAULT_SERVE_ARGS)
    if limited:
        args += ["--output-rate-default-tokens-per-second", str(default_limit),
                 "--output-rate-user-tokens-per-second", json.dumps(limits)]
    return args


def _profile_new_server(model: str, limited: bool, args: argparse.Namespace, out_dir: Path,
                        plan: list[tuple[str, int, int]], extra_env: dict[str, str]) -> Report:
    from vllm_output_rate.tools.common.client import Server

    name = "on" if limited else "off"
    log = out_dir / f"{name}-server.log"
    print(f"starting a server, limiter {name} (log: {log}) ...", file=sys.stderr, flush=True)
    with Server(model, serve_args(limited, args.limits, args.default_limit), log,
                extra_env=extra_env) as server:
        core = find_engine_core(server.proc.pid, timeout_s=30)
        print(f"engine core pid {core}; recording {args.seconds} s under load "
              f"{plan} ...", file=sys.stderr, flush=True)
        return profile_engine(core, out_dir, name, seconds=args.seconds,
                              base_url=server.base_url, plan=plan, warmup_s=args.warmup,
                              rate=args.rate, py_spy=args.py_spy)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-output-rate profile", description=__doc__,
        formatter_class=PlainHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--pid", type=int,
                       help="a running server: the API server's or the engine core's pid")
    where.add_argument("--model", help="start a server on this model directory "
                       "(default: the tiny local test model)")
    parser.add_argument("--seconds", type=float, default=10.0, help="recording length (10)")
    parser.add_argument("--compare-off", action="store_true",
                        help="also profile the same server command without the limit flags "
                        "(upstream scheduler), same load, and print both")
    parser.add_argument("--load", action="append", metavar="USER:STREAMS:MAX_TOKENS",
                        help="streams kept running during the recording; repeatable "
                        f"(default: {' '.join(':'.join(map(str, p)) for p in DEFAULT_LOAD)})")
    parser.add_argument("--no-load", action="store_true",
                        help="with --pid: drive no load, profile whatever the server does")
    parser.add_argument("--url", help="with --pid: the server's base URL "
                        "(default: 127.0.0.1 and the --port of its command line, else 8000)")
    parser.add_argument("--limits", type=json.loads, default=dict(DEFAULT_LIMITS),
                        help=f"started servers: per-user limits, JSON ({json.dumps(DEFAULT_LIMITS)})")
    parser.add_argument("--default-limit", type=float, default=DEFAULT_DEFAULT_LIMIT,
                        help=f"started servers: default per-user limit ({DEFAULT_DEFAULT_LIMIT})")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="started servers: force async scheduling on (limiter on only)")
    parser.add_argument("--warmup", type=float, default=3.0,
                        help="seconds of load before recording (3)")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second (100)")
    parser.add_argument("--out", default=".cache/profile", help="output directory (.cache/profile)")
    parser.add_argument("--py-spy", help="the py-spy executable (default: beside python, or PATH)")
    args = parser.parse_args(argv)

    out_dir = Path(args.out)
    reports: dict[str, Report] = {}
    try:
        plan = parse_load(args.load)
        if args.pid is not None:
            if args.compare_off:
                raise ProfileError("--compare-off starts its own servers (limiter on and off); "
                                   "use it with --model or alone, not with --pid")
            core = find_engine_core(args.pid)
            base_url = None
            if not args.no_load:
                base_url = args.url or f"http://127.0.0.1:{_port_from_cmdline(args.pid) or 8000}"
            print(f"engine core pid {core}; recording {args.seconds} s"
                  + ("" if base_url is None else f" under load {plan} at {base_url}"),
                  file=sys.stderr, flush=True)
            reports["run"] = profile_engine(core, out_dir, "run", seconds=args.seconds,
                                            base_url=base_url, plan=plan, warmup_s=args.warmup,
                                            rate=args.rate, py_spy=args.py_spy)
        else:
            py_spy_path(args.py_spy)  # fail before a minute of server start-up
            if args.model is None:
                from vllm_output_rate.tools.common.tiny_model import ensure_tiny_model

                args.model = str(ensure_tiny_model(Path(".cache") / "tiny-llama"))
            env = settings.child_env(FORCE_ASYNC_SCHEDULING=True) if args.async_scheduling else {}
            reports["on"] = _profile_new_server(args.model, True, args, out_dir, plan, env)
            if args.compare_off:
                reports["off"] = _profile_new_server(args.model, False, args, out_dir, plan, {})
    except ProfileError as exc:
        print(f"vllm-output-rate profile: {exc}", file=sys.stderr)
        return 1
    table = format_table(reports)
    print(table)
    (out_dir / "report.md").write_text(table)
    print(f"raw samples, speedscope files and JSON reports in {out_dir}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
