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
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from vllm_output_rate.config import (
    DEFAULT_OPTION,
    LIMITS_FILE_OPTION,
    UNLISTED_OPTION,
    USER_FIELD,
    USERS_OPTION,
)
from vllm_output_rate.access import ADMIN_KEYS_OPTION, INTROSPECTION_OPTION
from vllm_output_rate.frontend import API_KEYS_OPTION, HEADER_OPTION, REQUIRE_OPTION
from vllm_output_rate.user_label import LABEL_OPTION, SALT_OPTION
from vllm_output_rate.shared_settings import SHARED_STATE_OPTION
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


# -- config: bad values refused at start-up ---------------------------------------


@dataclass(frozen=True)
class ConfigCase:
    name: str
    #: serve arguments after the model ({dir} is a scratch directory)
    args: tuple[str, ...]
    #: what the error must name (the option, the value or the file's key path)
    names: tuple[str, ...]
    #: files to write in the scratch directory first: name -> content
    files: tuple[tuple[str, str], ...] = ()


D, U, F = DEFAULT_OPTION, USERS_OPTION, LIMITS_FILE_OPTION
CONFIG_CASES: tuple[ConfigCase, ...] = (
    ConfigCase("default zero", (D, "0"), (D, "0")),
    ConfigCase("default negative", (D, "-5"), (D, "-5")),
    ConfigCase("default nan", (D, "nan"), (D, "nan")),
    ConfigCase("default inf", (D, "inf"), (D, "inf")),
    ConfigCase("default not a number", (D, "fast"), (D, "fast")),
    ConfigCase("default empty", (D, ""), (D,)),
    ConfigCase("default huge exponent", (D, "1e999"), (D, "1e999")),
    ConfigCase("overrides zero", (D, "10", U, '{"a": 0}'), (U, "a")),
    ConfigCase("overrides a list", (D, "10", U, "[1]"), (U,)),
    ConfigCase("overrides a string limit", (D, "10", U, '{"a": "x"}'), (U, "x")),
    ConfigCase("overrides not JSON", (D, "10", U, "{oops"), (U,)),
    ConfigCase("overrides without a default", (U, '{"a": 5}'), (U, D)),
    ConfigCase("limits file missing", (F, "{dir}/absent.yaml"), (F, "absent.yaml")),
    ConfigCase("limits file not YAML", (F, "{dir}/l.yaml"), (F, "l.yaml", "not valid YAML"),
               (("l.yaml", "default: [1, 2\n"),)),
    ConfigCase("limits file negative default", (F, "{dir}/l.yaml"), (F, "l.yaml", "default", "-1"),
               (("l.yaml", "default: -1\n"),)),
    ConfigCase("limits file unknown tier", (F, "{dir}/l.yaml"), (F, "l.yaml", "users.bob", "platinum"),
               (("l.yaml", "default: 5\ntiers: {gold: 100}\nusers: {bob: platinum}\n"),)),
    ConfigCase("limits file unknown key", (F, "{dir}/l.yaml"), (F, "l.yaml", "defualt"),
               (("l.yaml", "defualt: 5\n"),)),
    ConfigCase("limits file and default option", (F, "{dir}/l.yaml", D, "5"), (F, D),
               (("l.yaml", "default: 5\n"),)),
    ConfigCase("unlisted users mode", (D, "5", UNLISTED_OPTION, "everyone"), (UNLISTED_OPTION, "everyone")),
    ConfigCase("shared state not a redis URL", (D, "5", SHARED_STATE_OPTION, "http://127.0.0.1:6379"),
               (SHARED_STATE_OPTION, "http://127.0.0.1:6379")),
    ConfigCase("shared state without a port", (D, "5", SHARED_STATE_OPTION, "redis://127.0.0.1"),
               (SHARED_STATE_OPTION, "redis://127.0.0.1")),
    ConfigCase("shared state bad tick", (D, "5", SHARED_STATE_OPTION, "redis://127.0.0.1:6379?tick_ms=0"),
               (SHARED_STATE_OPTION, "tick_ms")),
    ConfigCase("user header not a header name", (D, "5", HEADER_OPTION, "X User"), (HEADER_OPTION, "X User")),
    ConfigCase("require user without a header", (D, "5", REQUIRE_OPTION), (REQUIRE_OPTION, HEADER_OPTION)),
    ConfigCase("identity options without limits", (HEADER_OPTION, "X-User-Id"), (HEADER_OPTION,)),
    ConfigCase("api keys file missing", (D, "5", API_KEYS_OPTION, "{dir}/absent-keys.yaml"),
               (API_KEYS_OPTION, "absent-keys.yaml")),
    ConfigCase("api keys file with a plain key", (D, "5", API_KEYS_OPTION, "{dir}/k.yaml"),
               (API_KEYS_OPTION, "k.yaml", "SHA-256"), (("k.yaml", "keys: {sk-plain-secret: alice}\n"),)),
    ConfigCase("admin keys file missing", (D, "5", ADMIN_KEYS_OPTION, "{dir}/absent-admin.yaml"),
               (ADMIN_KEYS_OPTION, "absent-admin.yaml")),
    ConfigCase("admin keys file with a plain key", (D, "5", ADMIN_KEYS_OPTION, "{dir}/a.yaml"),
               (ADMIN_KEYS_OPTION, "a.yaml", "SHA-256"), (("a.yaml", "keys: {ops-plain-secret: oncall}\n"),)),
    ConfigCase("introspection mode", (D, "5", INTROSPECTION_OPTION, "everyone"),
               (INTROSPECTION_OPTION, "everyone")),
    ConfigCase("introspection for operators without keys", (D, "5", INTROSPECTION_OPTION, "operators"),
               (INTROSPECTION_OPTION, "operators", "needs keys")),
    ConfigCase("admin keys without limits", (ADMIN_KEYS_OPTION, "{dir}/a.yaml"), (ADMIN_KEYS_OPTION,),
               (("a.yaml", "keys: {}\n"),)),
    ConfigCase("user label mode", (D, "5", LABEL_OPTION, "loud"), (LABEL_OPTION, "loud")),
    ConfigCase("hashed user label without a salt", (D, "5", LABEL_OPTION, "hashed"),
               (LABEL_OPTION, "hashed", SALT_OPTION)),
    ConfigCase("user label salt file missing", (D, "5", LABEL_OPTION, "hashed", SALT_OPTION, "{dir}/absent-salt"),
               (SALT_OPTION, "absent-salt")),
    ConfigCase("user label salt too short", (D, "5", LABEL_OPTION, "hashed", SALT_OPTION, "{dir}/salt"),
               (SALT_OPTION, "salt", "16 bytes"), (("salt", "abc\n"),)),
    ConfigCase("user label without limits", (LABEL_OPTION, "off"), (LABEL_OPTION,)),
    ConfigCase("prefill schedule interval", (D, "5", "--prefill-schedule-interval", "3"),
               ("--prefill-schedule-interval 3", D)),
)


def check_config_case(case: ConfigCase, model: str, scratch: Path) -> CaseResult:
    """Parse and check ``case``'s arguments as ``vllm-output-rate serve``
    does before it starts an engine; expect a refusal naming the option
    and the value."""
    import contextlib
    import io

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_output_rate.internals import serve_cli

    for name, content in case.files:
        (scratch / name).write_text(content)
    args = [a.replace("{dir}", str(scratch)) for a in case.args]
    result = CaseResult("config", case.name, config_sends(case),
                        "refused at start-up, naming " + ", ".join(f"`{n}`" for n in case.names))
    t0 = time.perf_counter()
    err = io.StringIO()
    message = None
    try:
        parser = serve_cli()[0](FlexibleArgumentParser())
        with contextlib.redirect_stderr(err):
            parsed = parser.parse_args(["--model", model, "--skip-tokenizer-init",
                                        "--max-model-len", str(MAX_MODEL_LEN), *args])
        AsyncEngineArgs.from_cli_args(parsed).create_engine_config()
    except SystemExit:  # argparse: usage and the message on stderr
        message = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "argparse exit"
    except Exception as exc:  # noqa: BLE001 - what was refused, and how
        message = f"{type(exc).__name__}: {exc}"
    finally:
        from vllm_output_rate.frontend import forget_identity

        forget_identity()  # the next case checks its own options
    result.seconds = time.perf_counter() - t0
    if message is None:
        result.measured = "accepted"
        return result
    result.ok = all(n in message for n in case.names) and "Traceback" not in message
    result.measured = message.replace(str(scratch), "{dir}")[:300]
    return result


def config_sends(case: ConfigCase) -> str:
    """The case's arguments as typed, and what its files hold."""
    text = " ".join(_quote(a) for a in case.args)
    for name, content in case.files:
        text += f"; {name}: {content.strip()}"
    return text


def _quote(arg: str) -> str:
    return f"'{arg}'" if not arg or any(c in arg for c in " {}[]\"'") else arg


def serve_refuses(case: ConfigCase, model: str, scratch: Path, log_dir: Path) -> CaseResult:
    """The full profile: a real ``vllm-output-rate serve`` with ``case``'s
    arguments exits non-zero, and its output names what the case names."""
    import subprocess

    for name, content in case.files:
        (scratch / name).write_text(content)
    args = [a.replace("{dir}", str(scratch)) for a in case.args]
    result = CaseResult("config (real server)", case.name, config_sends(case),
                        "the server exits 2 before loading the model, naming "
                        + ", ".join(f"`{n}`" for n in case.names) + ", no traceback")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "vllm_output_rate.tools.cli", "serve", model,
                               "--max-model-len", str(MAX_MODEL_LEN), "--port", "0", *args],
                              capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        result.measured = "still running after 180 s"
        return result
    result.seconds = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    log = log_dir / f"config-{case.name.replace(' ', '-')}.log"
    log.write_text(out)
    tail = [line for line in out.strip().splitlines() if line.strip()][-1:] or [""]
    result.measured = (f"exit {proc.returncode} after {result.seconds:.0f} s: "
                       + tail[0].replace(str(scratch), "{dir}")[:240])
    result.ok = proc.returncode == 2 and all(n in out for n in case.names) and "Traceback" not in out
    return result


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


#: name -> the user field's value; every one is served (200) or refused (400)
USER_FIELD_VALUES: tuple[tuple[str, Any], ...] = (
    ("empty string", ""),
    ("10,000 characters", "u" * 10_000),
    ("control characters and quotes", 'a\x00b\x07c\n"d\'\\e'),
    ("emoji", "user-\U0001F600-\u00e9\u4e2d"),
    ("integer", 12345),
    ("float", 1.5),
    ("boolean", True),
    ("list", ["a", "b"]),
    ("object", {"id": "a"}),
    ("null", None),
    ("absent", _ABSENT),
)


async def user_field_cases(live: Live, streams: tuple[bool, ...]) -> list[CaseResult]:
    out = []
    for stream in streams:
        for name, value in USER_FIELD_VALUES:
            mode = "streamed" if stream else "not streamed"
            shown = "absent" if value is _ABSENT else json.dumps(value)[:60]
            case = CaseResult("user_field", f"{name} ({mode})",
                              f"vllm_xargs.{USER_FIELD} = {shown}, max_tokens 4",
                              "HTTP 200 with 4 tokens, or 400 with a message; never 5xx")
            t0 = time.perf_counter()
            body = body_for(value, 4, stream)
            if stream:
                rec = await live.stream(body)
                status = int(rec.error.split()[1].rstrip(":")) if rec.error and rec.error.startswith("HTTP ") \
                    else (200 if rec.error is None else 0)
                ok = (status == 200 and rec.completion_tokens == 4) or (status == 400)
                case.measured = (f"HTTP {status}, {rec.completion_tokens} tokens" if status == 200
                                 else (rec.error or "")[:200])
            else:
                status, doc = await live.post(body)
                tokens = doc.get("usage", {}).get("completion_tokens") if isinstance(doc, dict) else None
                ok = (status == 200 and tokens == 4) or status == 400
                case.measured = f"HTTP {status}, {tokens} tokens" if status == 200 else \
                    f"HTTP {status}: {_message(doc)}"
            case.ok = ok
            case.seconds = time.perf_counter() - t0
            out.append(case)
    case = CaseResult("user_field", "/metrics afterwards", "GET /metrics after the next telemetry export",
                      "parses (Prometheus text format); the served users labelled, every user label "
                      f"at most {LABEL_CAP} characters")
    try:
        await asyncio.sleep(2.5)  # the engine exports about once a second
        samples, _text = await live.metrics()
        labels = {dict(ls).get("user") for (_, ls) in samples if dict(ls).get("user") is not None}
        longest = max((len(v) for v in labels), default=0)
        case.measured = f"{len(samples)} samples, {len(labels)} user labels, longest {longest} characters"
        # the long and the odd ids hold labels (seats are free), cut and escaped
        case.ok = longest <= LABEL_CAP and longest == LABEL_CAP and len(labels) >= 5
    except Exception as exc:  # noqa: BLE001
        case.measured = f"{type(exc).__name__}: {exc}"[:300]
    out.append(case)
    return out


def _message(doc: Any) -> str:
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, dict):
            return str(err.get("message", err))[:200]
        return str(err)[:200]
    return str(doc)[:200]


async def request_cases(live: Live) -> list[CaseResult]:
    from vllm_output_rate.tools.loadgen.prompts import text_of_tokens

    out: list[CaseResult] = []

    async def run(name: str, sends: str, expects: str,
                  check: Callable[[CaseResult], Awaitable[bool]]) -> None:
        case = CaseResult("requests", name, sends, expects)
        t0 = time.perf_counter()
        try:
            case.ok = await check(case)
        except Exception as exc:  # noqa: BLE001 - a case that raised failed
            case.measured = f"{type(exc).__name__}: {exc}"[:300]
        case.seconds = time.perf_counter() - t0
        out.append(case)

    async def n_samples(case: CaseResult) -> bool:
        user, n, tokens = "stress-n", 3, 12
        before = await live.charged(user)
        status, doc = await live.post(body_for(user, tokens, False, n=n, temperature=1.0))
        await asyncio.sleep(2.5)  # one telemetry export
        charged = await live.charged(user) - before
        got = doc.get("usage", {}).get("completion_tokens") if isinstance(doc, dict) else None
        case.measured = f"HTTP {status}, {len(doc.get('choices', [])) if isinstance(doc, dict) else 0} choices, " \
                        f"usage {got} tokens, engine charged {charged:.0f}"
        return status == 200 and got == n * tokens and charged == n * tokens

    await run("n > 1", f"n=3, max_tokens 12, user stress-n (limit {DEFAULT_LIMIT})",
              "HTTP 200, 3 choices, every sample charged (36 tokens)", n_samples)

    async def n_samples_rate(case: CaseResult) -> bool:
        n, tokens = 3, 8
        rec = await live.stream(body_for(THROTTLED_USER, tokens, True, n=n, temperature=1.0))
        got = rec.completion_tokens
        # the window from sending to the last chunk holds the engine's span
        # however late chunks reach this process: the GCRA bound over it
        # (three samples with a budget each would need a third of it); how
        # close to the limit the samples came is the engine's to say (the
        # exact rate is checked in virtual time), not this client's
        span = (rec.chunks[-1][0] - rec.started) if rec.chunks else 0.0
        rate = got / span if span > 0 else float("inf")
        bound = (span + 0.1) * THROTTLED_LIMIT + 1
        case.measured = (f"{rec.error or 'HTTP 200'}, {got} tokens in {span:.2f} s from sending: "
                         f"{rate:.2f} tok/s (bound {bound:.1f} tokens in that window)")
        return rec.error is None and got == n * tokens and got <= bound

    await run("n > 1 at the user's limit",
              f"n=3, max_tokens 8, streamed, user {THROTTLED_USER} ({THROTTLED_LIMIT} tok/s)",
              "HTTP 200, 24 tokens; the three samples share the user's budget: its limit, "
              "the GCRA bound over the span", n_samples_rate)

    async def structured(case: CaseResult) -> bool:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        t0 = time.monotonic()
        status, doc = await live.post(body_for(THROTTLED_USER, 16, False, response_format=rf,
                                               ignore_eos=False))
        took = time.monotonic() - t0
        if status != 200:
            case.measured = f"HTTP {status}: {_message(doc)}"
            return False
        choice = doc["choices"][0]
        tokens = doc["usage"]["completion_tokens"]
        text = choice["message"]["content"] or ""
        valid = None
        if choice["finish_reason"] == "stop":
            try:
                valid = isinstance(json.loads(text), dict)
            except ValueError:
                valid = False
        case.measured = (f"HTTP 200, {tokens} tokens in {took:.1f} s, finish {choice['finish_reason']}"
                         + ("" if valid is None else f", JSON {'valid' if valid else 'INVALID'}"))
        # paced at the user's limit (GCRA: burst of one token plus 100 ms)
        return valid is not False and took >= (tokens - 1) / THROTTLED_LIMIT - 0.2

    await run("structured output, throttled user",
              f"response_format json_schema, max_tokens 16, user {THROTTLED_USER} ({THROTTLED_LIMIT} tok/s)",
              "HTTP 200, paced at the user's limit; JSON that parses when it finished", structured)

    too_long = await text_of_tokens(live.client, live.base_url, MODEL_NAME, MAX_MODEL_LEN + 50, 7)

    async def long_prompt(case: CaseResult) -> bool:
        status, doc = await live.post(body_for("stress-long", 4, False, prompt=too_long))
        case.measured = f"HTTP {status}: {_message(doc)}"
        return status == 400 and ("length" in _message(doc).lower() or "token" in _message(doc).lower())

    await run("prompt longer than the model", f"a prompt of {MAX_MODEL_LEN + 50} tokens "
              f"(max_model_len {MAX_MODEL_LEN})", "HTTP 400 naming the length", long_prompt)

    chunked = await text_of_tokens(live.client, live.base_url, MODEL_NAME, 3 * MAX_BATCHED_TOKENS, 8)

    async def chunked_prefill(case: CaseResult) -> bool:
        rec = await live.stream(body_for(THROTTLED_USER, 6, True, prompt=chunked))
        case.measured = (f"{rec.error or 'HTTP 200'}, prompt {rec.prompt_tokens} tokens, "
                         f"{rec.completion_tokens} completion tokens")
        return rec.error is None and rec.completion_tokens == 6 and rec.prompt_tokens > 2 * MAX_BATCHED_TOKENS

    await run("long prompt under chunked prefill, throttled user",
              f"a prompt of {3 * MAX_BATCHED_TOKENS} tokens (--max-num-batched-tokens "
              f"{MAX_BATCHED_TOKENS}), max_tokens 6, user {THROTTLED_USER}",
              "HTTP 200 with 6 tokens", chunked_prefill)

    async def one_token(case: CaseResult) -> bool:
        rec = await live.stream(body_for(THROTTLED_USER, 1))
        case.measured = f"{rec.error or 'HTTP 200'}, {rec.completion_tokens} tokens, finish {rec.finish_reason}"
        return rec.error is None and rec.completion_tokens == 1 and rec.finish_reason == "length"

    await run("max_tokens 1", f"max_tokens 1, streamed, user {THROTTLED_USER}",
              "HTTP 200, 1 token, finish length", one_token)

    async def not_streamed(case: CaseResult) -> bool:
        status, doc = await live.post(body_for("stress-plain", 20, False))
        tokens = doc.get("usage", {}).get("completion_tokens") if isinstance(doc, dict) else None
        case.measured = f"HTTP {status}, {tokens} tokens"
        return status == 200 and tokens == 20

    await run("not streamed", "stream false, max_tokens 20", "HTTP 200 with 20 tokens", not_streamed)

    async def stop_strings(case: CaseResult) -> bool:
        rec = await live.stream(body_for("stress-stop", 30, True, stop=["e", "a", " "],
                                         ignore_eos=False))
        case.measured = (f"{rec.error or 'HTTP 200'}, {rec.completion_tokens} tokens, "
                         f"finish {rec.finish_reason}")
        return rec.error is None and rec.finish_reason in ("stop", "length") and rec.completion_tokens <= 30

    await run("stop strings", "stop ['e', 'a', ' '], max_tokens 30", "HTTP 200, finish stop or length",
              stop_strings)

    async def beam(case: CaseResult) -> bool:
        status, doc = await live.post(body_for("stress-beam", 4, False, use_beam_search=True, n=2))
        case.measured = f"HTTP {status}: {_message(doc)}"
        return status == 400 and "beam" in _message(doc).lower()

    await run("beam search", "use_beam_search true, n 2", "HTTP 400 with the reason", beam)
    return out


# -- client faults ----------------------------------------------------------------


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


async def client_fault_cases(live: Live, cancels: int) -> list[CaseResult]:
    from vllm_output_rate.tools.loadgen.prompts import text_of_tokens

    out = []

    async def run(name: str, sends: str, expects: str, act: Callable[[CaseResult], Awaitable[bool]]) -> None:
        case = CaseResult("client_faults", name, sends, expects)
        t0 = time.perf_counter()
        try:
            acted = await act(case)
            quiet, seen = await wait_quiet(live)
            case.measured = (case.measured + "; after: " if case.measured else "after: ") + seen
            case.ok = acted and quiet
        except Exception as exc:  # noqa: BLE001
            case.measured = f"{type(exc).__name__}: {exc}"[:300]
        case.seconds = time.perf_counter() - t0
        out.append(case)

    users = [f"stress-cancel-{i % 10}" for i in range(cancels)]

    async def cancel_after_first(case: CaseResult) -> bool:
        recs = await asyncio.gather(*(live.stream(body_for(u, 200), cancel_after_tokens=1)
                                      for u in users))
        got = sum(1 for r in recs if r.completion_tokens >= 1)
        case.measured = f"{got} of {len(recs)} streams cancelled after their first token"
        return got == len(recs) and not any(r.error for r in recs)

    await run(f"{cancels} throttled streams cancelled after the first token",
              f"{cancels} streams of 10 users ({DEFAULT_LIMIT} tok/s each), max_tokens 200, "
              "closed after the first token",
              "nothing running, waiting or throttled; KV usage 0; no user with live requests",
              cancel_after_first)

    async def slow_consumers(case: CaseResult) -> bool:
        async def one(i: int) -> int:
            body = body_for(THROTTLED_USER, 40)
            async with live.client.stream("POST", f"{live.base_url}/v1/chat/completions", json=body) as resp:
                lines = resp.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        break
                await asyncio.sleep(3.0)  # stops reading; the server keeps generating
            return resp.status_code

        statuses = await asyncio.gather(*(one(i) for i in range(8)))
        case.measured = f"statuses {sorted(set(statuses))}"
        return all(s == 200 for s in statuses)

    await run("slow consumers", f"8 streams of {THROTTLED_USER}, max_tokens 40, no reads for 3 s, "
              "then closed", "nothing running, waiting or throttled afterwards", slow_consumers)

    long_text = await text_of_tokens(live.client, live.base_url, MODEL_NAME, 3 * MAX_BATCHED_TOKENS, 9)

    async def dropped_mid_prefill(case: CaseResult) -> bool:
        async def one() -> str:
            body = body_for(THROTTLED_USER, 50, prompt=long_text)
            try:
                async with live.client.stream("POST", f"{live.base_url}/v1/chat/completions",
                                              json=body, timeout=httpx.Timeout(0.05, connect=5.0)) as resp:
                    async for _line in resp.aiter_lines():
                        return "answered before the drop"
            except httpx.TimeoutException:
                return "dropped"
            return "closed"

        outcomes = await asyncio.gather(*(one() for _ in range(6)))
        case.measured = f"{outcomes.count('dropped')} of {len(outcomes)} connections dropped mid-prefill"
        return outcomes.count("dropped") >= 1

    await run("connections dropped mid-prefill",
              f"6 requests with {3 * MAX_BATCHED_TOKENS}-token prompts, the client gives up after 50 ms",
              "nothing running, waiting or throttled afterwards", dropped_mid_prefill)
    return out


# -- identity churn, without a server ---------------------------------------------------


def identity_churn(n_users: int, model: str | None = None, batch: int = 256, limit: int = 20,
                   max_tokens: int = 4) -> CaseResult:
    """``n_users`` distinct user ids, ``batch`` new ones per step, each with
    one request of ``max_tokens`` tokens, through the real scheduler and
    KV cache manager with the engine telemetry attached (no server: a fake
    clock, 10 ms steps, an export every 100 steps as the exporter's second).
    At ``limit`` tok/s a user's last token waits for its budget (the burst
    lets ``1 + 0.1 x limit`` through), so throttle episodes open and close
    too. Expected: the ``user`` label capped, no per-request state left,
    per-user state bounded, the limiter's users dropped once idle, and the
    process' memory flat over the second half of the run."""
    import gc

    import psutil

    from vllm_output_rate.scheduler import CLEANUP_EVERY_STEPS
    from vllm_output_rate.telemetry.books import USER_STATES_CAP
    from vllm_output_rate.tools.common.scheduler_driver import (
        VirtualClock,
        attach_telemetry,
        make_request,
        make_scheduler,
        model_output_for,
    )

    case = CaseResult("identity_churn", f"{n_users:,} distinct user ids",
                      f"{n_users:,} users, {batch} new per 10 ms step, one request of {max_tokens} "
                      f"tokens each at {limit} tok/s; real scheduler and telemetry, fake clock",
                      "user label capped; no per-request state left; per-user state bounded; "
                      "limiter users dropped when idle; RSS flat over the second half")
    t0 = time.perf_counter()
    clock = VirtualClock()
    in_flight = batch * (2 + max_tokens * 100 // max(1, limit))
    sched = make_scheduler({"default_user_output_tokens_per_second": limit}, clock=clock, model=model,
                           max_num_seqs=in_flight, max_num_batched_tokens=16 * in_flight,
                           num_blocks=2 * in_flight + 64)
    proc = psutil.Process()
    with tempfile.TemporaryDirectory(prefix="output-rate-churn-") as out_dir:
        tel = attach_telemetry(sched, out_dir, start_thread=False)
        steps = 0

        def step() -> None:
            nonlocal steps
            out = sched.schedule()
            sched.update_from_output(out, model_output_for(sched, out))
            clock.advance_ms(10)
            steps += 1
            if steps % 100 == 0:
                tel.export()

        rss: dict[str, float] = {}
        marks = {"warm": n_users // 10, "half": n_users // 2}
        added = 0
        peak_sizes: dict[str, int] = {}
        peak_limiter = 0
        while added < n_users:
            k = min(batch, n_users - added)
            for i in range(k):
                sched.add_request(make_request(f"churn-{added + i}", prompt_len=8, max_tokens=max_tokens))
            before, added = added, added + k
            step()
            for name, at in marks.items():
                if before < at <= added:
                    gc.collect()
                    rss[name] = proc.memory_info().rss / 2**20
            if steps % 50 == 0:
                peak_limiter = max(peak_limiter, len(sched.output_rate_limiter))
                for key, v in tel.state_sizes().items():
                    peak_sizes[key] = max(peak_sizes.get(key, 0), v)
        while sched.has_requests():
            step()
        tel.export()
        gc.collect()
        rss["end"] = proc.memory_info().rss / 2**20
        # idle, past every user's budget; then one request and enough steps
        # for the limiter's periodic cleanup
        clock.advance_ms(2000)
        sched.add_request(make_request("churn-last", prompt_len=8, max_tokens=CLEANUP_EVERY_STEPS + 1))
        for _ in range(CLEANUP_EVERY_STEPS + 2):
            step()
        tel.export()
        sizes = tel.state_sizes()
        limiter_users = len(sched.output_rate_limiter)
        labels = sizes["labels"]
        cap = tel.labeler.top_k + len(tel.labeler.pinned) + 1
    per_request = {k: v for k, v in sizes.items() if k.startswith("requests.") and v > 1}
    bound = {k: v for k, v in peak_sizes.items() if k.startswith("users.")}
    # per-user state may hold the users of one export interval (100 steps)
    # and the introspection cap, whatever the number of ids
    per_user_cap = 2 * batch * 100 + 61 * USER_STATES_CAP
    # the limiter drops idle users every CLEANUP_EVERY_STEPS steps: it may
    # hold the users of that many steps, and the live ones
    limiter_cap = (CLEANUP_EVERY_STEPS + 1) * batch + in_flight
    growth = rss["end"] - rss["half"]
    case.seconds = time.perf_counter() - t0
    case.measured = (f"{steps} steps in {case.seconds:.0f} s; user labels {labels} (cap {cap}); "
                     f"per-request entries left {sum(v for k, v in sizes.items() if k.startswith('requests.'))} "
                     f"(the one live request's); per-user entries at most {max(bound.values(), default=0)} "
                     f"(bound {per_user_cap}, whatever the number of ids); "
                     f"limiter users at most {peak_limiter} during (bound {limiter_cap}), {limiter_users} after idle; "
                     f"RSS {rss['warm']:.0f} MiB at 10%, {rss['half']:.0f} at 50%, {rss['end']:.0f} at the end "
                     f"(+{growth:.1f} MiB over the second half)")
    case.ok = (labels <= cap and not per_request and limiter_users <= 1
               and max(bound.values(), default=0) <= per_user_cap
               and peak_limiter <= limiter_cap and growth <= 64)
    return case


def state_entries(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    """``vllm_output_rate_state_entries`` per container, from ``Live.metrics``
    samples (summed over engines)."""
    state: dict[str, float] = {}
    for (n, ls), v in samples.items():
        if n == series_name("state_entries"):
            container = dict(ls).get("container", "?")
            state[container] = state.get(container, 0.0) + v
    return state


async def http_churn_case(live: Live, n_users: int, server_pid: int) -> CaseResult:
    """``n_users`` distinct user ids through a real server (16 requests at a
    time, 2 tokens each): every request served, the ``user`` label capped,
    the engine core's own state back to empty or bounded once quiet, its
    RSS flat (read with psutil; state sizes from ``/metrics``)."""
    import psutil

    from vllm_output_rate import settings
    from vllm_output_rate.scheduler import CLEANUP_EVERY_STEPS
    from vllm_output_rate.telemetry.books import USER_STATES_CAP
    from vllm_output_rate.tools.common.client import rss_mib
    from vllm_output_rate.tools.profile_engine import find_engine_core

    top_k = int(settings.get_or_default("TOP_K_USERS"))
    label_cap = top_k + 2  # the top users, the configured one, the overflow bucket
    case = CaseResult(
        "identity_churn", f"{n_users:,} ids through the server",
        f"{n_users} non-streamed requests, max_tokens 2, each with a user id of its own, 16 at a time",
        f"every request HTTP 200; at most {label_cap} user labels on /metrics; once quiet the "
        "per-request state empty, per-user state bounded; the limiter's idle users dropped "
        "once the engine runs again (one more stream); engine-core RSS growth <= 64 MiB")
    t0 = time.perf_counter()
    try:
        engine = psutil.Process(find_engine_core(server_pid, timeout_s=30))
        gate = asyncio.Semaphore(16)

        async def one(user: str) -> int:
            async with gate:
                status, _ = await live.post(body_for(user, 2, False))
                return status

        await asyncio.gather(*(one(f"churn-warm-{i}") for i in range(64)))  # allocator warm-up
        await asyncio.sleep(2.5)
        rss_before = rss_mib(engine)
        statuses = await asyncio.gather(*(one(f"churn-http-{i}") for i in range(n_users)))
        quiet, seen = await wait_quiet(live)
        await asyncio.sleep(2.5)  # one export after going quiet
        rss_after = rss_mib(engine)
        idle_users = state_entries((await live.metrics())[0]).get("limiter.users", -1.0)
        # the limiter drops idle users every CLEANUP_EVERY_STEPS steps of the
        # engine (an idle engine runs none): one more stream, longer than
        # that, and the churned ids are gone
        status, _ = await live.post(body_for("churn-after", CLEANUP_EVERY_STEPS + 44, False))
        await asyncio.sleep(2.5)
        samples, _ = await live.metrics()
        users = {dict(ls).get("user") for (n, ls), _ in samples.items() if n == series_name("tokens_charged")}
        state = state_entries(samples)
        per_request = sum(v for k, v in state.items() if k.startswith("requests."))
        per_user = max((v for k, v in state.items() if k.startswith("users.")), default=0.0)
        limiter = state.get("limiter.users", -1.0)
        ok_status = sum(1 for st in statuses if st == 200)
        growth = rss_after - rss_before
        case.measured = (f"{ok_status}/{n_users} HTTP 200; {len(users)} user labels; after: {seen}; "
                         f"limiter users {idle_users:.0f} while idle, {limiter:.0f} after a "
                         f"{CLEANUP_EVERY_STEPS + 44}-token stream (HTTP {status}); per-request "
                         f"state {per_request:.0f}, largest per-user {per_user:.0f}; engine-core RSS "
                         f"{rss_before:.0f} -> {rss_after:.0f} MiB ({growth:+.1f})")
        case.ok = (ok_status == n_users and status == 200 and len(users) <= label_cap and quiet
                   and bool(state) and per_request == 0 and per_user <= 61 * USER_STATES_CAP
                   and 0 <= limiter <= 2 and growth <= 64)
    except Exception as exc:  # noqa: BLE001
        case.measured = f"{type(exc).__name__}: {exc}"[:300]
    case.seconds = time.perf_counter() - t0
    return case


# -- telemetry faults (full profile: a server per fault) --------------------------------

#: the load of each telemetry-fault run: a user over its limit (4 streams at
#: the default limit) and a single stream of another user
FAULT_LOAD = (("tf-over", 4, 100), ("tf-single", 1, 60))
#: concurrent scrapers of ``/metrics`` in the scrape case
SCRAPERS = 5


def _histogram_quantile(samples: dict, name: str, q: float) -> float | None:
    """The ``q`` quantile (upper bucket bound) of histogram ``name``, summed
    over its label sets."""
    buckets: dict[float, float] = {}
    for (n, labels), v in samples.items():
        if n == name + "_bucket":
            le = float(dict(labels)["le"])
            buckets[le] = buckets.get(le, 0.0) + v
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    for le in bounds:
        if buckets[le] >= q * total:
            return le
    return bounds[-1]


class _SilentServer:
    """Accepts TCP connections and never answers (a hung collector)."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[Any] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


class _FlappingCollector:
    """An OTLP/HTTP receiver that comes and goes: its port answers (HTTP
    200) for ``period_s``, then is closed for ``period_s``, and so on."""

    def __init__(self, period_s: float = 2.0) -> None:
        import threading

        from vllm_output_rate.tools.common.client import free_port

        self.port = free_port()
        self.period_s = period_s
        self.received = 0
        self.up_periods = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.received += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        while not self._stop.is_set():
            try:
                server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
            except OSError:  # the port not free again yet: down a while longer
                self._stop.wait(0.2)
                continue
            serving = threading.Thread(target=server.serve_forever, daemon=True)
            serving.start()
            self._stop.wait(self.period_s)
            server.shutdown()
            server.server_close()
            self.up_periods += 1
            self._stop.wait(self.period_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class _FullDisk:
    """A 64 KiB tmpfs mounted on a fresh directory and filled up: writes
    there fail with ENOSPC, as on a full disk. Needs the right to mount
    (root); ``error`` says why not otherwise."""

    def __init__(self) -> None:
        import subprocess

        self.path = Path(tempfile.mkdtemp(prefix="output-rate-full-"))
        self.error: str | None = None
        self.mounted = False
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(self.path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            self.error = f"could not mount a tmpfs: {(done.stderr or done.stdout).strip()[:200]}"
            return
        self.mounted = True
        try:
            with open(self.path / "filler", "wb") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        except OSError:
            pass  # full

    def close(self) -> None:
        import shutil
        import subprocess

        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
        shutil.rmtree(self.path, ignore_errors=True)


def _fault_run(model: str, log_dir: Path, name: str, env: dict[str, str], expects: str,
               drop_reason: str | None = None, log_line: str | None = None,
               scrape_hz: float = 0.0, before_load: Callable[[], None] | None = None,
               after: Callable[[], tuple[bool, str]] | None = None) -> CaseResult:
    """One server with ``env``; ``FAULT_LOAD`` against it (and ``/metrics``
    scraped ``scrape_hz`` times a second meanwhile); the limit held
    (the GCRA bound over the window from sending to the last chunk), every
    request complete, no 5xx, the drop counted or logged once."""
    import threading

    from vllm_output_rate.tools.common.client import Server, run_load, summarize
    from vllm_output_rate.tools.common.client import scrape_metrics as scrape

    sends = ", ".join(f"{u} {k} stream(s) x {n} tokens" for u, k, n in FAULT_LOAD) + \
        (f"; /metrics scraped {scrape_hz:g}/s" if scrape_hz else "")
    case = CaseResult("telemetry_faults", name, sends, expects)
    t0 = time.perf_counter()
    log = log_dir / ("stress-fault-" + "".join(c if c.isalnum() else "-" for c in name) + ".log")
    try:
        with Server(model, server_args(), log, extra_env={"OUTPUT_RATE_TELEMETRY": "1", **env}) as server:
            scrapes = {"ok": 0, "bad": 0}
            stop = threading.Event()

            def scraper() -> None:  # one of SCRAPERS, each at scrape_hz / SCRAPERS
                with httpx.Client(timeout=10) as client:
                    while not stop.wait(SCRAPERS / scrape_hz):
                        try:
                            ok = client.get(f"{server.base_url}/metrics").status_code == 200
                        except httpx.HTTPError:
                            ok = False
                        scrapes["ok" if ok else "bad"] += 1

            sides = [threading.Thread(target=scraper, daemon=True)
                     for _ in range(SCRAPERS if scrape_hz else 0)]
            if before_load is not None:
                before_load()
            load_t0 = time.monotonic()
            for side in sides:
                side.start()
            results = asyncio.run(run_load(server.base_url, list(FAULT_LOAD)))
            load_s = time.monotonic() - load_t0
            stop.set()
            for side in sides:
                side.join()
            # one telemetry export, and the drop this case expects once the
            # engine has exported it (waited for, up to 30 s)
            quiet, deadline = time.monotonic() + 2.5, time.monotonic() + 30
            while True:
                try:
                    samples = scrape(server.base_url)
                except Exception:  # noqa: BLE001 - no engine telemetry: reported
                    samples = {}
                seen = drop_reason is None or any(
                    n == series_name("telemetry_dropped") and dict(ls).get("reason") == drop_reason
                    and v > 0 for (n, ls), v in samples.items())
                if (seen and time.monotonic() >= quiet) or time.monotonic() > deadline:
                    break
                time.sleep(0.25)
        text = log.read_text(errors="replace")
    except Exception as exc:  # noqa: BLE001
        case.measured = f"{type(exc).__name__}: {exc}"[:300]
        case.seconds = time.perf_counter() - t0
        return case
    rows = {r.user: r for r in summarize(results, {})}
    over = rows["tf-over"]
    # the bound over the window from sending tf-over's first request to its
    # last chunk: it holds the engine's span of tf-over's tokens however late
    # this process reads them (the exact rate is the scheduler-level tests',
    # in virtual time; a rate read here says how fast the machine was)
    mine = [r for r in results if r.user == "tf-over"]
    window_s = max(r.last or r.started for r in mine) - min(r.started for r in mine)
    held = over.tokens <= (window_s + 0.1) * DEFAULT_LIMIT + 1
    complete = all(r.error is None and r.completion_tokens == r.max_tokens for r in results)
    drops = {dict(ls).get("reason", ""): v for (n, ls), v in samples.items()
             if n == series_name("telemetry_dropped") and v > 0}
    itl99 = _histogram_quantile(samples, "vllm:inter_token_latency_seconds", 0.99)
    late99 = _histogram_quantile(samples, series_name("wake_lateness_seconds", "bucket").removesuffix("_bucket"),
                                 0.99)
    parts = [f"tf-over {over.rate:.1f} tok/s (limit {DEFAULT_LIMIT})",
             f"{sum(r.completion_tokens == r.max_tokens for r in results)}/{len(results)} complete",
             f"drops {drops or 'none'}",
             f"ITL p99 <= {itl99 if itl99 is not None else '?'} s",
             f"wake lateness p99 <= {late99 if late99 is not None else '?'} s"]
    ok = held and complete
    if drop_reason is not None:
        ok = ok and drops.get(drop_reason, 0) > 0
    if log_line is not None:
        count = text.count(log_line)
        parts.append(f"log lines '{log_line}': {count}")
        ok = ok and count == 1
    if scrape_hz:
        parts.append(f"scrapes {scrapes['ok']} ok ({scrapes['ok'] / load_s:.0f}/s), "
                     f"{scrapes['bad']} failed")
        ok = ok and scrapes["bad"] == 0 and scrapes["ok"] > 0
    if after is not None:
        good, seen = after()
        parts.append(seen)
        ok = ok and good
    case.measured = "; ".join(parts)
    case.ok = ok
    case.seconds = time.perf_counter() - t0
    return case


def telemetry_fault_cases(model: str, log_dir: Path) -> list[CaseResult]:
    from vllm_output_rate import settings
    from vllm_output_rate.tools.common.client import free_port

    out = []
    otlp = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1"}
    dead = free_port()
    out.append(_fault_run(model, log_dir, "OTLP endpoint dead",
                          {**otlp, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{dead}/v1/traces"},
                          "limit held, every request complete; span exports counted as dropped",
                          drop_reason="trace_export_failed"))
    silent = _SilentServer()
    try:
        out.append(_fault_run(model, log_dir, "OTLP endpoint accepts and never answers",
                              {**otlp, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT":
                               f"http://127.0.0.1:{silent.port}/v1/traces"},
                              "limit held, every request complete; span exports counted as dropped",
                              drop_reason="trace_export_failed"))
    finally:
        silent.close()
    flapping = _FlappingCollector(period_s=2.0)
    try:
        out.append(_fault_run(
            model, log_dir, "OTLP endpoint flapping (2 s up, 2 s down)",
            {**otlp, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{flapping.port}/v1/traces",
             "OTEL_BSP_SCHEDULE_DELAY": "500"},
            "limit held, every request complete; exports while it is down counted as dropped, "
            "exports while it is up delivered",
            drop_reason="trace_export_failed",
            after=lambda: (flapping.received > 0,
                           f"collector up {flapping.up_periods} times, {flapping.received} exports delivered")))
    finally:
        flapping.close()
    for what, setting, reason, line in (
            ("snapshot directory", "TELEMETRY_DIR", None, "output-rate telemetry: writing"),
            ("event log", "EVENTS", "events_write_failed", None)):
        disk = _FullDisk()
        try:
            if disk.error:
                case = CaseResult("telemetry_faults", f"{what} on a full disk", "-", "-")
                case.measured = f"not run: {disk.error}"
                out.append(case)
                continue
            target = str(disk.path) if setting == "TELEMETRY_DIR" else str(disk.path / "events.jsonl")
            out.append(_fault_run(
                model, log_dir, f"{what} on a full disk (ENOSPC)", {settings.name(setting): target},
                "limit held, every request complete; "
                + ("failed snapshots logged once, then only counted" if reason is None
                   else "event-log writes counted as dropped"),
                drop_reason=reason, log_line=line))
        finally:
            disk.close()
    with tempfile.TemporaryDirectory(prefix="output-rate-faults-") as scratch:
        blocker = Path(scratch) / "a-file"
        blocker.write_text("not a directory\n")
        out.append(_fault_run(model, log_dir, "event log unwritable",
                              {settings.name("EVENTS"): str(blocker / "events.jsonl")},
                              "limit held, every request complete; event-log writes counted as dropped",
                              drop_reason="events_write_failed"))
        out.append(_fault_run(model, log_dir, "snapshot directory unwritable at start",
                              {settings.name("TELEMETRY_DIR"): str(blocker / "telemetry")},
                              "limit held, every request complete; telemetry does not start, "
                              "logged once; the limiter runs without it",
                              log_line="output-rate telemetry could not start"))
        snapshots = Path(scratch) / "telemetry"
        snapshots.mkdir()

        def pull_the_directory() -> None:
            snapshots.rename(Path(scratch) / "telemetry-gone")
            snapshots.write_text("no longer a directory\n")

        out.append(_fault_run(model, log_dir, "snapshot directory gone mid-run",
                              {settings.name("TELEMETRY_DIR"): str(snapshots)},
                              "limit held, every request complete; failed snapshots logged once "
                              "(then only counted; /metrics has no fresh engine telemetry)",
                              log_line="output-rate telemetry: writing",
                              before_load=pull_the_directory))
    out.append(_fault_run(model, log_dir, "/metrics scraped by 5 clients aiming at 50/s", {},
                          "limit held, every request complete, every scrape answered",
                          scrape_hz=50.0))
    return out


# -- tenant isolation (a server of its own) ---------------------------------------------

TENANT_SALT = b"stress-tenants-salt-0123456789"
TENANT_KEYS = {"alice": "stress-alice-key", "bob-4e1d77": "stress-bob-key"}
TENANT_ADMIN_KEY = "stress-oncall-key"


def tenant_server_args(scratch: Path) -> list[str]:
    import hashlib

    def digest(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    (scratch / "keys.json").write_text(json.dumps(
        {"keys": {digest(k): u for u, k in TENANT_KEYS.items()}}))
    (scratch / "admin.json").write_text(json.dumps({"keys": {digest(TENANT_ADMIN_KEY): "oncall"}}))
    (scratch / "salt").write_bytes(TENANT_SALT)
    return [*server_args(), "--output-rate-user-header", "X-User",
            API_KEYS_OPTION, str(scratch / "keys.json"), ADMIN_KEYS_OPTION, str(scratch / "admin.json"),
            LABEL_OPTION, "hashed", SALT_OPTION, str(scratch / "salt")]


async def tenant_cases(base_url: str) -> list[CaseResult]:
    """Alice against bob, each with its own key; the operator's view."""
    from vllm_output_rate.user_label import hashed

    alice, bob = "alice", "bob-4e1d77"
    as_alice = {"Authorization": f"Bearer {TENANT_KEYS[alice]}"}
    as_bob = {"Authorization": f"Bearer {TENANT_KEYS[bob]}"}
    as_ops = {"Authorization": f"Bearer {TENANT_ADMIN_KEY}"}
    cases: list[CaseResult] = []
    seen_by_alice: list[str] = []

    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        async def get(path: str, headers: dict[str, str]) -> httpx.Response:
            resp = await client.get(f"{base_url}/output-rate/{path}", headers=headers)
            if headers is as_alice:
                seen_by_alice.append(resp.text + str(resp.headers))
            return resp

        async def complete(headers: dict[str, str], user: str, stream: bool) -> httpx.Response:
            body = body_for(user, max_tokens=4, stream=stream)
            extra = {**headers, "X-User": user}
            if stream:
                async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                                         headers=extra) as resp:
                    text = "".join([chunk async for chunk in resp.aiter_text()])
            else:
                resp = await client.post(f"{base_url}/v1/chat/completions", json=body, headers=extra)
                text = resp.text
            if headers is as_alice:
                seen_by_alice.append(text + str(resp.headers))
            return resp

        async def charged() -> dict[str, float]:
            text = (await client.get(f"{base_url}/metrics")).text
            out = {}
            for user in (alice, bob):
                label = hashed(user, TENANT_SALT)
                out[user] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                if line.startswith(series_name("tokens_charged") + "{")
                                and f'user="{label}"' in line)
            return out

        assert (await complete(as_bob, bob, False)).status_code == 200  # bob has state
        await asyncio.sleep(2.5)  # one engine export

        t0 = time.perf_counter()
        case = CaseResult("tenants", "read its own state",
                          "alice's key: GET /output-rate/me, /output-rate/users/alice",
                          "200, alice's state")
        got = [(await get(p, as_alice)) for p in ("me", f"users/{alice}")]
        case.measured = ", ".join(f"{r.status_code} user={r.json().get('user')}" for r in got)
        case.ok = all(r.status_code == 200 and r.json().get("user") == alice for r in got)
        case.seconds = time.perf_counter() - t0
        cases.append(case)

        t0 = time.perf_counter()
        case = CaseResult("tenants", "read another tenant's state",
                          "alice's key: GET users/bob, users, users?limit=20, limits; then the "
                          "admin key: users/bob",
                          "403 for alice naming no user; 200 for the operator")
        got = [(await get(p, as_alice)) for p in (f"users/{bob}", "users", "users?limit=20", "limits")]
        ops = await get(f"users/{bob}", as_ops)
        case.measured = (", ".join(str(r.status_code) for r in got)
                         + f"; operator {ops.status_code}")
        case.ok = (all(r.status_code == 403 and bob not in r.text for r in got)
                   and ops.status_code == 200 and ops.json().get("user") == bob)
        case.seconds = time.perf_counter() - t0
        cases.append(case)

        t0 = time.perf_counter()
        case = CaseResult("tenants", "be charged to another tenant or spend its budget",
                          "alice's key, body field and X-User naming bob: 4 chat completions "
                          "(streamed and not) of 4 tokens",
                          "16 tokens charged to alice, 0 to bob (engine counters, hashed labels)")
        before = await charged()
        statuses = [(await complete(as_alice, bob, stream)).status_code
                    for stream in (True, False, True, False)]
        await asyncio.sleep(2.5)
        after = await charged()
        delta = {u: after[u] - before[u] for u in after}
        case.measured = f"statuses {statuses}; charged {delta}"
        case.ok = statuses == [200] * 4 and delta == {alice: 16, bob: 0}
        case.seconds = time.perf_counter() - t0
        cases.append(case)

        t0 = time.perf_counter()
        case = CaseResult("tenants", "learn another tenant's id",
                          "every response alice got above (bodies, headers, refusals); /metrics",
                          "bob's id in none; RateLimit-Policy on alice's completions is her own "
                          "default limit; no raw id on /metrics")
        policies = [text for text in seen_by_alice if "ratelimit-policy" in text.lower()]
        metrics = (await client.get(f"{base_url}/metrics")).text
        leaks = [t[:80] for t in seen_by_alice if bob in t]
        own = f'"default";q={DEFAULT_LIMIT};w=1'
        case.measured = (f"{len(seen_by_alice)} responses, {len(leaks)} with bob's id, "
                         f"{sum(own in t for t in policies)}/{len(policies)} with alice's policy; "
                         f"/metrics ids: {[u for u in (alice, bob) if f'{chr(34)}{u}{chr(34)}' in metrics]}")
        case.ok = (not leaks and len(policies) == 4 and all(own in t for t in policies)
                   and f'"{alice}"' not in metrics and f'"{bob}"' not in metrics)
        case.seconds = time.perf_counter() - t0
        cases.append(case)
    return cases


def run_tenant_cases(model: str, log_dir: Path) -> list[CaseResult]:
    from vllm_output_rate.tools.common.client import Server

    with tempfile.TemporaryDirectory(prefix="output-rate-tenants-") as scratch:
        with Server(model, tenant_server_args(Path(scratch)), log_dir / "stress-tenants-server.log",
                    extra_env={"OUTPUT_RATE_TELEMETRY": "1"}) as server:
            return asyncio.run(tenant_cases(server.base_url))


# -- the run ------------------------------------------------------------------------


def server_args() -> list[str]:
    return ["--max-num-seqs", "32", "--max-num-active-seqs", "16", "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS),
            DEFAULT_OPTION, str(DEFAULT_LIMIT),
            USERS_OPTION, json.dumps({THROTTLED_USER: THROTTLED_LIMIT})]


GROUPS = ("config", "identity_churn", "user_field", "requests", "client_faults", "tenants",
          "telemetry_faults")


async def live_cases(base_url: str, profile: str, server_pid: int,
                     groups: frozenset[str] = frozenset(GROUPS),
                     add: Callable[[list[CaseResult]], None] | None = None) -> list[CaseResult]:
    """The groups run against the live server; ``add`` is given each group's
    cases as the group ends."""
    # idle connections dropped after 2 s, before the server's keep-alive
    # (uvicorn's 5 s) closes them: a request sent on a connection the
    # server is closing fails with a ReadError before it reaches vLLM (seen
    # with the machine loaded, after the cases' pauses of 2.5 s)
    limits = httpx.Limits(keepalive_expiry=2.0)
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
