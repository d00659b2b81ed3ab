"""Where every span builder's span is made: the tracer, the clock offset
from the scheduler's monotonic clock to epoch ns, and each request's trace
parent parsed from its ``traceparent``.

Shared by the builders (``generation``, ``throttle``, ``steps``), on the span
builder's thread: they turn their books into a name, times and attributes,
and hand them here; the SDK span goes on to the provider's processor
(``provider``, ``drops``).
"""

from __future__ import annotations

import time
from typing import Any

from vllm_output_rate.observers import RequestFacts
from vllm_output_rate.tracing.attributes import randomized_request_ids

#: parsed trace contexts kept by the span builder (cleared when full)
_MAX_CONTEXTS = 4096


def _epoch_offset_ns() -> int:
    """Monotonic ns -> epoch ns, for span timestamps."""
    return time.time_ns() - time.monotonic_ns()


class SpanEmitter:
    """Makes the builders' spans on ``tracer``.

    ``clock_offset_ns`` maps the scheduler's monotonic clock to epoch ns
    (default: the offset now).
    """

    def __init__(self, tracer: Any, clock_offset_ns: int | None = None) -> None:
        self.tracer = tracer
        self.offset = _epoch_offset_ns() if clock_offset_ns is None else clock_offset_ns
        #: (traceparent, tracestate) -> the parsed parent context, or None
        #: when invalid; only the span builder touches it
        self._contexts: dict[tuple[str, str | None], Any] = {}
        self._propagator: Any = None
        #: whether vLLM appended its random suffix to the client's request id
        self.randomized_ids = randomized_request_ids()

    def span(self, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any],
             links: Any = None, context: Any = None) -> None:
        """One span from ``start_ns`` to ``end_ns`` (scheduler clock)."""
        span = self.tracer.start_span(name, context=context, start_time=start_ns + self.offset,
                                      attributes=attributes, links=links)
        span.end(end_time=max(end_ns, start_ns) + self.offset)

    def parent_context(self, facts: RequestFacts | None) -> Any:
        """The OpenTelemetry context of the request's ``traceparent`` (the
        span builder's thread), or None: no header, or not a valid one (the
        span then starts a trace of its own). Parsed once per distinct
        header, as vLLM parses it (``TraceContextTextMapPropagator``)."""
        headers = None if facts is None else facts.trace_headers
        if not headers:
            return None
        traceparent = headers.get("traceparent")
        if not traceparent:
            return None
        key = (traceparent, headers.get("tracestate"))
        contexts = self._contexts
        if key in contexts:
            return contexts[key]
        from opentelemetry import trace

        if self._propagator is None:
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            self._propagator = TraceContextTextMapPropagator()
        context = self._propagator.extract(headers)
        if not trace.get_current_span(context).get_span_context().is_valid:
            context = None
        if len(contexts) >= _MAX_CONTEXTS:
            contexts.clear()
        contexts[key] = context
        return context
