"""The engine-core profile's samples: ``py-spy``'s raw collapsed stacks
parsed, each sample put in a category of the engine loop (``CATEGORIES``:
self and inclusive), the Markdown table and the speedscope file
(``vllm-output-rate profile``, ``bench.profile_engine``)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable


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
#: the scheduler's hook layer and the step it delegates to (the core, its
#: charges, plans, ledger and mixins)
_SCHEDULER_MODULES = ("scheduler.py", "core.py", "charges.py", "planners.py", "ledger.py",
                      "residency.py", "ordering.py", "lending.py", "preemption.py")
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
