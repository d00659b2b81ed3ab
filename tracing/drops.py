"""Spans lost on the way out, counted: ``TraceDrops`` (by reason, exported
as ``vllm_output_rate_telemetry_dropped_total``), the bounded and counted
batch processor in front of the exporter, and the queue's size.

On the data's path: the recorder (``recorder``) counts the entries its own
queue drops or cannot build; the SDK spans the builders make go through
``counting_processor`` (made by ``provider``), which bounds its queue and
counts what it drops and what the exporter (``exporters``) fails to send.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Any

logger = logging.getLogger("vllm_output_rate.tracing")


class TraceDrops:
    """Spans that never reached the exporter's far end, by reason.

    ``trace_queue_full``: more spans waiting than a queue holds
    (``OTEL_BSP_MAX_QUEUE_SIZE``, default 2048): the recorder's queue of
    spans to build, or the batch processor's queue of spans to export; the
    span is dropped before the SDK sees it (the SDK would log a warning per
    span). ``trace_export_failed``: the exporter reported failure or raised
    (an unreachable OTLP endpoint, say), or a span could not be built. Each
    reason is logged once; the counts go to
    ``vllm_output_rate_telemetry_dropped_total``.

    ``pending`` is a deque whose append and popleft are atomic; counts are
    written by several threads (scheduler, span builder, exporter), only
    when something is dropped, under a lock.
    """

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.pending: deque[None] = deque()
        self.counts: dict[str, int] = {"trace_queue_full": 0, "trace_export_failed": 0}
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def drop(self, reason: str, n: int, detail: str = "") -> None:
        with self._lock:  # (only on the drop path, never per token)
            self.counts[reason] += n
            first = reason not in self._logged
            self._logged.add(reason)
        if first:
            logger.warning("output-rate traces: %d span(s) dropped (%s)%s; further drops are "
                           "only counted in vllm_output_rate_telemetry_dropped_total",
                           n, reason, f": {detail}" if detail else "")


def counting_processor(exporter: Any, drops: TraceDrops) -> Any:
    """A BatchSpanProcessor behind a bounded, counted queue, exporting
    through ``exporter`` with failures counted."""
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class CountingExporter(SpanExporter):
        def export(self, spans: Any) -> Any:
            for _ in spans:
                try:
                    drops.pending.popleft()
                except IndexError:
                    break
            try:
                result = exporter.export(spans)
            except Exception as exc:  # a broken exporter must not stop the thread
                drops.drop("trace_export_failed", len(spans), f"{type(exc).__name__}: {exc}")
                return SpanExportResult.FAILURE
            if result is not SpanExportResult.SUCCESS:
                drops.drop("trace_export_failed", len(spans), str(result))
            return result

        def shutdown(self) -> None:
            exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return exporter.force_flush(timeout_millis)

    batch = BatchSpanProcessor(CountingExporter(), max_queue_size=drops.max_queue,
                               max_export_batch_size=min(512, drops.max_queue))

    class BoundedProcessor(SpanProcessor):
        def on_start(self, span: Any, parent_context: Any = None) -> None:
            pass

        def on_end(self, span: Any) -> None:
            if len(drops.pending) >= drops.max_queue:
                drops.drop("trace_queue_full", 1)
                return
            drops.pending.append(None)
            batch.on_end(span)

        def shutdown(self) -> None:
            batch.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return batch.force_flush(timeout_millis)

    return BoundedProcessor()


def max_queue_from_env() -> int:
    """``OTEL_BSP_MAX_QUEUE_SIZE`` (default 2048), as the SDK reads it."""
    try:
        return max(int(os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", "2048")), 1)
    except ValueError:
        return 2048
