"""A small streaming client for the OpenAI-compatible server, and a server runner.

Used by the demo and the end-to-end tests: it records, for every streamed
chunk, when it arrived and how many completion tokens the server had counted
by then (``continuous_usage_stats``), so token counts are exact even when a
chunk carries no text.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol

import httpx

from vllm_output_rate import settings
from vllm_output_rate.config import ANONYMOUS_USER, USER_FIELD


#: idle connections are dropped after 2 s, before the server's keep-alive
#: (uvicorn's 5 s, httpx's own default is 5 s too) closes them: a request sent
#: on a connection the server is closing fails with a ReadError before it
#: reaches vLLM (seen under load, after pauses of a few seconds)
KEEPALIVE_EXPIRY_S = 2.0


def http_limits(max_connections: int | None = 256) -> httpx.Limits:
    """The connection limits of every client of the tools and tests."""
    return httpx.Limits(max_connections=max_connections,
                        max_keepalive_connections=max_connections,
                        keepalive_expiry=KEEPALIVE_EXPIRY_S)


@dataclass
class StreamResult:
    user: str
    max_tokens: int
    #: (arrival time in s, completion tokens counted so far) per chunk that
    #: added tokens, and the first chunk whatever it carried
    chunks: list[tuple[float, int]] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    started: float = 0.0

    @property
    def first(self) -> float | None:
        return next((t for t, n in self.chunks if n > 0), None)

    @property
    def last(self) -> float | None:
        return self.chunks[-1][0] if self.chunks else None


class StreamRecord(Protocol):
    """What ``stream_into`` fills in: ``StreamResult`` here,
    ``loadgen.RequestRecord`` for the load generator."""

    chunks: list[tuple[float, int]]
    completion_tokens: int
    prompt_tokens: int
    finish_reason: str | None
    error: str | None


class StreamError(Exception):
    """An error the server sent inside a stream it had answered with HTTP
    200 (vLLM: a ``data: {"error": {...}}`` line, then ``data: [DONE]``)."""


def parse_chunk(line: str) -> tuple[dict[str, Any], str | None] | None:
    """One server-sent-events line of a streamed completion: (usage, the
    last finish reason in it), or None for lines that carry no chunk.
    Raises StreamError for an error payload."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    data = json.loads(line[6:])
    if "error" in data or data.get("object") == "error":  # the latter: older vLLM
        err = data.get("error", data)
        if isinstance(err, dict):
            err = ": ".join(str(err[k]) for k in ("type", "message") if err.get(k))
        raise StreamError(str(err))
    finish = None
    for choice in data.get("choices") or ():
        if choice.get("finish_reason"):
            finish = choice["finish_reason"]
    return data.get("usage") or {}, finish


def _streamed_body(model: str, prompt: dict[str, Any], max_tokens: int, user: str | None,
                   ignore_eos: bool, options: dict[str, Any]) -> dict[str, Any]:
    """One streamed request's body with per-chunk usage (``continuous_usage_stats``):
    ``prompt`` is its messages or prompt field, ``options`` added as given, no
    user field for ``user`` None (the server's anonymous user)."""
    body: dict[str, Any] = {
        "model": model,
        **prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": ignore_eos,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        **options,
    }
    if user is not None:
        body["vllm_xargs"] = {USER_FIELD: user}
    return body


def chat_body(model: str, prompt: str, max_tokens: int, user: str | None,
              ignore_eos: bool = True, **options: Any) -> dict[str, Any]:
    """The body of one streamed chat completion with per-chunk usage
    (``continuous_usage_stats``); ``options`` (stop_token_ids, temperature,
    ...) are added as given; ``user`` None sends no user field (the server's
    anonymous user)."""
    return _streamed_body(model, {"messages": [{"role": "user", "content": prompt}]},
                          max_tokens, user, ignore_eos, options)


def completion_body(model: str, prompt_ids: list[int], max_tokens: int, user: str | None,
                    ignore_eos: bool = True) -> dict[str, Any]:
    """``chat_body``'s twin for ``/v1/completions``: one streamed completion
    of a prompt given as token ids, with per-chunk usage."""
    return _streamed_body(model, {"prompt": prompt_ids}, max_tokens, user, ignore_eos, {})


async def stream_into(
    client: httpx.AsyncClient,
    base_url: str,
    body: dict[str, Any],
    rec: StreamRecord,
    *,
    headers: dict[str, str] | None = None,
    on_tokens: Any = None,
    cancel_after_tokens: int | None = None,
    record_first_chunk: bool = False,
    path: str = "/v1/chat/completions",
) -> bool:
    """POST ``body`` to ``path`` (a streamed chat completion, or a
    completion at ``/v1/completions``) and record its stream into
    ``rec``: per chunk that added tokens its client arrival time (monotonic
    s) and the completion tokens counted so far (also the first chunk, with
    ``record_first_chunk``), the token and prompt-token counts, the finish
    reason; ``on_tokens(n)`` for every n new tokens. An HTTP status other
    than 200 goes into ``rec.error``; an error payload inside the stream
    raises StreamError, like any transport error, for the caller to record.

    With ``cancel_after_tokens``, closes the stream (the server aborts the
    request) once that many tokens came before a finish reason, and returns
    True; False otherwise."""
    async with client.stream("POST", f"{base_url}{path}", json=body,
                             headers=headers) as resp:
        if resp.status_code != 200:
            rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}"
            return False
        async for line in resp.aiter_lines():
            chunk = parse_chunk(line)
            if chunk is None:
                continue
            now = time.monotonic()
            usage, finish = chunk
            count = usage.get("completion_tokens", rec.completion_tokens)
            rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
            if finish:
                rec.finish_reason = finish
            if count > rec.completion_tokens or (record_first_chunk and not rec.chunks):
                rec.chunks.append((now, count))
            if count > rec.completion_tokens and on_tokens is not None:
                on_tokens(count - rec.completion_tokens)
            rec.completion_tokens = count
            if (cancel_after_tokens is not None and rec.finish_reason is None
                    and count >= cancel_after_tokens):
                return True  # leaving the block closes the connection: the server aborts
    return False


async def stream_chat(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    user: str | None,
    max_tokens: int,
    prompt: str = "Explain continuous batching.",
    ignore_eos: bool = True,
    on_tokens: Any = None,
) -> StreamResult:
    """One streaming chat completion; never raises (errors are recorded)."""
    body = chat_body(model, prompt, max_tokens, user, ignore_eos)
    result = StreamResult(user or ANONYMOUS_USER, max_tokens, started=time.monotonic())
    try:
        await stream_into(client, base_url, body, result, on_tokens=on_tokens,
                          record_first_chunk=True)
    except Exception as exc:  # recorded, never raised: one stream must not kill a run
        result.error = f"{type(exc).__name__}: {exc}"
    return result


@dataclass
class UserSummary:
    user: str
    limit: Fraction | None
    streams: int
    tokens: int
    span_s: float
    rate: float
    errors: int
    complete: int


def summarize(results: list[StreamResult], limits: dict[str, Fraction | None]) -> list[UserSummary]:
    """Per user: tokens, first-to-last-token span and rate over it."""
    by_user: dict[str, list[StreamResult]] = {}
    for r in results:
        by_user.setdefault(r.user, []).append(r)
    out = []
    for user, rs in by_user.items():
        firsts = [r.first for r in rs if r.first is not None]
        lasts = [r.last for r in rs if r.last is not None]
        tokens = sum(r.completion_tokens for r in rs)
        span = (max(lasts) - min(firsts)) if firsts and lasts else 0.0
        rate = (tokens - 1) / span if span > 0 else 0.0
        out.append(UserSummary(
            user, limits.get(user), len(rs), tokens, span, rate,
            sum(r.error is not None for r in rs),
            sum(r.completion_tokens == r.max_tokens and r.error is None for r in rs),
        ))
    return out


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape_metrics(base_url: str) -> Samples:
    """Every sample of the server's ``/metrics``: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric_value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(
        v for (n, ls), v in samples.items()
        if n == name and all(dict(ls).get(k) == want for k, want in labels.items())
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float, every_s: float) -> bool:
    """Poll ``url`` until it answers 200 (True), ``proc`` exits or
    ``timeout_s`` passes (False: the caller tells which)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, timeout=min(2.0, 2 * every_s)).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(every_s)
    return False


#: The tools' engines start with these vLLM flags unless their arguments name
#: them (or the environment sets ``VLLM_CPU_KVCACHE_SPACE``): on a 2-core CPU
#: a tiny model's start goes from about 53 s to about 19 s. ``--enforce-eager``
#: skips torch.compile's warm-up (recompiled at every start here); an explicit
#: 128 MiB KV cache (with eager mode, vLLM's CPU worker then also skips its
#: warm-up pass) spares zero-filling the 1 GiB the CPU platform takes by
#: default (about 9 s). ``--dtype float32``: the generated models' own dtype;
#: vLLM's CPU attention in bfloat16 takes its AMX kernels where the CPU
#: reports AMX, and a virtual machine that reports AMX without running it
#: (seen here: moved to another host while up) kills the model worker with
#: SIGILL at the first step; in float32 it takes the AVX-512 kernels. All are
#: plain ``vllm serve`` flags a user may pass; ``fast_start=False`` starts
#: with vLLM's defaults instead.
FAST_START_ARGS = ("--enforce-eager", "--kv-cache-memory-bytes", str(128 * 2**20),
                   "--dtype", "float32")


def fast_start_args(args: list[str], env: dict[str, str]) -> list[str]:
    """``FAST_START_ARGS`` that ``args`` and ``env`` leave open."""
    extra: list[str] = []
    if "--enforce-eager" not in args:
        extra.append("--enforce-eager")
    if not any(a.split("=", 1)[0] == "--kv-cache-memory-bytes" for a in args) \
            and not env.get("VLLM_CPU_KVCACHE_SPACE"):
        extra += list(FAST_START_ARGS[1:3])
    if not any(a.split("=", 1)[0] == "--dtype" for a in args):
        extra += list(FAST_START_ARGS[3:])
    return extra


class Server:
    """``vllm-output-rate serve`` in a subprocess, on loopback."""

    def __init__(self, model: str, args: list[str], log_path: str | os.PathLike[str],
                 port: int | None = None, extra_env: dict[str, str] | None = None,
                 command: list[str] | None = None, cwd: str | os.PathLike[str] | None = None,
                 fast_start: bool = True):
        self.model = model
        self.fast_start = fast_start
        #: how to run ``vllm-output-rate`` (default: this interpreter's)
        self.command = command or [sys.executable, "-m", "vllm_output_rate.tools.cli"]
        self.cwd = cwd
        self.extra_env = dict(extra_env or {})
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None

    def environment(self) -> dict[str, str]:
        """The server's environment: this process's, without what the plugin
        or telemetry set in it for engines of this process (their snapshot
        directory, the limits they checked: a server started from here must
        make its own), plus ``extra_env``."""
        env = dict(os.environ)
        for key in ("TELEMETRY_DIR", "ACTIVE_CONFIG"):
            env.pop(settings.name(key), None)
        if not self.fast_start:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        env.update(self.extra_env)
        return env

    def start(self, timeout_s: float = 300.0) -> Server:
        env = self.environment()
        fast = fast_start_args(self.args, env) if self.fast_start else []
        cmd = [*self.command, "serve", self.model,
               "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", "tiny", *self.args, *fast]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=self.cwd)
        if wait_ready(self.proc, f"{self.base_url}/health", timeout_s, 1.0):
            return self
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}; log: {self.log_path}\n"
                               + self.log_tail())
        self.stop()
        raise TimeoutError(f"server not ready after {timeout_s}s; log: {self.log_path}\n" + self.log_tail())

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is not None:
            # The API server is gone; what it started may not be (its
            # session is its process group): end them.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


async def run_load(base_url: str, plan: list[tuple[str | None, int, int]], model: str = "tiny",
                   progress: Any = None) -> list[StreamResult]:
    """Run ``plan`` = [(user, streams, max_tokens)] concurrently.

    ``progress`` (a tqdm bar, say) gets ``update(n)`` for every n tokens.
    """
    limits = http_limits(256)
    on_tokens = progress.update if progress is not None else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        return list(await asyncio.gather(*(
            stream_chat(client, base_url, model, user, max_tokens, on_tokens=on_tokens)
            for user, streams, max_tokens in plan
            for _ in range(streams)
        )))


def rss_mib(proc: Any) -> float:
    """The resident set of a ``psutil.Process`` in MiB (NaN when gone)."""
    try:
        return proc.memory_info().rss / 2**20 if proc is not None else float("nan")
    except Exception:  # noqa: BLE001 - gone
        return float("nan")
