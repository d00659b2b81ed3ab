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
import time
from collections.abc import Callable
from typing import Any

from vllm_output_rate.limits_watch import RESULTS as LIMITS_RESULTS
from vllm_output_rate.observers import EngineView
from vllm_output_rate.telemetry.books import UserBooks, ceiling_value
from vllm_output_rate.telemetry.histograms import Histogram
from vllm_output_rate.telemetry.metrics import SPACING_BUCKETS, STORE_CALL_BUCKETS
from vllm_output_rate.telemetry.series import Series

logger = logging.getLogger("vllm_output_rate.telemetry")

_THROTTLED_GAUGES = (
    "throttled_requests", "throttled_kv_blocks", "engine_throttled_requests",
    "engine_throttled_kv_blocks", "throttled_kv_cache_ratio",
)


class SnapshotWriter:
    """One engine's snapshot: built from the aggregates, written to ``path``."""

    def __init__(self, view: EngineView, series: Series, books: UserBooks, spans: Any,
                 path: str, state_sizes: Callable[[], dict[str, int]]) -> None:
        self.view = view
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
                counters[("telemetry_dropped", (reason,))] = n
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
            histograms[("shared_store_call_seconds", ())] = self._store_call_hist
        total = Histogram(SPACING_BUCKETS)
        total.add(series.spacing_evicted)
        for hist in list(series.spacing.values()):
            total.add(hist)
        histograms[("engine_inter_token_seconds", ())] = total
        try:  # len() of containers the scheduler's thread may be resizing
            for container, n in self._state_sizes().items():
                gauges[("state_entries", (container,))] = n
        except RuntimeError:  # (a dict changed size during iteration: next export)
            pass
        written = time.time()
        gauges[("telemetry_snapshot_timestamp_seconds", ())] = written
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
            counters[("limits_reloads", (result,))] = status.results.get(result, 0)
        gauges[("limits_loaded_timestamp_seconds", ())] = status.loaded_unix
        gauges[("limits_info", (status.digest, status.source))] = 1
        if self._limits_doc[0] != status.digest:
            self._limits_doc = (status.digest, limits_document(self.view.limits()))
        doc = self._limits_doc[1]
        # The limits loaded are in force from the next step on: an idle
        # engine shows them at once (its gauges follow too).
        gauges[("default_limit_tokens_per_second", ())] = doc["default"]
        for user, label in self.series.labeler.labelled_users().items():
            gauges[("user_limit_tokens_per_second", (label,))] = doc["users"].get(
                user, doc["default"])
        return {"source": status.source, "sha256": status.digest,
                "loaded_unix": status.loaded_unix, "reloads": dict(status.results),
                "last_error": status.last_error, **self._limits_doc[1]}

    def _fold_shared_state(self, shared: dict[str, Any], counters: dict, gauges: dict) -> None:
        """The lease machinery's numbers (exporter thread; shared-budget mode)."""
        for name, key in (("shared_tokens_leased", "leased"), ("shared_tokens_spent", "spent"),
                          ("shared_tokens_expired", "expired"),
                          ("shared_tokens_unleased", "unleased"),
                          ("shared_store_fallback_seconds", "fallback_seconds"),
                          ("shared_store_resets", "resets")):
            counters[(name, ())] = shared[key]
        counters[("shared_store_calls", ("ok",))] = shared["calls"] - shared["failed_calls"]
        counters[("shared_store_calls", ("failed",))] = shared["failed_calls"]
        gauges[("shared_store_fallback", ())] = shared["fallback"]
        gauges[("shared_live_engines", ())] = shared["live_engines"]
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
            data = json.dumps(snapshot())
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                f.write(data)
            os.replace(tmp, self.path)
            return True
        except Exception as exc:  # never let telemetry hurt the engine
            self.series.counters[("telemetry_dropped", ("export_failed",))] += 1
            self.log_drop_once(f"the snapshot {self.path}", exc)
            return False


def limits_document(config: Any) -> dict[str, Any]:
    """The limits as plain data for the snapshot and the introspection
    endpoints: ``default``, ``tiers``, ``users`` (user -> limit),
    ``user_tiers``, ``unlisted_users``; limits as numbers (tok/s); with
    borrowing also ``ceilings``, ``tier_ceilings`` and ``default_ceiling``.
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
    return doc
