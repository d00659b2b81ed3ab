"""The ``client_faults`` group against a live server: streams cancelled after
their first token, slow consumers, connections dropped mid-prefill; the
engine back to idle after each."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx

from vllm_output_rate.tools.reliability.cases import (
    DEFAULT_LIMIT,
    MAX_BATCHED_TOKENS,
    MODEL_NAME,
    THROTTLED_USER,
    CaseResult,
    Live,
    body_for,
    wait_quiet,
)


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
