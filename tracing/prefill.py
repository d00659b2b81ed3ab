"""Deferred prefill: a request whose prompt was put off (by its user's
prompt budget, or just in time: its user out of output budget) and its
span, ``output_rate.prefill_deferred``, from the step that first put it off
to the step that computed its prompt's last token (or its end).

On the data's path, as the throttle episodes: the recorder (``recorder``)
hands each step's report here on the telemetry's worker (``on_step``: the
step's prompts put off, ``StepReport.prompt_deferred``, each once per
request and reason, and its prefill chunks, ``prompt_chunks``); a request
whose deferral ends is queued with its plain data, and the span builder's
thread makes its span (``build``) in the request's trace, when it lasted
at least ``OUTPUT_RATE_TRACE_THROTTLE_MIN_S`` (default 1 s, as a throttle
episode's span: a prompt put off is its request held for its user's
budget). The books hold live requests only (ended with their prompt, their
abort or their finish) and at most ``MAX_OPEN`` of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_output_rate.observers import EngineView, RequestFacts, StepReport
from vllm_output_rate.tracing.attributes import (
    GEN_AI_REQUEST_ID,
    external_request_id,
    identity_attributes,
)
from vllm_output_rate.tracing.emit import SpanEmitter

#: Open deferrals kept at most (the oldest are dropped past it).
MAX_OPEN = 65536


class PrefillSpans:
    """The open deferrals (the telemetry's worker) and their spans (the
    span builder's thread)."""

    def __init__(self, emitter: SpanEmitter, view: EngineView) -> None:
        self.emitter = emitter
        self.view = view
        #: request id -> [when first put off (ns), its reasons, prompt tokens
        #: it had left then]: live requests whose prompt is not yet computed
        self.open: dict[str, list[Any]] = {}

    def on_step(self, record: StepReport,
                facts_of: Callable[[str], RequestFacts | None] | None = None,
                min_ns: int = 0) -> list[tuple]:
        """One step (the worker): the prompts put off open (or add a
        reason); those whose prompt the step computed to its end close,
        with their facts (``facts_of``: by the handle the telemetry took
        when each was added, so even once it is gone; else read from the
        engine). Returns the closed ones' plain data for ``build`` (those
        that lasted ``min_ns`` or longer)."""
        books = self.open
        for req_id, _user, reason, left in record.prompt_deferred:
            book = books.get(req_id)
            if book is None:
                if len(books) >= MAX_OPEN:
                    del books[next(iter(books))]
                books[req_id] = [record.now_ns, [reason], left]
            elif reason not in book[1]:
                book[1].append(reason)
        if not books or not record.prompt_chunks:
            return []
        now = record.now_ns
        done = [req_id for req_id, chunk in record.prompt_chunks.items()
                if chunk[2] and req_id in books]
        facts_of = facts_of or self.view.request_facts
        return [(req_id, *book, now, "computed", facts_of(req_id)) for req_id in done
                if now - (book := books.pop(req_id))[0] >= min_ns]

    def on_ended(self, ended: list[tuple[str, Any]], now: int, outcome: str,
                 facts: list[RequestFacts | None] | None = None,
                 min_ns: int = 0) -> list[tuple]:
        """Requests that ended (the worker: finished, or aborted with their
        ``facts``) with their prompt still put off (``min_ns``: as
        ``on_step``)."""
        books = self.open
        if not books:
            return []
        out = []
        for i, (req_id, _x) in enumerate(ended):
            book = books.pop(req_id, None)
            if book is not None and now - book[0] >= min_ns:
                out.append((req_id, *book, now, outcome, None if facts is None else facts[i]))
        return out

    def build(self, req_id: str, start_ns: int, reasons: list[str], left: int, end_ns: int,
              outcome: str, facts: RequestFacts | None) -> None:
        """The span of one request's deferred prefill (the span builder's
        thread)."""
        emitter = self.emitter
        attributes = {
            GEN_AI_REQUEST_ID: external_request_id(req_id, emitter.randomized_ids),
            "output_rate.request_id": req_id,
            "output_rate.prompt_deferred_reasons": list(reasons),
            "output_rate.prompt_tokens_deferred": left,
            "output_rate.outcome": outcome,
        }
        identity_attributes(facts, attributes)
        emitter.span("output_rate.prefill_deferred", start_ns, end_ns, attributes,
                     context=emitter.parent_context(facts))
