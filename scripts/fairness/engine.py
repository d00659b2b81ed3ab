"""The fairness benchmark's arms on a real engine: the same scenarios as
the twin's (``fairness.scenarios``, ``figures`` and ``report``;
``arms.engine_runner`` calls ``run_arm`` here), driven through the OpenAI API of ``vllm-output-rate serve`` on vLLM's CPU engine, with the
gateway arm the real LiteLLM proxy.

``vllm-output-rate fairness --engine cpu [--model DIR] [--litellm BIN]
[--scenario NAME ...] [--arm NAME ...] --out DIR``

One engine per arm, started for the arm and stopped after it:

* ``fcfs``: ``--max-num-seqs R``, no limits (the feature off);
* ``priority``: the same with ``--scheduling-policy priority``, each
  request's ``priority`` its user's tier's;
* ``gateway``: the ``fcfs`` engine behind LiteLLM's proxy (``--litellm``:
  the ``litellm`` command of an environment with ``litellm[proxy]``), one
  API key per user with a ``tpm_limit`` of its guaranteed rate x 60 through
  a ``custom_auth`` hook (no database), output tokens counted
  (``token_rate_limit_type: output``); a refused request is its HTTP 429;
* ``capped`` / ``borrowing``: ``--max-num-seqs 4R --max-num-active-seqs R``
  and a limits file of the rates (with ``ceiling: unlimited``).

Requests are ``/v1/completions`` streams whose prompts are token ids (sizes
in tokens whatever the tokenizer), ``ignore_eos``, each user named by the
request's ``vllm_xargs.output_rate_user`` (through the gateway: by its key).
Times are the client's (sent, each chunk's arrival); this project's arms
also write the engine's event log, and their TTFT is measured engine-side
too (from the scheduler receiving the request to the step that sampled the
first token, on the same monotonic clock, matched by X-Request-Id:
``engine_ttft``), without the API server's work both ways, which on two
cores shared with the engine and the client grows with the tokens streamed. The run stops
``GRACE_S`` after the arrivals end and cancels what is left, so throughput
is over the busy window (from ``WARMUP_S`` to the end of the arrivals), not
the drain. Tokens borrowed come from the engine's ``/metrics``, scraped at
both ends of the busy window.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: the real engine's scale (``fairness.scenarios.ENGINE_SCALE``): R sequences a
#: step, six users, 30 s of arrivals; the scenarios' rates are sized on a
#: nominal capacity of R / STEP_S (a step time of the tiny model on a CPU
#: core with R sequences)
R, USERS, DURATION_S, STEP_S = 8, 6, 30.0, 0.02
#: this project's arms keep this many times R resident (as ``fairness.arms``)
RESIDENT = 4
NS = 1_000_000_000
#: seconds after the arrivals end before what is left is cancelled
GRACE_S = 10.0
USER_FIELD = "output_rate_user"
#: this project's arms (``fairness.arms.OURS``)
OURS = ("capped", "borrowing", "capped-prompt")
#: the gateway arms: LiteLLM's ``token_rate_limit_type`` of each
GATEWAYS = {"gateway": "output", "gateway-input": "input"}
METRIC_BORROWED = "vllm_output_rate_tokens_borrowed_total"

CUSTOM_AUTH = '''"""LiteLLM custom_auth for the fairness benchmark: key sk-user-NAME is user
NAME, its tpm_limit from LITELLM_GW_LIMITS (JSON {name: tokens a minute})."""
import json
import os

from fastapi import HTTPException, Request
from litellm.proxy._types import UserAPIKeyAuth

LIMITS = {k: int(v) for k, v in json.loads(os.environ.get("LITELLM_GW_LIMITS", "{}")).items()}


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    key = (api_key or "").strip()
    if key.lower().startswith("bearer "):
        key = key[7:].strip()
    name = key[len("sk-user-"):] if key.startswith("sk-user-") else None
    if name is None or name not in LIMITS:
        raise HTTPException(status_code=401, detail="invalid api key")
    return UserAPIKeyAuth(api_key=key, key_alias=name, tpm_limit=LIMITS[name])
'''


def litellm_config(upstream_port: int, count: str = "output") -> str:
    """The proxy's config: one model in front of the engine, the custom
    auth (a master key only because the proxy refuses to start without one;
    custom_auth answers every request first)."""
    return "\n".join([
        "model_list:",
        "  - model_name: tiny",
        f"    litellm_params: {{model: openai/tiny, api_base: 'http://127.0.0.1:{upstream_port}/v1',"
        " api_key: none}",
        "general_settings:",
        "  master_key: sk-fairness-bench-" + os.urandom(8).hex(),
        "  custom_auth: custom_auth.user_api_key_auth",
        f"  token_rate_limit_type: {count}",
        "  always_include_stream_usage: true",
        ""])


def gateway_limits(rates: dict[str, float]) -> dict[str, int]:
    """Each user's tpm_limit: its guaranteed rate x 60 (as the emulation)."""
    return {u: max(1, int(round(60 * r))) for u, r in rates.items()}


def serve_args(arm: str, r: int, limits_file: Path | None, threshold: int = 0) -> list[str]:
    args = ["--max-model-len", "1024"]
    if arm in OURS:
        assert limits_file is not None
        return args + ["--max-num-seqs", str(RESIDENT * r), "--max-num-active-seqs", str(r),
                       "--output-rate-limits-file", str(limits_file)]
    args += ["--max-num-seqs", str(r)]
    if arm == "priority":
        args += ["--scheduling-policy", "priority"]
    elif arm == "fcfs-threshold":
        args += ["--long-prefill-token-threshold", str(threshold)]
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Record:
    """One request as the client saw it."""
    user: str
    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    tokens: int = 0
    refused: bool = False
    error: str | None = None
    #: when the stream ended (its last line read; from the run's start
    #: once ``drive`` returns), None when the run was cut before
    ended: float | None = None
    #: its X-Request-Id (straight to the engine: the engine's request id
    #: wraps it) and when it was sent (monotonic ns, the event log's clock)
    cid: str = ""
    sent_ns: int = 0


def prompt_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    """``n`` token ids (sizes in tokens whatever the tokenizer; 0-2 left
    out: the usual special tokens)."""
    return [rng.randrange(3, vocab) for _ in range(n)]


async def _one(client: Any, url: str, line: dict[str, Any], body: dict[str, Any],
               headers: dict[str, str], rec: Record) -> None:
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code == 429:
                rec.refused = True
                await resp.aread()
                return
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return
            async for raw in resp.aiter_lines():
                if not raw.startswith("data: ") or raw == "data: [DONE]":
                    continue
                data = json.loads(raw[6:])
                now = time.monotonic()
                usage = data.get("usage") or {}
                if any(c.get("text") for c in data.get("choices") or ()):
                    # a chunk per token as it streams; the usage, when it
                    # comes per chunk (vLLM's continuous_usage_stats), counts
                    count = usage.get("completion_tokens") or rec.tokens + 1
                    if count > rec.tokens:
                        rec.chunks.append((now, count))
                        rec.tokens = count
                elif usage.get("completion_tokens", 0) > rec.tokens:
                    # the last chunk's usage: tokens whose text was empty
                    rec.tokens = usage["completion_tokens"]
                    rec.chunks.append((now, rec.tokens))
            rec.ended = time.monotonic()
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        rec.error = f"{type(exc).__name__}: {exc}"


async def drive(lines: list[dict[str, Any]], base_url: str, priority: dict[str, int], arm: str,
                vocab: int, duration_s: float, warmup_s: float, scrape: Any
                ) -> tuple[list[Record], float, dict]:
    """Send every line at its time; stop ``GRACE_S`` after the arrivals;
    scrape the engine's borrowed tokens at both ends of the busy window."""
    import httpx

    rng = random.Random(1)
    records: list[Record] = []
    scrapes: dict[str, dict[str, float]] = {}
    gateway = arm in GATEWAYS
    from vllm_output_rate.tools.common.client import http_limits

    limits = http_limits(None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.monotonic()
        tasks = []

        async def scrape_at(t: float, key: str) -> None:
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            scrapes[key] = await scrape(client)

        tasks.append(asyncio.create_task(scrape_at(warmup_s, "begin")))
        tasks.append(asyncio.create_task(scrape_at(duration_s, "end")))
        for line in sorted(lines, key=lambda x: x["t"]):
            await asyncio.sleep(max(0.0, start + line["t"] - time.monotonic()))
            user = line["user"]
            body: dict[str, Any] = {
                "model": "tiny", "prompt": prompt_ids(rng, line["prompt_tokens"], vocab),
                "max_tokens": line["max_tokens"], "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            headers = {}
            cid = ""
            if gateway:
                headers["Authorization"] = f"Bearer sk-user-{user}"
            else:
                body["vllm_xargs"] = {USER_FIELD: user}
                cid = headers["X-Request-Id"] = f"fair-{len(records)}-{user}"
            if arm == "priority" and user in priority:
                body["priority"] = priority[user]
            rec = Record(user, time.monotonic() - start, cid=cid, sent_ns=time.monotonic_ns())
            records.append(rec)
            tasks.append(asyncio.create_task(_one(client, f"{base_url}/v1/completions", line, body,
                                                  headers, rec)))
        await asyncio.sleep(max(0.0, start + duration_s + GRACE_S - time.monotonic()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = time.monotonic() - start
    for rec in records:  # chunk times from the run's start
        rec.chunks = [(t - start, n) for t, n in rec.chunks]
        if rec.ended is not None:
            rec.ended -= start
    return records, elapsed, scrapes


def result_of(records: list[Record], elapsed: float, scrapes: dict[str, dict[str, float]],
              duration_s: float, warmup_s: float) -> dict[str, Any]:
    """The shape ``fairness.figures`` reads (the twin's), from the client's
    records: per user tokens, refusals, TTFT and spacing samples (ns),
    tokens in the busy window and per second, each request's span (sent
    to its stream's end, None when cut); borrowed tokens from the scrapes."""
    users: dict[str, dict[str, int]] = defaultdict(lambda: {"output_tokens": 0, "refused": 0,
                                                          "borrowed_tokens": 0, "unstarted": 0})
    samples: dict[str, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    busy: dict[str, int] = defaultdict(int)
    spans: dict[str, list[tuple[float, float | None]]] = defaultdict(list)
    by_s: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for rec in records:
        u = users[rec.user]
        if not rec.refused and rec.error is None:
            spans[rec.user].append((rec.sent, rec.ended))
        u["refused"] += rec.refused
        u["output_tokens"] += rec.tokens
        ttft, itl = samples[rec.user]
        if not rec.chunks:
            if not rec.refused and rec.error is None:
                # no first token by the cut: a TTFT of at least its wait (censored)
                u["unstarted"] += 1
                ttft.append(int((elapsed - rec.sent) * NS))
            continue
        ttft.append(int((rec.chunks[0][0] - rec.sent) * NS))
        prev_t, prev_n = rec.chunks[0]
        for t, n in rec.chunks[1:]:
            itl += [int((t - prev_t) / (n - prev_n) * NS)] * (n - prev_n)
            prev_t, prev_n = t, n
        prev = 0
        for t, n in rec.chunks:
            if warmup_s <= t < duration_s:
                busy[rec.user] += n - prev
            by_s[rec.user][int(t)] += n - prev
            prev = n
    borrowed_busy = {}
    begin, end = scrapes.get("begin") or {}, scrapes.get("end") or {}
    for user in set(begin) | set(end):
        borrowed_busy[user] = int(end.get(user, 0) - begin.get(user, 0))
        users[user]["borrowed_tokens"] = int(end.get(user, 0))
    busy_by_s = {u: {int(warmup_s): n} for u, n in busy.items()}
    borrowed_by_s = {u: {int(warmup_s): n} for u, n in borrowed_busy.items()}
    return {"summary": {"users": dict(users), "run": {"virtual_s": elapsed, "wall_s": elapsed}},
            "samples": dict(samples),
            "busy_tokens": {u: sum(v.values()) for u, v in busy_by_s.items()},
            "busy_borrowed": {u: sum(v.values()) for u, v in borrowed_by_s.items()},
            "spans": dict(spans), "tokens_by_s": {u: dict(v) for u, v in by_s.items()}}


def borrowed_by_user(text: str) -> dict[str, float]:
    """``tokens_borrowed_total{user}`` from a /metrics text."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(METRIC_BORROWED + "{"):
            labels, value = line[len(METRIC_BORROWED) + 1:].rsplit("}", 1)
            for part in labels.split(","):
                key, _, val = part.partition("=")
                if key.strip() == "user":
                    user = val.strip().strip('"')
                    out[user] = out.get(user, 0.0) + float(value.split()[0])
    return out


class Gateway:
    """LiteLLM's proxy in front of ``upstream_port``: its config, the
    custom auth and the per-user limits written to ``work``."""

    def __init__(self, litellm: str, upstream_port: int, rates: dict[str, float], work: Path,
                 count: str = "output") -> None:
        work.mkdir(parents=True, exist_ok=True)
        (work / "custom_auth.py").write_text(CUSTOM_AUTH)
        (work / "config.yaml").write_text(litellm_config(upstream_port, count))
        self.port = _free_port()
        env = dict(os.environ, LITELLM_GW_LIMITS=json.dumps(gateway_limits(rates)),
                   LITELLM_LOCAL_MODEL_COST_MAP="True", PYTHONPATH=str(work))
        self.log = open(work / "litellm.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([litellm, "--config", str(work / "config.yaml"),
                                      "--port", str(self.port), "--host", "127.0.0.1"],
                                     cwd=work, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the LiteLLM proxy exited ({self.proc.returncode}); "
                                   f"see {self.log.name}")
            try:
                if httpx.get(f"{self.base_url}/health/liveliness", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the LiteLLM proxy did not answer in {timeout_s:.0f} s")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def run_arm(lines: list[dict[str, Any]], arm: str, work: Path, *, model: str, vocab: int,
            litellm: str | None, rates: dict[str, float], priority: dict[str, int],
            limits_text: str | None, r: int = R, duration_s: float = DURATION_S,
            warmup_s: float = 5.0, threshold: int = 0) -> dict[str, Any]:
    """One arm on a real engine (and, for the gateway arms, the proxy: its
    limits ``rates`` a second, x 60 a minute): the result in the twin's
    shape (``result_of``) and the errors counted."""
    import httpx

    from vllm_output_rate.tools.common.client import Server

    work.mkdir(parents=True, exist_ok=True)
    limits = None
    if limits_text is not None:
        limits = work / "limits.yaml"
        limits.write_text(limits_text)
    gateway = None
    ours = arm in OURS
    events = work / "events.jsonl"
    events.unlink(missing_ok=True)
    # this project's arms write the engine's event log: TTFT engine-side too
    env = {"OUTPUT_RATE_TELEMETRY": "1", "OUTPUT_RATE_EVENTS": str(events)} if ours else None
    with Server(model, serve_args(arm, r, limits, threshold), work / "engine.log",
                extra_env=env) as server:
        base_url = server.base_url
        if arm in GATEWAYS:
            if not litellm:
                raise RuntimeError(f"the {arm} arm needs --litellm (the litellm command of an "
                                   "environment with litellm[proxy])")
            gateway = Gateway(litellm, int(base_url.rsplit(":", 1)[1]), rates, work / "gateway",
                              GATEWAYS[arm])
            gateway.wait_ready()
            base_url = gateway.base_url

        async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
            try:
                resp = await client.get(f"{server.base_url}/metrics", timeout=10.0)
                return borrowed_by_user(resp.text)
            except httpx.HTTPError:
                return {}

        try:
            records, elapsed, scrapes = asyncio.run(drive(
                lines, base_url, priority, arm, vocab, duration_s, warmup_s, scrape))
        finally:
            if gateway is not None:
                gateway.close()
        if ours:
            wait_for_log(events)
    (work / "records.json").write_text(json.dumps(
        [{"user": rec.user, "sent": rec.sent, "tokens": rec.tokens, "refused": rec.refused,
          "error": rec.error, "chunks": rec.chunks, "ended": rec.ended, "id": rec.cid}
         for rec in records]))
    result = result_of(records, elapsed, scrapes, duration_s, warmup_s)
    result["errors"] = sum(1 for rec in records if rec.error)
    if ours and events.exists():
        result["engine_ttft"] = engine_ttft(events, records)
        result["engine_itl"] = engine_spacing(events, records)
    return result


def wait_for_log(path: Path, quiet_s: float = 2.5, most_s: float = 15.0) -> None:
    """Until the engine's exporter (about once a second) has appended
    nothing for ``quiet_s``: the run's last steps are in the log."""
    deadline, size, since = time.monotonic() + most_s, -1, time.monotonic()
    while time.monotonic() < deadline:
        now_size = path.stat().st_size if path.exists() else 0
        if now_size != size:
            size, since = now_size, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.25)


def engine_ttft(events: Path, records: list[Record]) -> dict[str, list[int]]:
    """Per user, each request's TTFT engine-side (ns): from the scheduler
    receiving it (its ``queued`` line; the client's send when the log has
    none) to the step that sampled its first token, in the engine's event
    log (the same monotonic clock). The API server's work both ways, which
    a busy 2-core machine makes long (1-2 s while the engine streams 600
    tok/s and more), is not in it."""
    from vllm_output_rate.telemetry.events import EngineLog
    from vllm_output_rate.tools.twin.calibrate import _matcher

    sent = {rec.cid: (rec.user, rec.sent_ns) for rec in records
            if rec.cid and not rec.refused and rec.error is None}
    ids = list(sent)
    match = _matcher({cid: i for i, cid in enumerate(ids)})
    log = EngineLog.read(events)
    since = {ids[i]: t for rid, (t, _) in log.queued.items() if (i := match(rid)) is not None}
    first: dict[str, int] = {}
    for rid, t in log.first_tokens().items():  # (in time order)
        i = match(rid)
        if i is not None and ids[i] not in first:
            first[ids[i]] = t
    out: dict[str, list[int]] = defaultdict(list)
    for cid, t in first.items():
        user, sent_ns = sent[cid]
        out[user].append(t - since.get(cid, sent_ns))
    return dict(out)


def engine_spacing(events: Path, records: list[Record]) -> dict[str, list[int]]:
    """Per user, the spacing of its requests' tokens engine-side (ns): from
    one step that gave a request tokens to the next (its tokens of a step
    sharing the wait), in the engine's event log, without the API server's
    work and the client's."""
    from vllm_output_rate.telemetry.events import EngineLog
    from vllm_output_rate.tools.twin.calibrate import _matcher

    ids = [rec.cid for rec in records if rec.cid and not rec.refused and rec.error is None]
    users = {rec.cid: rec.user for rec in records if rec.cid}
    match = _matcher({cid: i for i, cid in enumerate(ids)})
    last: dict[str, int] = {}
    out: dict[str, list[int]] = defaultdict(list)
    for t, tokens in EngineLog.read(events).steps:  # (in time order)
        for rid, _, k in tokens:
            i = match(rid) if k else None
            if i is None:
                continue
            cid = ids[i]
            if cid in last:
                out[users[cid]] += [(t - last[cid]) // k] * k
            last[cid] = t
    return dict(out)


def model_vocab(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def find_litellm(given: str | None) -> str | None:
    """The ``litellm`` command: as given, or on PATH."""
    if given:
        return given
    return shutil.which("litellm")
