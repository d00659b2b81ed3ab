"""Prompt budgets end to end (issue 48): the real CPU engine on the tiny
model through the OpenAI API, the pool's ``tiny`` engine.

A user with a prompt budget sends prompts of token ids (unique: no
prefix-cache hits) all at once; ``/metrics`` says how many prompt tokens
the engine computed for it and how many it put off. The budget's bound
(``vllm_patch/prompt_budget.py``): in any window of W seconds at most
``floor((W + burst) * prompt_rate) + 1`` prompt tokens, checked over the
client's window (stamped before the first request and after the last
answer: a loaded machine only widens it). Then ``prompt_rate`` changes in
the limits file while the engine runs, and the new budget is in force.
The exact timing is checked in virtual time (tests/test_prompt_budget.py)."""

from __future__ import annotations

import asyncio
import random
import time
from fractions import Fraction

import httpx
import pytest
from harness import scrape_until, tiny_model

from vllm_output_rate.limiter import BURST_NS
from vllm_output_rate.tools.fairness.engine import model_vocab, prompt_ids
from vllm_output_rate.tools.common.client import (
    StreamResult, completion_body, http_limits, metric_value, scrape_metrics, stream_into)

pytestmark = pytest.mark.e2e

USER = "rag-co"
DEFAULT = 100_000
#: eight prompts of 300 tokens: 2,400 prompt tokens; the tiny model computes
#: them in about 0.1 s on the CPU, the budget takes about 1.5 s
PROMPTS, PROMPT_TOKENS = 8, 300
COMPUTED = "vllm_output_rate_prompt_tokens_computed_total"
DEFERRED = "vllm_output_rate_prompt_tokens_deferred_total"


def limits(prompt_rate: int) -> dict:
    return {USER: {"rate": 1000, "prompt_rate": prompt_rate}}


async def send_prompts(base_url: str, seed: int) -> list[StreamResult]:
    rng, vocab = random.Random(seed), model_vocab(tiny_model())

    async def one() -> StreamResult:
        rec = StreamResult(USER, 2, started=time.monotonic())
        body = completion_body("tiny", prompt_ids(rng, PROMPT_TOKENS, vocab), 2, USER)
        try:
            await stream_into(client, base_url, body, rec, path="/v1/completions")
        except Exception as e:  # recorded, asserted below
            rec.error = repr(e)
        return rec

    async with httpx.AsyncClient(limits=http_limits(None), timeout=httpx.Timeout(300.0)) as client:
        return list(await asyncio.gather(*(one() for _ in range(PROMPTS))))


def run(server, seed: int) -> tuple[float, float, float]:
    """The load; (prompt tokens computed, put off, the client's window s)."""
    before = scrape_metrics(server.base_url)
    t0 = time.monotonic()
    results = asyncio.run(send_prompts(server.base_url, seed))
    window = time.monotonic() - t0
    # (every prompt token was computed before its answer came; the engine
    # exports about once a second)
    after = scrape_until(server.base_url, lambda s: metric_value(s, COMPUTED, user=USER)
                         - metric_value(before, COMPUTED, user=USER) >= PROMPTS * PROMPT_TOKENS)
    assert [r.error for r in results if r.error] == []
    assert all(r.completion_tokens == 2 and r.prompt_tokens == PROMPT_TOKENS for r in results)
    computed = metric_value(after, COMPUTED, user=USER) - metric_value(before, COMPUTED, user=USER)
    deferred = metric_value(after, DEFERRED, user=USER) - metric_value(before, DEFERRED, user=USER)
    return computed, deferred, window


def bound(window_s: float, prompt_rate: int) -> int:
    return int((Fraction(window_s) + Fraction(BURST_NS, 10**9)) * prompt_rate) + 1


def test_a_prompt_budget_holds_and_changes_live(engines):
    server = engines.get("tiny", default=DEFAULT, users=limits(1500))
    computed, deferred, window = run(server, seed=1)
    print(f"\nprompt budget 1500 tok/s: {computed:.0f} computed in {window:.2f} s "
          f"(bound {bound(window, 1500)}), {deferred:.0f} put off")
    # every prompt token computed, none twice, no prefix-cache hit
    assert computed == PROMPTS * PROMPT_TOKENS
    assert computed <= bound(window, 1500)
    assert deferred > 0  # the budget held prompts back (all of them came at once)

    # four times the budget, live: the limits file changes, the engine
    # reloads it, the introspection endpoint names the new second policy
    server = engines.get("tiny", default=DEFAULT, users=limits(6000))
    view = httpx.get(f"{server.base_url}/output-rate/users/{USER}", timeout=30).json()
    assert view["prompt_rate"] == 6000, view
    computed, deferred, window = run(server, seed=2)
    print(f"prompt budget 6000 tok/s: {computed:.0f} computed in {window:.2f} s "
          f"(bound {bound(window, 6000)}), {deferred:.0f} put off")
    assert computed == PROMPTS * PROMPT_TOKENS
    assert computed <= bound(window, 6000)
