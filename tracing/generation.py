"""A request's ``output_rate.generation`` span, made when it ends: its token
count, spacing quantiles and series, and its throttle episodes.

Last of the span builder's books on the data's path: the recorder
(``recorder``) replays each ``update_from_output`` here, on the span
builder's thread; its tokens go into the spacing series (``series``), the
facts of requests with their first tokens are kept, and each request that
ended takes its series and its throttle episodes (``throttle``) into its
span.
"""

from __future__ import annotations

from array import array

from vllm_output_rate.observers import EngineView, RequestFacts
from vllm_output_rate.telemetry.records import TokenUpdate
from vllm_output_rate.tracing.attributes import (
    GEN_AI_REQUEST_ID,
    GEN_AI_RESPONSE_FINISH_REASONS,
    GEN_AI_RESPONSE_MODEL,
    GEN_AI_USAGE_OUTPUT_TOKENS,
    external_request_id,
    identity_attributes,
    quantile,
)
from vllm_output_rate.tracing.emit import SpanEmitter
from vllm_output_rate.tracing.series import SpacingSeries, series_attribute, series_truncated
from vllm_output_rate.tracing.throttle import ThrottleSpans


class GenerationSpans:
    """Makes each ended request's generation span on ``emitter`` from its
    spacing ``series`` and its ``throttle`` episodes."""

    def __init__(self, emitter: SpanEmitter, view: EngineView, series: SpacingSeries,
                 throttle: ThrottleSpans) -> None:
        self.emitter = emitter
        self.view = view
        self.series = series
        self.throttle = throttle
        #: request id -> its RequestFacts (user, priority, trace headers,
        #: identity source), from its first token or throttle episode to its end
        self._who: dict[str, RequestFacts] = {}

    def replay_outputs(self, timing: TokenUpdate, first_facts: list[RequestFacts | None]) -> None:
        """One ``update_from_output`` (``SpanRecorder.on_outputs``)."""
        self.series.update(timing)
        who = self._who
        for req_id, facts in zip(timing.first, first_facts):
            if facts is not None:
                who[req_id] = facts
        now = timing.now
        for req_id, reason in timing.ends:
            self.finish(req_id, reason, now)

    def finish(self, req_id: str, reason: str, now: int,
               facts: RequestFacts | None = None) -> None:
        """``req_id`` ended at ``now`` (``reason``: vLLM's finish reason, or
        ``abort``): its throttle span if it has one, then its generation
        span; ``facts``: when none were kept from its first token."""
        known = self._who.pop(req_id, None)
        if known is not None:
            facts = known
        s, tokens = self.series.close(req_id)
        throttle = self.throttle.end_request(req_id)
        self._build_generation(req_id, reason, now, s, tokens, facts, throttle)

    def _build_generation(self, req_id: str, reason: str, now: int, s: array, tokens: int,
                          facts: RequestFacts | None, throttle: list[int] | None = None) -> None:
        ordered = sorted(s)
        emitter = self.emitter
        attributes = {
            GEN_AI_REQUEST_ID: external_request_id(req_id, emitter.randomized_ids),
            GEN_AI_RESPONSE_MODEL: self.view.model_name,
            GEN_AI_USAGE_OUTPUT_TOKENS: tokens,
            GEN_AI_RESPONSE_FINISH_REASONS: [reason],
            "output_rate.request_id": req_id,
            # charged at dispatch, one per token: equal to the tokens with
            # synchronous scheduling (async may charge one more, refunded
            # only if the request is not dispatched again)
            "output_rate.tokens_charged": tokens,
            "output_rate.spacing_p50_us": quantile(ordered, 0.5),
            "output_rate.spacing_p90_us": quantile(ordered, 0.9),
            "output_rate.spacing_p99_us": quantile(ordered, 0.99),
            "output_rate.spacing_max_us": ordered[-1] if ordered else 0,
            "output_rate.spacing_series_us": series_attribute(s),
            "output_rate.spacing_series_truncated": series_truncated(s),
            # where it waited for its user's budget: throttle episodes that
            # ended with a dispatch (or its abort), their total and longest
            "output_rate.throttle_episodes": throttle[0] if throttle else 0,
            "output_rate.throttled_us": throttle[1] // 1000 if throttle else 0,
            "output_rate.throttle_max_us": throttle[2] // 1000 if throttle else 0,
        }
        identity_attributes(facts, attributes)
        start = now - sum(s) * 1000
        emitter.span("output_rate.generation", start, now, attributes,
                     context=emitter.parent_context(facts))
