"""The snapshot exporter: the aggregates, copied and written as JSON.

The end of the data's path in the engine core. Every ``interval_s`` the
worker (``telemetry.engine``) copies the series (``telemetry.series``), the
per-user books (``telemetry.books``), the limits in force and the lease
machinery's numbers into one JSON document and writes it atomically (temp
file + rename) into the telemetry directory; ``telemetry.collector`` in the
API-server process turns the snapshots into Prometheus metrics on vLLM's
own ``/metrics``. A failing write is counted in ``telemetry_dropped_total``
and logged once (one flag with the event log's writes).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

from vllm_output_rate.limits_watch import RESULTS as LIMITS_RESULTS
from vllm_output_rate.observers import EngineView
from vllm_output_rate.telemetry.books import UserBooks, ceiling_value
from vllm_output_rate.telemetry.clock import SYSTEM, Clock
from vllm_output_rate.telemetry.histograms import Histogram
from vllm_output_rate.telemetry.metrics import (
    DEFAULT_LIMIT_TOKENS_PER_SECOND,
    ENGINE_INTER_TOKEN_SECONDS,
    ENGINE_THROTTLED_KV_BLOCKS,
    ENGINE_THROTTLED_REQUESTS,
    LIMITS_INFO,
    LIMITS_LOADED_TIMESTAMP_SECONDS,
    LIMITS_RELOADS,
    SHARED_LIVE_ENGINES,
    SHARED_STORE_CALL_SECONDS,
    SHARED_STORE_CALLS,
    SHARED_STORE_ENTRIES,
    SHARED_STORE_FALLBACK,
    SHARED_STORE_FALLBACK_SECONDS,
    SHARED_STORE_PARTITIONED,
    SHARED_STORE_RESETS,
    SHARED_TOKENS_EXPIRED,
    SHARED_TOKENS_LEASED,
    SHARED_TOKENS_SPENT,
    SHARED_TOKENS_UNLEASED,
    SPACING_BUCKETS,
    STATE_ENTRIES,
    STORE_CALL_BUCKETS,
    TELEMETRY_DROPPED,
    TELEMETRY_SNAPSHOT_TIMESTAMP_SECONDS,
    THROTTLED_KV_BLOCKS,
    THROTTLED_KV_CACHE_RATIO,
    THROTTLED_REQUESTS,
    USER_LIMIT_TOKENS_PER_SECOND,
)
from vllm_output_rate.telemetry.series import Series

logger = logging.getLogger("vllm_output_rate.telemetry")

_THROTTLED_GAUGES = tuple(m.name for m in (
    THROTTLED_REQUESTS, THROTTLED_KV_BLOCKS, ENGINE_THROTTLED_REQUESTS,
    ENGINE_THROTTLED_KV_BLOCKS, THROTTLED_KV_CACHE_RATIO,
))


class SnapshotWriter:
    """One engine's snapshot: built from the aggregates, written to ``path``."""

    def __init__(self, view: EngineView, series: Series, books: UserBooks, spans: Any,
                 path: str, state_sizes: Callable[[], dict[str, int]],
                 clock: Clock = SYSTEM) -> None:
        self.view = view
        self._clock = clock
        self.series = series
        self.books = books
        self.spans = spans
        self.path = path
        self.engine = view.engine_index
        self.model_name = view.model_name
        self._state_sizes = state_sizes
        #: the limits document in force, rebuilt when the digest changes
        self._limits_doc: tuple[str, dict[str, Any]] = ("", {})
        #: store-call latencies of shared-budget mode (exporter thread only)
        self._store_call_hist: Histogram | None = None
        self._drop_logged = False

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able copy of everything (safe from another thread; what
        was handed over is folded by the caller first)."""
        series = self.series
        counters = series.counters.copy()
        drops = getattr(self.spans, "drops", None)
        if drops is not None:
            for reason, n in list(drops.counts.items()):
                counters[TELEMETRY_DROPPED.key(reason)] = n
        gauges = series.gauges.copy()
        idle = not self.view.has_running()
        if idle:
            # No step runs on an idle engine: nothing can be throttled.
            for key in gauges:
                if key[0] in _THROTTLED_GAUGES:
                    gauges[key] = 0
        limits = self._limits(counters, gauges)
        shared = self.view.limiter_stats().get("shared")
        if shared is not None:
            self._fold_shared_state(shared, counters, gauges)
        histograms = series.histograms.copy()
        if self._store_call_hist is not None:
            histograms[SHARED_STORE_CALL_SECONDS.key()] = self._store_call_hist
        total = Histogram(SPACING_BUCKETS)
        total.add(series.spacing_evicted)
        for hist in list(series.spacing.values()):
            total.add(hist)
        histograms[ENGINE_INTER_TOKEN_SECONDS.key()] = total
        try:  # len() of containers the scheduler's thread may be resizing
            for container, n in self._state_sizes().items():
                gauges[STATE_ENTRIES.key(container)] = n
        except RuntimeError:  # (a dict changed size during iteration: next export)
            pass
        written = self._clock.time()
        gauges[TELEMETRY_SNAPSHOT_TIMESTAMP_SECONDS.key()] = written
        books = self.books
        return {
            "engine": self.engine,
            "model_name": self.model_name,
            "written_unix": written,
            "counters": [[n, list(l), v] for (n, l), v in counters.items()],
            "gauges": [[n, list(l), v] for (n, l), v in gauges.items()],
            "histograms": [[n, list(l), *h.snapshot()] for (n, l), h in histograms.items()],
            "limits": limits,
            "users": {"as_of_unix": written if idle else books.user_states_at[2],
                      "states": books.idle_user_states() if idle else books.user_states},
        }

    def _limits(self, counters: dict, gauges: dict) -> dict[str, Any] | None:
        """The limits in force, and their reloads' counters and gauges."""
        status = self.view.limits_status()
        if status is None:
            return None
        for result in LIMITS_RESULTS:
            counters[LIMITS_RELOADS.key(result)] = status.results.get(result, 0)
        gauges[LIMITS_LOADED_TIMESTAMP_SECONDS.key()] = status.loaded_unix
        gauges[LIMITS_INFO.key(status.digest, status.source)] = 1
        if self._limits_doc[0] != status.digest:
            self._limits_doc = (status.digest, limits_document(self.view.limits()))
        doc = self._limits_doc[1]
        # The limits loaded are in force from the next step on: an idle
        # engine shows them at once (its gauges follow too).
        gauges[DEFAULT_LIMIT_TOKENS_PER_SECOND.key()] = doc["default"]
        for user, label in self.series.labeler.labelled_users().items():
            gauges[USER_LIMIT_TOKENS_PER_SECOND.key(label)] = doc["users"].get(
                user, doc["default"])
        return {"source": status.source, "sha256": status.digest,
                "loaded_unix": status.loaded_unix, "reloads": dict(status.results),
                "last_error": status.last_error, **self._limits_doc[1]}

    def _fold_shared_state(self, shared: dict[str, Any], counters: dict, gauges: dict) -> None:
        """The lease machinery's numbers (exporter thread; shared-budget mode)."""
        for metric, key in ((SHARED_STORE_FALLBACK_SECONDS, "fallback_seconds"),
                            (SHARED_STORE_RESETS, "resets")):
            counters[metric.key()] = shared[key]
        # per kind of budget (the rates', and the ceilings' and prompt
        # budgets' the engine leases or leased)
        for kind, numbers in shared.get("kinds", {}).items():
            for metric, key in ((SHARED_TOKENS_LEASED, "leased"), (SHARED_TOKENS_SPENT, "spent"),
                                (SHARED_TOKENS_EXPIRED, "expired"),
                                (SHARED_TOKENS_UNLEASED, "unleased")):
                counters[metric.key(kind)] = numbers[key]
            counters[SHARED_STORE_ENTRIES.key(kind, "ok")] = numbers["entries_ok"]
            counters[SHARED_STORE_ENTRIES.key(kind, "failed")] = numbers["entries_failed"]
        counters[SHARED_STORE_CALLS.key("ok")] = shared["calls"] - shared["failed_calls"]
        counters[SHARED_STORE_CALLS.key("failed")] = shared["failed_calls"]
        gauges[SHARED_STORE_FALLBACK.key()] = shared["fallback"]
        gauges[SHARED_LIVE_ENGINES.key()] = shared["live_engines"]
        gauges[SHARED_STORE_PARTITIONED.key()] = shared.get("partitioned", 0.0)
        # Only this thread touches it (not the series' histograms: the worker's).
        hist = self._store_call_hist
        if hist is None:
            hist = self._store_call_hist = Histogram(STORE_CALL_BUCKETS)
        for seconds in shared["call_seconds"]:
            hist.observe(seconds)

    def log_drop_once(self, what: str, exc: BaseException) -> None:
        if not self._drop_logged:
            self._drop_logged = True
            logger.warning("output-rate telemetry: writing %s failed (%s); "
                           "further failures are only counted", what, exc)

    def write(self, snapshot: Callable[[], dict[str, Any]]) -> bool:
        """Write one snapshot; on failure (also in making it) count a drop
        and log once."""
        try:
            # (compact, and no check for cycles: plain data; about a fifth
            # less CPU than the defaults for a snapshot of 256 users)
            data = json.dumps(snapshot(), check_circular=False, separators=(",", ":"))
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                f.write(data)
            os.replace(tmp, self.path)
            return True
        except Exception as exc:  # never let telemetry hurt the engine
            self.series.counters[TELEMETRY_DROPPED.key("export_failed")] += 1
            self.log_drop_once(f"the snapshot {self.path}", exc)
            return False


def limits_document(config: Any) -> dict[str, Any]:
    """The limits as plain data for the snapshot and the introspection
    endpoints: ``default``, ``tiers``, ``users`` (user -> limit),
    ``user_tiers``, ``unlisted_users``; limits as numbers (tok/s); with
    borrowing also ``ceilings``, ``tier_ceilings`` and ``default_ceiling``;
    with prompt budgets ``prompt_rates``, ``tier_prompt_rates`` and
    ``default_prompt_rate`` (prompt tokens per second, "unlimited", or None).
    Made when the limits' digest changes, not per export."""
    doc = {
        "default": float(config.default_rate),
        "tiers": {t: float(r) for t, r in config.tiers.items()},
        "users": {u: float(r) for u, r in config.user_rates.items()},
        "user_tiers": dict(config.user_tiers),
        "unlisted_users": config.unlisted_users,
    }
    if config.borrowing:
        # guaranteed rates above; ceilings (tok/s or "unlimited") of the
        # users, tiers and default that have one
        doc["ceilings"] = {u: ceiling_value(c) for u, c in config.ceilings.items()}
        doc["tier_ceilings"] = {t: ceiling_value(c) for t, c in config.tier_ceilings.items()}
        doc["default_ceiling"] = ceiling_value(config.default_ceiling)
    if config.prompt_budgets:
        doc["prompt_rates"] = {u: ceiling_value(r) for u, r in config.prompt_rates.items()}
        doc["tier_prompt_rates"] = {t: ceiling_value(r)
                                    for t, r in config.tier_prompt_rates.items()}
        doc["default_prompt_rate"] = ceiling_value(config.default_prompt_rate)
    return doc
