"""The calibration load of ``vllm-output-rate twin calibrate --url URL
--model NAME --events FILE``: a short, bounded closed-loop load against a
running ``vllm-output-rate serve`` (concurrency from 1 up, prompts and
outputs of several lengths) whose engine event log the fit then reads
(``twin.calibrate``)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any


#: Prompt lengths (tokens), output lengths and the concurrency levels of the
#: calibration load: for each level that many streams are kept open (a new
#: request as soon as one ends, closed loop) for an equal share of the
#: duration, prompts and outputs of varied lengths, so that prefills land
#: among decodes at every batch size.
PROMPT_TOKENS = (16, 64, 192, 384)
OUTPUT_TOKENS = (16, 48, 128)
CONCURRENCY = (1, 2, 4, 8, 16)
WARMUP_S = 3.0
USERS = 3


#: the APIs the calibration load can speak: its requests should be those of
#: the traffic the twin is to predict (the request path differs: chat
#: renders a template and tokenizes text, completions of token ids do not)
APIS = ("chat", "completions")


async def calibration_load(base_url: str, model: str, duration_s: float, bar: Any = None,
                           seed: int = 0, api: str = "chat") -> list[dict[str, Any]]:
    """Drive the load; per request its client id (``X-Request-Id``),
    prompt tokens (the server's count), phase and error. ``api``: chat
    completions of text (``/v1/chat/completions``) or completions of token
    ids (``/v1/completions``, the ids of the same texts, shuffled per
    request: no prefix-cache hits)."""
    import asyncio
    import random
    import time
    import uuid

    import httpx

    from vllm_output_rate.tools.common.client import (
        chat_body, completion_body, http_limits, StreamResult, stream_into)
    from vllm_output_rate.tools.loadgen.prompts import text_of_tokens, tokenize

    rng = random.Random(seed)
    run = uuid.uuid4().hex[:8]
    records: list[dict[str, Any]] = []
    seq = 0
    limits = http_limits(64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(duration_s + 60), limits=limits) as client:
        texts = {n: await text_of_tokens(client, base_url, model, n, seed + n)
                 for n in PROMPT_TOKENS}
        ids = ({n: await tokenize(client, base_url, model, text) for n, text in texts.items()}
               if api == "completions" else {})
        phase_s = max(1.0, (duration_s - WARMUP_S) / len(CONCURRENCY))
        started = time.monotonic()

        async def one(phase: str) -> None:
            nonlocal seq
            rid = f"cal-{run}-{seq:05d}"
            seq += 1
            n = rng.choice(PROMPT_TOKENS)
            user = f"cal-{seq % USERS}"
            rec = StreamResult(user, rng.choice(OUTPUT_TOKENS))
            if api == "completions":
                prompt = list(ids[n])
                rng.shuffle(prompt)
                body = completion_body(model, prompt, rec.max_tokens, user)
                path = "/v1/completions"
            else:
                # a distinct first word: no prefix-cache hits between requests
                body = chat_body(model, f"{rid} {texts[n]}", rec.max_tokens, user)
                path = "/v1/chat/completions"
            sent_ns = time.monotonic_ns()  # the engine core's clock (one per machine)
            try:
                await stream_into(client, base_url, body, rec, headers={"X-Request-Id": rid},
                                  path=path)
            except Exception as exc:  # recorded: one stream must not stop the load
                rec.error = f"{type(exc).__name__}: {exc}"
            records.append({"request_id": rid, "prompt_tokens": rec.prompt_tokens,
                            "phase": phase, "sent_ns": sent_ns, "error": rec.error})

        async def slot(phase: str, until: float) -> None:
            while time.monotonic() < until:
                await one(phase)

        async def tick() -> None:  # the bar: seconds of load run
            while True:
                bar.update(max(0, min(bar.total, round(time.monotonic() - started)) - bar.n))
                await asyncio.sleep(0.5)

        ticker = asyncio.create_task(tick()) if bar is not None else None
        plan = [("warmup", 2, WARMUP_S)] + [(f"c{c}", c, phase_s) for c in CONCURRENCY]
        for phase, c, seconds in plan:
            until = time.monotonic() + seconds
            await asyncio.gather(*(slot(phase, until) for _ in range(c)))
        if ticker is not None:
            ticker.cancel()
            bar.update(bar.total - bar.n)
    return records


def run_calibration_load(base_url: str, model_name: str, prompts_out: Path,
                         duration_s: float, show_progress: bool = True,
                         api: str = "chat") -> dict[str, Any]:
    """Drive the calibration load (a progress bar of its seconds); writes
    ``prompts_out`` (JSON Lines: the client's request ids, prompt tokens,
    phase)."""
    import asyncio

    from tqdm import tqdm

    with tqdm(total=math.ceil(duration_s), unit="s", desc="calibration load", mininterval=0.5,
              disable=not show_progress, file=sys.stderr) as bar:
        records = asyncio.run(calibration_load(base_url, model_name, duration_s, bar, api=api))
    with open(prompts_out, "w") as f:
        for rec in records:
            if rec["prompt_tokens"]:
                f.write(json.dumps({k: rec[k] for k in ("request_id", "prompt_tokens", "phase",
                                                        "sent_ns")})
                        + "\n")
    errors = [r["error"] for r in records if r["error"]]
    return {"requests": len(records), "errors": len(errors),
            "first_error": errors[0] if errors else None}
