"""Each user's prompt work (issue 48): the prompt tokens its prefill chunks
computed, the prompt tokens put off (by its prompt budget, or just in
time), and the share of step time its prompts took.

Folded per step on the worker (``telemetry.folds``) from the step report
(``observers.StepReport``: ``prompt_chunks``, ``prompt_deferred``,
``scheduled_tokens``, ``scheduled_requests``); nothing per token.

**The share of step time.** vLLM measures no cost per token, so each
step's time is measured (from its start to the next step's: a step that
computed anything, an idle wait of the engine loop between them left out)
and split by a step-time model, the linear one ``vllm-output-rate twin
calibrate`` fits (``base_s + per_decode_s x decodes + per_prefill_token_s
x prompt tokens``, ``tools.twin.step_time``): a user's part of a step is
``per_prefill_token_s x its prompt tokens`` over the model's step, times
the step's measured time. The model comes from the file named by
``OUTPUT_RATE_STEP_TIME`` (``twin calibrate``'s JSON; its other terms are
the twin's own) or, without it, the built-in estimate ``ESTIMATE`` (the
twin's default); the twin passes its own. Over the engine's step seconds,
a user's prompt seconds are the share of step time its prompts took.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from vllm_output_rate import settings
from vllm_output_rate.observers import PROMPT_DEFER_REASONS, StepReport
from vllm_output_rate.telemetry.metrics import (
    ENGINE_PROMPT_TOKENS_COMPUTED,
    ENGINE_PROMPT_TOKENS_DEFERRED,
    ENGINE_STEP_SECONDS,
    PROMPT_TOKENS_DEFERRED,
)

logger = logging.getLogger("vllm_output_rate.telemetry")

_COMPUTED = ENGINE_PROMPT_TOKENS_COMPUTED.key()
_STEP_SECONDS = ENGINE_STEP_SECONDS.key()
_DEFERRED = {reason: ENGINE_PROMPT_TOKENS_DEFERRED.key(reason) for reason in PROMPT_DEFER_REASONS}
#: the terms of a step-time model the split reads
TERMS = ("base_s", "per_decode_s", "per_prefill_token_s")
#: A step's time ends when its outputs come, if the engine then goes idle,
#: and only within this long (else it is dropped: not one step's time).
MAX_STEP_NS = 10_000_000_000


@dataclass(frozen=True)
class StepCost:
    """The step-time model's terms the split reads (seconds)."""

    base_s: float
    per_decode_s: float
    per_prefill_token_s: float
    #: where it comes from: the file, or "estimate"
    source: str = "estimate"

    def shares(self, decodes: int, by_user: dict[str, int]) -> dict[str, float]:
        """Each user's share of a step with ``decodes`` decoding requests
        and ``by_user`` prompt tokens (user -> tokens), by the model."""
        per_token = self.per_prefill_token_s
        step = self.base_s + self.per_decode_s * decodes + per_token * sum(by_user.values())
        if step <= 0:
            return {}
        return {user: per_token * n / step for user, n in by_user.items()}


#: Without a model: the twin's built-in estimate (25 ms a step, 0.1 ms a
#: decode, 20 us a prompt token), not a measurement of any engine.
ESTIMATE = StepCost(0.025, 0.0001, 0.00002)


def read_json(path: str, error: type[ValueError] = ValueError) -> Any:
    """The data of the JSON file ``path`` (a step-time model: here and in
    ``tools.twin.step_time``); ``error`` naming the file when it cannot be
    read or is not JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as exc:
        raise error(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise error(f"{path}: not JSON ({exc})") from None


def load_step_cost(path: str) -> StepCost:
    """The terms of the step-time model in ``path`` (``twin calibrate``'s
    JSON: version 1, kind linear). Raises ValueError naming the file and
    the field."""
    data = read_json(path)
    if not isinstance(data, dict) or data.get("version") != 1 or data.get("kind") != "linear":
        raise ValueError(f"{path}: expected a step-time model (version 1, kind linear: "
                         f"`vllm-output-rate twin calibrate` writes one)")
    terms = []
    for key in TERMS:
        value = data.get(key, 0.0)
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value < 0):
            raise ValueError(f"{path}: {key}: expected a number >= 0, got {value!r}")
        terms.append(float(value))
    return StepCost(*terms, source=path)


def step_cost_from_settings() -> StepCost:
    """``OUTPUT_RATE_STEP_TIME``'s model, or ``ESTIMATE`` (without it, or
    when it cannot be read: logged)."""
    path = settings.get_or_default("STEP_TIME")
    if not path:
        return ESTIMATE
    try:
        return load_step_cost(path)
    except ValueError as exc:
        logger.warning("%s=%s: %s; the step-time split uses the built-in estimate",
                       settings.name("STEP_TIME"), path, exc)
        return ESTIMATE


class PromptWork:
    """The prompt work of one engine's steps, into the series (``Series``:
    the capped user label) and the labeler's activity (a user whose prompts
    are heavy gets a label of its own, as one with many output tokens)."""

    def __init__(self, series: Any, books: Any, cost: StepCost, events: Any = None) -> None:
        self.series = series
        #: the event log (``telemetry.eventlog``; None: off): a ``prompt``
        #: line per step that computed prompt tokens, for ``verify``
        self.events = events
        #: ``telemetry.books.UserBooks``: its ``activity``, the labeler's
        self.books = books
        self.cost = cost
        #: the last step that computed anything: its start (ns) and each
        #: user's share of it, until the next step measures its time
        self._open: tuple[int, dict[str, float]] | None = None

    def fold_step(self, record: StepReport) -> None:
        """One step: the step before measured and split, this one's prompt
        tokens counted, its prompts put off counted."""
        now = record.now_ns
        opened = self._open
        series = self.series
        counters = series.counters
        if opened is not None:
            seconds = (now - opened[0]) / 1e9
            counters[_STEP_SECONDS] += seconds
            for user, share in opened[1].items():
                series.prompt_seconds(user, seconds * share)
            self._open = None
        if record.prompt_deferred:
            label = series.labeler.label
            for _req_id, user, reason, n in record.prompt_deferred:
                counters[PROMPT_TOKENS_DEFERRED.key(label(user), reason)] += n
                counters[_DEFERRED[reason]] += n
        if not record.scheduled_tokens:
            return
        shares: dict[str, float] = {}
        chunks = record.prompt_chunks
        if chunks:
            by_user = record.prompt_tokens
            activity = self.books.activity
            for user, n in by_user.items():
                series.prompt_computed(user, n)
                activity[user] += n
            counters[_COMPUTED] += sum(by_user.values())
            if self.events is not None:
                self.events.prompt(now, by_user)
            shares = self.cost.shares(record.scheduled_requests - len(chunks), by_user)
        self._open = (now, shares)

    def idle(self, now_ns: int | None = None) -> None:
        """The engine loop waits, or nothing runs any more (its last outputs
        came at ``now_ns``, which ends the last step; None: unknown): the
        time until the next step is no step's."""
        opened = self._open
        if opened is not None and now_ns is not None and 0 < now_ns - opened[0] <= MAX_STEP_NS:
            self.fold_step(StepReport(0, now_ns))  # (the open step ends then)
        self._open = None
