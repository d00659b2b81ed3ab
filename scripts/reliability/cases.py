"""What the reliability runners' cases are made of: a case's result, the
report (``report.md`` and ``report.json``), the server's limits, and the
live server as the cases talk to it (``Live``: requests, streams,
``/metrics``; ``wait_quiet``: the engine back to idle)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from vllm_output_rate.config import DEFAULT_OPTION, USER_FIELD, USERS_OPTION
from vllm_output_rate.telemetry.metrics import series_name

MODEL_NAME = "tiny"
#: the limits the runner serves with: a default that binds, one slow user
DEFAULT_LIMIT = 50
THROTTLED_USER = "stress-throttled"
THROTTLED_LIMIT = 5
MAX_MODEL_LEN = 1024
#: small enough that a long prompt is prefilled in several chunks
MAX_BATCHED_TOKENS = 256
#: the longest label value ``/metrics`` may carry (telemetry.labels)
LABEL_CAP = 64


def server_args() -> list[str]:
    return ["--max-num-seqs", "32", "--max-num-active-seqs", "16", "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS),
            DEFAULT_OPTION, str(DEFAULT_LIMIT),
            USERS_OPTION, json.dumps({THROTTLED_USER: THROTTLED_LIMIT})]


@dataclass
class CaseResult:
    group: str
    name: str
    sends: str
    expects: str
    measured: str = ""
    ok: bool = False
    seconds: float = 0.0


def progress_line(enabled: bool, text: str) -> None:
    """A line of progress on stderr, where verify draws its bar (none with
    ``--no-progress``); the runners' long runs are not silent."""
    if enabled:
        print(text, file=sys.stderr, flush=True)


@dataclass
class Report:
    model: str
    profile: str
    server_args: list[str]
    cases: list[CaseResult] = field(default_factory=list)
    started_unix: float = field(default_factory=time.time)

    @property
    def failed(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.ok]

    def add(self, cases: list[CaseResult], progress: bool) -> None:
        """Record ``cases``, with a progress line each."""
        for c in cases:
            self.cases.append(c)
            progress_line(progress, f"stress: {time.time() - self.started_unix:5.0f} s, {len(self.cases)} "
                                    f"cases ({len(self.failed)} failed): {'pass' if c.ok else 'FAIL'} "
                                    f"{c.group}: {c.name} ({c.seconds:.1f} s)")

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "profile": self.profile, "server_args": self.server_args,
                "started_unix": self.started_unix,
                "passed": len(self.cases) - len(self.failed), "failed": len(self.failed),
                "cases": [asdict(c) for c in self.cases]}

    def to_markdown(self) -> str:
        lines = [f"# Fault and bad-input matrix ({self.profile} profile)", "",
                 f"Model `{self.model}`; server flags `{' '.join(self.server_args)}`.", "",
                 f"{len(self.cases) - len(self.failed)} passed, {len(self.failed)} failed.", ""]
        groups: dict[str, list[CaseResult]] = {}
        for c in self.cases:
            groups.setdefault(c.group, []).append(c)
        for group, cases in groups.items():
            lines += [f"## {group}", "", "| case | sends | expects | measured | result |",
                      "|---|---|---|---|---|"]
            for c in cases:
                lines.append("| " + " | ".join(_cell(x) for x in (
                    c.name, c.sends, c.expects, c.measured, "pass" if c.ok else "**FAIL**")) + " |")
            lines.append("")
        return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:400]


def write_report(out_dir: Path, report: Any) -> None:
    """``report.json`` and ``report.md`` of a runner's report into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report.to_json(), indent=1))
    (out_dir / "report.md").write_text(report.to_markdown())


def model_and_logs(model: str | None) -> tuple[str, Path]:
    """The model to serve (``None``: the tiny model, made here) and the
    directory of the servers' logs."""
    from vllm_output_rate.tools.common.tiny_model import cache_dir, ensure_tiny_model

    log_dir = cache_dir() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    return model or str(ensure_tiny_model()), log_dir


# -- against a live server ---------------------------------------------------------


class Live:
    """A running server and the runner's HTTP client."""

    def __init__(self, base_url: str, client: httpx.AsyncClient) -> None:
        self.base_url = base_url
        self.client = client

    async def post(self, body: dict[str, Any]) -> tuple[int, Any]:
        """A non-streamed chat completion: (status, JSON body or text)."""
        resp = await self.client.post(f"{self.base_url}/v1/chat/completions", json=body)
        try:
            return resp.status_code, resp.json()
        except ValueError:
            return resp.status_code, resp.text

    async def stream(self, body: dict[str, Any], **kw: Any) -> Any:
        from vllm_output_rate.tools.common.client import StreamResult, stream_into

        rec = StreamResult(str(body.get("vllm_xargs", {}).get(USER_FIELD)), body.get("max_tokens", 0),
                           started=time.monotonic())
        try:
            await stream_into(self.client, self.base_url, body, rec, **kw)
        except Exception as exc:  # noqa: BLE001 - recorded
            rec.error = f"{type(exc).__name__}: {exc}"
        return rec

    async def metrics(self) -> tuple[dict[tuple[str, tuple[tuple[str, str], ...]], float], str]:
        from prometheus_client.parser import text_string_to_metric_families

        text = (await self.client.get(f"{self.base_url}/metrics")).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return samples, text

    async def charged(self, user: str) -> float:
        samples, _ = await self.metrics()
        name = series_name("tokens_charged")
        return sum(v for (n, labels), v in samples.items() if n == name and dict(labels).get("user") == user)


_ABSENT = object()


def body_for(user: Any = _ABSENT, max_tokens: int = 8, stream: bool = True, prompt: str = "Say hello.",
             **options: Any) -> dict[str, Any]:
    from vllm_output_rate.tools.common.client import chat_body

    body = chat_body(MODEL_NAME, prompt, max_tokens, None, **options)
    if not stream:
        body["stream"] = False
        body.pop("stream_options", None)
    if user is not _ABSENT:
        body["vllm_xargs"] = {USER_FIELD: user}
    return body


def _message(doc: Any) -> str:
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, dict):
            return str(err.get("message", err))[:200]
        return str(err)[:200]
    return str(doc)[:200]


async def wait_quiet(live: Live, timeout_s: float = 30.0) -> tuple[bool, str]:
    """Nothing running, waiting or throttled, the KV cache empty, and no
    user with live requests in the engine's view; (ok, what was seen)."""
    running = waiting = throttled = kv = None
    live_users: list[str] = []
    deadline = time.monotonic() + timeout_s
    while True:
        samples, _ = await live.metrics()

        def total(name: str) -> float:
            return sum(v for (n, _), v in samples.items() if n == name)

        running, waiting = total("vllm:num_requests_running"), total("vllm:num_requests_waiting")
        throttled = total(series_name("engine_throttled_requests"))
        kv = total("vllm:kv_cache_usage_perc")
        resp = await live.client.get(f"{live.base_url}/output-rate/users", params={"limit": 1000})
        users = resp.json().get("users", []) if resp.status_code == 200 else []
        live_users = [u.get("user", "?") for u in users
                      if u.get("running") or u.get("waiting") or u.get("throttled")]
        quiet = not (running or waiting or throttled or kv or live_users)
        if quiet or time.monotonic() > deadline:
            seen = (f"running {running:.0f}, waiting {waiting:.0f}, throttled {throttled:.0f}, "
                    f"KV usage {kv:.3f}, users with live requests {live_users[:5]}")
            return quiet, seen
        await asyncio.sleep(0.5)


def state_entries(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    """``vllm_output_rate_state_entries`` per container, from ``Live.metrics``
    samples (summed over engines)."""
    state: dict[str, float] = {}
    for (n, ls), v in samples.items():
        if n == series_name("state_entries"):
            container = dict(ls).get("container", "?")
            state[container] = state.get(container, 0.0) + v
    return state
