"""The ``user_field`` and ``requests`` groups against a live server: the
request's user field as every odd value, and the requests the limiter must
handle (``n`` > 1, structured output, long prompts, beam search ...)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any


from vllm_output_rate.config import USER_FIELD
from vllm_output_rate.tools.reliability.cases import (
    _ABSENT,
    DEFAULT_LIMIT,
    LABEL_CAP,
    MAX_BATCHED_TOKENS,
    MAX_MODEL_LEN,
    MODEL_NAME,
    THROTTLED_LIMIT,
    THROTTLED_USER,
    CaseResult,
    Live,
    _message,
    body_for,
)


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
