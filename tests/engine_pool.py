"""One engine per configuration for a test worker's session.

Scenarios that differ only in their limits share an engine: it serves from a
limits file (``--output-rate-limits-file``, reloaded live), and each user of
the pool writes the limits it needs and waits until the engine reports them
in force (``vllm_output_rate_limits_info`` with the file's sha256, exported
by the engine after the reload). Every pooled engine writes an event log; a
test reads what happened since it began (its own request ids, or token
times after a stamp taken before its load), never the whole log.

The modules that use the pool run on one test worker (tests/conftest.py,
``POOL_SCOPE``), so each configuration starts once per ``make test``.
tests/README.md, "Engine configurations", lists who shares which.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import REPO, tiny_model
from vllm_output_rate.tools.common.client import Server, metric_value, scrape_metrics

#: the shared flags: the tiny model with 16 sequences, 8 of them active, 1024 positions
TINY_ARGS = ("--max-num-seqs", "16", "--max-num-active-seqs", "8", "--max-model-len", "1024")


@dataclass(frozen=True)
class Config:
    name: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


#: the pooled configurations (tests/README.md: P-sync and P-async)
CONFIGS = {
    "tiny": Config("tiny", TINY_ARGS),
    # vLLM's --async-scheduling; the CPU platform turns it off, the plugin's
    # diagnostic switch turns it back on (the engine log names the class)
    "tiny-async": Config("tiny-async", (*TINY_ARGS, "--async-scheduling"),
                         (("OUTPUT_RATE_FORCE_ASYNC_SCHEDULING", "1"),)),
}


Limit = float | dict[str, Any]


def limit_yaml(limit: Limit) -> str:
    """A rate, or a pair ``{"rate": R, "ceiling": C}`` (C a number or
    ``"unlimited"``), as the limits file writes it."""
    if isinstance(limit, dict):
        return "{" + ", ".join(f"{k}: {v:g}" if not isinstance(v, str) else f"{k}: {v}"
                               for k, v in limit.items()) + "}"
    return f"{limit:g}"


def limits_yaml(default: Limit, users: dict[str, Limit]) -> str:
    lines = [f"default: {limit_yaml(default)}", "users:" if users else "users: {}"]
    lines += [f"  {user}: {limit_yaml(limit)}" for user, limit in users.items()]
    return "\n".join(lines) + "\n"


@dataclass
class PooledEngine:
    """A running pooled server, its limits file and its event log."""

    config: Config
    server: Server
    limits_path: Path
    events_path: Path
    starts: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def proc(self):
        return self.server.proc

    @property
    def log_path(self) -> Path:
        return self.server.log_path

    @property
    def extra_env(self) -> dict[str, str]:
        return self.server.extra_env

    def alive(self) -> bool:
        return self.server.proc is not None and self.server.proc.poll() is None

    def stop(self) -> None:
        """Stop the engine (a test that ends it mid-run); the pool starts a
        new one for the next user."""
        self.server.stop()

    def use_limits(self, default: Limit, users: dict[str, Limit], timeout_s: float = 30.0) -> None:
        """Write the limits file and return once the engine has them in
        force (its export names the file's digest)."""
        text = limits_yaml(default, users)
        digest = hashlib.sha256(text.encode()).hexdigest()
        in_force = metric_value(scrape_metrics(self.base_url), "vllm_output_rate_limits_info",
                                sha256=digest) == 1
        if in_force and self.limits_path.read_text() == text:
            return  # nothing to reload: no reload pending when this returns
        tmp = self.limits_path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.limits_path)
        deadline = time.monotonic() + timeout_s
        while metric_value(scrape_metrics(self.base_url), "vllm_output_rate_limits_info",
                           sha256=digest) != 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"limits not in force after {timeout_s}s: {text!r}; "
                                   f"log: {self.log_path}")
            time.sleep(0.2)

    def log_text_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def log_size(self) -> int:
        return self.log_path.stat().st_size


class EnginePool:
    """Started on first use, stopped at the end of the session."""

    def __init__(self, work_dir: Path, log_dir: Path = REPO / ".cache" / "logs"):
        self.work_dir, self.log_dir = Path(work_dir), Path(log_dir)
        self.engines: dict[str, PooledEngine] = {}

    def get(self, name: str, *, default: Limit, users: dict[str, Limit]) -> PooledEngine:
        """The engine of configuration ``name`` with these limits in force."""
        config = CONFIGS[name]
        engine = self.engines.get(name)
        if engine is None or not engine.alive():
            engine = self._start(config, default, users,
                                 starts=(engine.starts + 1) if engine else 1)
            self.engines[name] = engine
        engine.use_limits(default, users)
        return engine

    def _start(self, config: Config, default: Limit, users: dict[str, Limit],
               starts: int) -> PooledEngine:
        tag = f"{config.name}-{starts}"
        limits = self.work_dir / f"limits-{tag}.yaml"
        events = self.work_dir / f"events-{tag}.jsonl"
        limits.write_text(limits_yaml(default, users))
        env = {"OUTPUT_RATE_TELEMETRY": "1", "OUTPUT_RATE_EVENTS": str(events), **dict(config.env)}
        server = Server(tiny_model(), [*config.args, "--output-rate-limits-file", str(limits)],
                        self.log_dir / f"pool-{tag}.log", extra_env=env)
        server.start()
        return PooledEngine(config, server, limits, events, starts)

    def close(self) -> None:
        for engine in self.engines.values():
            engine.stop()
        self.engines.clear()
