"""Prompt text of an exact size in the server's own tokens: generated
words, tokenized and cut by the server (vLLM's ``/tokenize`` and
``/detokenize``), so sizes are in tokens of the model under test whatever
its tokenizer (``scenario.resolve_prompts`` makes a scenario's
``{tokens: N}`` prompts so)."""

from __future__ import annotations

import random
import re
from typing import Any


# Words of the tiny model's tokenizer corpus: about one token per word there.
_WORDS = (
    "the engine schedules tokens for every user in each step and a user with many "
    "streams shares one budget of output tokens per second throttled requests keep "
    "their cache while others run the scheduler charges one token when a step samples "
    "and refunds it when the request was not dispatched explain continuous batching in "
    "simple words prefill decode chunk cache block preempt wake queue rate limit spacing"
).split()


def generated_text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


#: Stands for "N tokens of generated text, seed S" in a prompt's text until
#: ``resolve_prompts`` asks the server's tokenizer (sizes are in tokens of
#: the model under test, whatever its tokenizer).
_TOKENS_MARK = re.compile(r"\x00tokens:(\d+):(-?\d+)\x00")


def _tokens_mark(n: int, seed: int) -> str:
    return f"\x00tokens:{n}:{seed}\x00"


async def tokenize(client: Any, base_url: str, model: str, text: str) -> list[int]:
    """The server's token ids of ``text`` (vLLM's ``/tokenize``, without
    special tokens)."""
    resp = await client.post(f"{base_url}/tokenize", json={
        "model": model, "prompt": text, "add_special_tokens": False})
    resp.raise_for_status()
    return list(resp.json()["tokens"])


async def text_of_tokens(client: Any, base_url: str, model: str, n: int, seed: int) -> str:
    """Generated text that the server's tokenizer reads as exactly ``n``
    tokens (vLLM's ``/tokenize`` and ``/detokenize``, without special
    tokens): words are tokenized, cut to ``n`` ids, detokenized, and cut
    again while the round trip merges or splits at the edge."""
    async def detokenize(ids: list[int]) -> str:
        resp = await client.post(f"{base_url}/detokenize", json={"model": model, "tokens": ids})
        resp.raise_for_status()
        return str(resp.json()["prompt"])

    words = max(n, 8)
    ids = await tokenize(client, base_url, model, generated_text(words, seed))
    while len(ids) < n:  # a tokenizer with more than one word per token
        words *= 2
        ids = await tokenize(client, base_url, model, generated_text(words, seed))
    want = n
    for _ in range(20):
        text = await detokenize(ids[:want])
        got = len(await tokenize(client, base_url, model, text))
        if got == n:
            return text
        want += n - got
        if want <= 0 or want > len(ids):
            break
    raise RuntimeError(f"could not make a prompt of exactly {n} tokens with this tokenizer")
