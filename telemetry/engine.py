"""Engine-side telemetry: handed over on the scheduler's thread, folded and
exported off it. This module is the glue: ``EngineTelemetry``, the
``OutputRateObserver`` (see ``vllm_output_rate.observers``) that
``telemetry.plugin`` registers through ``attach``, lives in the
engine-core process and is made of, along the data's path:

- ``telemetry.intake``: what runs on the scheduler's thread (the hot path):
  each event appended to an inbox, with the reads of the engine that must
  be made then. ``EngineTelemetry`` is an ``Intake``: the observer methods
  the scheduler calls are the intake's own, with no call in between;
- ``telemetry.folds``: the worker's folds of each event into aggregates,
  with ``telemetry.throttle`` (charges, skips, throttle episodes) and
  ``telemetry.spacing`` (token timing);
- ``telemetry.series`` and ``telemetry.books``: the per-user series (with
  the label cap and the overflow bucket) and books (charged windows,
  throttled requests, user states);
- ``telemetry.export`` and ``telemetry.eventlog``: the JSON snapshot for
  the API server's ``/metrics`` and the opt-in event log.

A worker thread of ours drains the inbox every ``DRAIN_INTERVAL_S`` and
exports every ``interval_s``; spans are built from the same plain data
(``tracing.recorder``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from vllm_output_rate import settings, user_label
from vllm_output_rate.observers import EngineView
from vllm_output_rate.telemetry.books import UserBooks
from vllm_output_rate.telemetry.clock import SYSTEM, Clock
from vllm_output_rate.telemetry.eventlog import EventLog
from vllm_output_rate.telemetry.export import SnapshotWriter
from vllm_output_rate.telemetry.folds import Folds, RequestHandles
from vllm_output_rate.telemetry.histograms import Histogram
from vllm_output_rate.telemetry.intake import Intake
from vllm_output_rate.telemetry.labels import UserLabeler
from vllm_output_rate.telemetry.prompt_work import StepCost
from vllm_output_rate.telemetry.series import Series

logger = logging.getLogger("vllm_output_rate.telemetry")

EXPORT_INTERVAL_S = 1.0
#: How often the worker folds what the scheduler's thread handed over.
DRAIN_INTERVAL_S = 0.1


class EngineTelemetry(Intake):
    """Telemetry for one engine's scheduler: the intake, the worker's folds,
    the series and books they fill, the exporters, and the worker thread."""

    def __init__(self, view: EngineView, out_dir: str, interval_s: float = EXPORT_INTERVAL_S,
                 top_k: int | None = None, start_thread: bool = True,
                 spans: Any = None, events_path: str | None = None,
                 defer: bool | None = None, clock: Clock = SYSTEM,
                 step_cost: StepCost | None = None) -> None:
        if top_k is None:
            top_k = settings.get("TOP_K_USERS")
        labeler = UserLabeler(pinned=view.limits().user_rates, top_k=top_k,
                              public=user_label.current().public_id)
        series = Series(view, labeler, bool(events_path))
        handles = RequestHandles(view)
        events = (EventLog(events_path, view, series.counters, handles.user_of, clock)
                  if events_path else None)
        books = UserBooks(view, series, events, clock)
        self.series, self.books, self.events = series, books, events
        #: ``step_cost``: the step-time model that splits step time between
        #: users' prompts (None: ``OUTPUT_RATE_STEP_TIME``, else an estimate)
        self.folds = Folds(spans, series, handles, books, events, step_cost)
        #: ``defer`` off (the default without a thread) folds each event at
        #: once, on the caller's thread
        super().__init__(view, self.folds, not (start_thread if defer is None else defer),
                         events is not None, clock)
        self.exporter = SnapshotWriter(view, series, books, spans,
                                       os.path.join(out_dir, f"engine-{view.engine_index}.json"),
                                       self.state_sizes, clock)
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = None
        if start_thread:
            self._thread = threading.Thread(target=self._run, name="output-rate-telemetry", daemon=True)
            self._thread.start()

    @property
    def counters(self) -> dict:
        return self.series.counters

    @property
    def gauges(self) -> dict:
        return self.series.gauges

    @property
    def histograms(self) -> dict[Any, Histogram]:
        return self.series.histograms

    @property
    def labeler(self) -> UserLabeler:
        return self.series.labeler

    def state_sizes(self) -> dict[str, int]:
        """Entries held in each per-request and per-user container (plain
        numbers; for the reliability runner's churn and soak checks): the
        per-request ones are empty when nothing is live, the per-user ones
        stay within the label cap and ``USER_STATES_CAP``."""
        folds = self.folds
        book, spacing, series = folds.book, folds.spacing, self.series
        activity, states, window = self.books.sizes()
        return {
            "requests.last_token": len(spacing.last_token_ns),
            "requests.throttled": len(book.thr_users),
            "requests.previous": len(spacing.prev_ids),
            "requests.label": len(spacing.request_label),
            "requests.episodes": len(self._episodes),
            "requests.episodes_held": len(self._open_held),
            "requests.events": 0 if self.events is None else len(self.events.tokens),
            "requests.handles": len(folds.handles.handles),
            "users.activity": activity,
            "users.counter_keys": series.key_count(),
            "steps.pending": folds.pending(),
            "requests.episodes_folded": len(book.bases),
            "events.inbox": len(self._inbox),
            "users.states": states,
            "users.window": window,
            "labels": len(series.labeler.labelled_users()),
            "series": len(series.counters) + len(series.gauges) + len(series.histograms),
            "limiter.users": self.view.limiter_stats()["users"],
        }

    # -- the worker thread ------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able copy of everything (safe from another thread): what
        was handed over so far is folded first."""
        self.drain()
        return self.exporter.snapshot()

    def export(self) -> bool:
        """Write the event log's records and one snapshot; on failure count
        a drop and log once."""
        if self.events is not None:
            self.events.write(self.exporter.log_drop_once)
        try:
            return self.exporter.write(self.snapshot)
        finally:
            self._export_due = True

    def _run(self) -> None:
        # (the thread sleeps in real time: its exports are paced on the
        # system's clock whatever clock stamps the data)
        next_export = time.monotonic() + self.interval_s
        while not self._stop.wait(DRAIN_INTERVAL_S):
            self.drain()
            if time.monotonic() >= next_export:
                next_export += self.interval_s
                self.export()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.drain()
        self.folds.fold()
        if self.spans is not None:
            self.spans.shutdown()
        self.export()


def attach(view: EngineView) -> EngineTelemetry | None:
    """The observer factory (registered by ``telemetry.plugin``): telemetry
    for one scheduler, when the serving process set a snapshot directory and
    telemetry is on. Anything that fails here turns telemetry off with a
    logged reason; the limiter runs on."""
    try:
        out_dir = settings.get("TELEMETRY_DIR")
        if not out_dir or not settings.get("TELEMETRY"):
            return None
        os.makedirs(out_dir, exist_ok=True)
        return EngineTelemetry(view, out_dir, spans=_span_recorder(view),
                               events_path=settings.get("EVENTS"))
    except Exception:
        logger.exception("output-rate telemetry could not start; the limiter runs without it")
        return None


def _span_recorder(view: EngineView) -> Any:
    """Traces when asked for (``OTEL_*`` or ``--otlp-traces-endpoint``)."""
    try:
        from vllm_output_rate.tracing.drops import TraceDrops, max_queue_from_env
        from vllm_output_rate.tracing.provider import tracer_from, tracer_provider_from_env
        from vllm_output_rate.tracing.recorder import SpanRecorder

        drops = TraceDrops(max_queue_from_env())
        provider = tracer_provider_from_env(view.otlp_traces_endpoint, drops)
        if provider is None:
            return None
        # (no builder thread: the telemetry's worker builds the spans)
        recorder = SpanRecorder(tracer_from(provider), view, background=False)
        recorder.drops = drops
        recorder.provider = provider
        return recorder
    except Exception:
        logger.exception("output-rate traces could not start; metrics continue without them")
        return None
