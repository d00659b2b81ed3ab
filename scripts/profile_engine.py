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
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from vllm_output_rate import settings
from vllm_output_rate.tools.common.help_text import PlainHelpFormatter

#: categories in report order
CATEGORIES = (
    "schedule()",
    "limiter",
    "telemetry",
    "update_from_output()",
    "model wait",
    "idle wait",
    "input",
    "other",
)
SCHEDULE, LIMITER, TELEMETRY, UPDATE, MODEL, IDLE, INPUT, OTHER = CATEGORIES

#: the engine loop's frames: a thread whose stacks contain one of these is counted
ENGINE_LOOP_FUNCTIONS = ("run_busy_loop", "run_engine_core")

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


# -- raw samples ---------------------------------------------------------------

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
_THREAD = re.compile(r"^thread \((?P<tid>[^)]*)\)(?::\s*(?P<name>.*))?$")


@dataclass(frozen=True, slots=True)
class Frame:
    func: str
    file: str
    line: int | None = None

    @property
    def short(self) -> str:
        return self.func.rsplit(".", 1)[-1]


@dataclass(slots=True)
class Stack:
    thread: str | None
    frames: tuple[Frame, ...]  # root first
    count: int


def parse_frame(text: str) -> Frame:
    m = _FRAME.match(text)
    if m is None:
        return Frame(text, "")
    line = m.group("line")
    return Frame(m.group("func"), m.group("file"), int(line) if line else None)


def parse_raw(lines: Iterable[str]) -> list[Stack]:
    """py-spy's raw (collapsed) format: ``frame;frame;...;leaf COUNT``, root
    first; with ``--threads`` the first frame is ``thread (TID): NAME``."""
    stacks = []
    for raw in lines:
        raw = raw.rstrip("\n")
        if not raw.strip():
            continue
        body, _, count = raw.rpartition(" ")
        if not body or not count.isdigit():
            raise ValueError(f"not a py-spy raw sample line: {raw[:120]!r}")
        parts = body.split(";")
        thread = None
        m = _THREAD.match(parts[0])
        if m is not None:
            thread = (m.group("name") or m.group("tid")).strip()
            parts = parts[1:]
        stacks.append(Stack(thread, tuple(parse_frame(p) for p in parts), int(count)))
    return stacks


# -- classification --------------------------------------------------------------

#: The engine plugin's files, as a checkout (``vllm_patch/``, editable
#: install) or a wheel (``vllm_output_rate/``) names them.
_ENGINE_PKGS = ("vllm_patch/", "vllm_output_rate/")
#: the scheduler's mixin and what its steps call
_SCHEDULER_MODULES = ("scheduler.py", "ordering.py", "lending.py", "preemption.py")
_LIMITER_FILES = tuple(pkg + name for pkg in _ENGINE_PKGS
                       for name in (*_SCHEDULER_MODULES, "limiter.py", "config.py",
                                    "request_fields.py", "borrowing.py"))
_SCHEDULER_FILES = tuple(pkg + name for pkg in _ENGINE_PKGS for name in _SCHEDULER_MODULES)
_TELEMETRY_DIRS = ("telemetry/", "tracing/")
_SCHED_DIR = "vllm/v1/core/"
_MODEL_DIRS = ("vllm/v1/executor/", "vllm/v1/worker/", "vllm/model_executor/",
               "vllm/distributed/", "vllm/v1/sample/", "vllm/v1/attention/", "torch/")
_CORE_FILE = "vllm/v1/engine/core.py"
_ENGINE_LOOP_FILES = tuple(pkg + "engine_loop.py" for pkg in _ENGINE_PKGS)


def _in(file: str, suffix: str) -> bool:
    return file == suffix or file.endswith("/" + suffix)


def _under(file: str, prefix: str) -> bool:
    return file.startswith(prefix) or ("/" + prefix) in file


def _ours_or_vllm_scheduler(file: str) -> bool:
    return _under(file, "vllm/v1/core/sched/") or any(_in(file, f) for f in _SCHEDULER_FILES)


def classify(frames: tuple[Frame, ...]) -> tuple[str, frozenset[str]]:
    """(self category, inclusive categories) of one stack, root first."""
    self_cat: str | None = None
    phase: str | None = None
    inclusive: set[str] = set()
    last = len(frames) - 1
    for i, f in enumerate(frames):
        name, file = f.short, f.file
        parent = frames[i - 1] if i else None
        if name in ("schedule", "update_from_output") and _ours_or_vllm_scheduler(file):
            phase = SCHEDULE if name == "schedule" else UPDATE
            inclusive.add(phase)
            # the limiter's wrapper of schedule(): its own lines are the limiter's
            ours = any(_in(file, f) for f in _SCHEDULER_FILES)
            self_cat = LIMITER if (phase == SCHEDULE and ours) else phase
        elif name == "idle_wait" and any(_in(file, f) for f in _ENGINE_LOOP_FILES):
            phase = self_cat = IDLE
            inclusive.add(IDLE)
        elif name == "get" and _in(file, "queue.py") and parent is not None and (
            parent.short in ("_process_input_queue", "idle_wait")
        ):
            # the engine loop blocked on its input queue
            phase = self_cat = IDLE
            inclusive.add(IDLE)
        elif _in(file, _CORE_FILE) and name == "_process_engine_step" and i == last:
            # vLLM's time.sleep(0.001) after a step that ran no model (a C call:
            # no Python frame below it)
            self_cat = IDLE
            inclusive.add(IDLE)
        elif _in(file, _CORE_FILE) and name == "_process_input_queue":
            # runs every loop iteration; only its own lines and the requests it
            # hands on are input (its blocking get is the idle wait above)
            phase = self_cat = INPUT
        elif _in(file, _CORE_FILE) and name in ("_handle_client_request", "add_request",
                                               "abort_requests", "preprocess_add_request"):
            phase = self_cat = INPUT
            inclusive.add(INPUT)
        elif any(_in(file, p) for p in _LIMITER_FILES):
            self_cat = LIMITER
            inclusive.add(LIMITER)
        elif any(_under(file, d) for d in _TELEMETRY_DIRS) and not _under(file, "opentelemetry/"):
            self_cat = TELEMETRY
            inclusive.add(TELEMETRY)
        elif any(_under(file, d) for d in _MODEL_DIRS):
            phase = self_cat = MODEL
            inclusive.add(MODEL)
        elif _under(file, _SCHED_DIR):
            # vLLM's scheduler internals (KV cache manager, request queue, ...):
            # they count for the phase that called them
            if phase is not None:
                self_cat = phase
        # anything else (stdlib, vLLM glue) counts for its caller
    if self_cat is None:
        self_cat = OTHER
    inclusive.add(self_cat)
    return self_cat, frozenset(inclusive)


def is_engine_loop(stack: Stack) -> bool:
    return any(f.short in ENGINE_LOOP_FUNCTIONS for f in stack.frames)


@dataclass
class Report:
    """Sample counts per category of the engine loop's samples."""

    total: int = 0
    self_counts: Counter = field(default_factory=Counter)
    inclusive_counts: Counter = field(default_factory=Counter)
    #: samples with both schedule() and limiter on the stack
    limiter_in_schedule: int = 0
    #: samples under schedule() whose self category is the limiter
    limiter_self_in_schedule: int = 0
    #: the threads counted, and the samples of the threads not counted
    threads: list[str] = field(default_factory=list)
    other_threads: Counter = field(default_factory=Counter)
    #: context of the recording (seconds, rate, tokens during the recording, ...)
    meta: dict[str, Any] = field(default_factory=dict)

    def self_share(self, cat: str) -> float:
        return self.self_counts[cat] / self.total if self.total else 0.0

    def inclusive_share(self, cat: str) -> float:
        return self.inclusive_counts[cat] / self.total if self.total else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "samples": self.total,
            "threads_counted": self.threads,
            "other_thread_samples": dict(self.other_threads),
            "limiter_in_schedule_samples": self.limiter_in_schedule,
            "limiter_self_in_schedule_samples": self.limiter_self_in_schedule,
            "categories": {
                cat: {"self_samples": self.self_counts[cat],
                      "inclusive_samples": self.inclusive_counts[cat],
                      "self_share": self.self_share(cat),
                      "inclusive_share": self.inclusive_share(cat)}
                for cat in CATEGORIES
            },
            "meta": self.meta,
        }


def build_report(stacks: Iterable[Stack]) -> Report:
    report = Report()
    threads: list[str] = []
    for stack in stacks:
        if not is_engine_loop(stack):
            report.other_threads[stack.thread or "?"] += stack.count
            continue
        if stack.thread is not None and stack.thread not in threads:
            threads.append(stack.thread)
        self_cat, inclusive = classify(stack.frames)
        report.total += stack.count
        report.self_counts[self_cat] += stack.count
        for cat in inclusive:
            report.inclusive_counts[cat] += stack.count
        if SCHEDULE in inclusive and LIMITER in inclusive:
            report.limiter_in_schedule += stack.count
            if self_cat == LIMITER:
                report.limiter_self_in_schedule += stack.count
    report.threads = threads or ["(engine loop)"]
    return report


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def format_table(reports: dict[str, Report]) -> str:
    """Markdown table: self and inclusive share per category, one column pair per run."""
    names = list(reports)
    head = "| category | " + " | ".join(f"{n} self | {n} incl." for n in names) + " |"
    sep = "|---|" + "---:|---:|" * len(names)
    rows = [head, sep]
    for cat in CATEGORIES:
        cells = []
        for n in names:
            r = reports[n]
            cells += [_pct(r.self_share(cat)), _pct(r.inclusive_share(cat))]
        rows.append(f"| {cat} | " + " | ".join(cells) + " |")
    rows.append("| engine-loop samples | " + " | ".join(
        f"{r.total} | {r.total}" for r in reports.values()) + " |")
    lines = ["\n".join(rows), ""]
    for n, r in reports.items():
        sched = r.inclusive_counts[SCHEDULE]
        part = r.limiter_in_schedule / sched if sched else 0.0
        own = r.limiter_self_in_schedule / sched if sched else 0.0
        meta = r.meta
        bits = [f"{n}: {r.total} engine-loop samples ({', '.join(r.threads)})"]
        if "seconds" in meta:
            bits.append(f"{meta['seconds']} s at {meta.get('rate', '?')} Hz")
        if "tokens_per_s" in meta:
            bits.append(f"{meta['tokens_per_s']:.0f} output tok/s during the recording (client)")
        if sched:
            bits.append(f"of the {sched} schedule() samples, {_pct(own)} in the limiter's own "
                        f"code, {_pct(part)} with the limiter on the stack")
        lines.append("- " + "; ".join(bits))
    return "\n".join(lines) + "\n"


# -- speedscope ------------------------------------------------------------------

def to_speedscope(stacks: list[Stack], name: str) -> dict[str, Any]:
    """Speedscope's file format, one sampled profile per thread."""
    frames: list[dict[str, Any]] = []
    index: dict[Frame, int] = {}
    profiles: dict[str, dict[str, Any]] = {}
    for stack in stacks:
        ids = []
        for f in stack.frames:
            if f not in index:
                index[f] = len(frames)
                entry: dict[str, Any] = {"name": f.func, "file": f.file}
                if f.line is not None:
                    entry["line"] = f.line
                frames.append(entry)
            ids.append(index[f])
        thread = stack.thread or "all"
        prof = profiles.setdefault(thread, {
            "type": "sampled", "name": f"{name}: {thread}", "unit": "none",
            "startValue": 0, "endValue": 0, "samples": [], "weights": []})
        prof["samples"].append(ids)
        prof["weights"].append(stack.count)
        prof["endValue"] += stack.count
    ordered = sorted(profiles.values(), key=lambda p: "MainThread" not in p["name"])
    return {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": frames},
        "profiles": ordered,
        "name": name,
        "activeProfileIndex": 0,
        "exporter": "vllm-output-rate profile",
    }


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

    from vllm_output_rate.tools.common.client import stream_chat

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

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
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
