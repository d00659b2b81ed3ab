"""Engine snapshots -> Prometheus metrics on vLLM's own ``/metrics``.

Runs in the API-server process(es). The engine-core process writes a JSON
snapshot of its aggregates every second (``telemetry.export``); this
collector reads the snapshots at scrape time and yields metric families, so
one scrape of vLLM's ``/metrics`` shows the engine's limiter metrics beside
vLLM's own. An unreadable snapshot is skipped and counted, never raised.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

from vllm_output_rate.telemetry.metrics import BY_NAME, METRICS, PREFIX

logger = logging.getLogger("vllm_output_rate.telemetry")

_installed_dirs: set[str] = set()


def read_snapshots(directory: str) -> tuple[list[dict[str, Any]], int]:
    """The engine snapshots in ``directory`` and how many could not be read
    (one being replaced right now: the next read gets it)."""
    out, errors = [], 0
    for path in sorted(glob.glob(os.path.join(directory, "engine-*.json"))):
        try:
            with open(path) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            errors += 1
    return out, errors


class SnapshotCollector:
    """A prometheus_client collector over the snapshot files in one directory."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.read_errors = 0

    def _snapshots(self) -> list[dict[str, Any]]:
        out, errors = read_snapshots(self.directory)
        self.read_errors += errors
        return out

    def describe(self) -> list[Any]:
        return []  # unchecked collector: names come from the table at collect time

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        families: dict[str, Any] = {}
        for m in METRICS:
            labels = list(m.all_labels)
            base = PREFIX + m.name
            if m.kind == "counter":
                families[m.name] = CounterMetricFamily(base, m.help, labels=labels, unit="")
            elif m.kind == "gauge":
                families[m.name] = GaugeMetricFamily(base, m.help, labels=labels)
            else:
                families[m.name] = HistogramMetricFamily(base, m.help, labels=labels)
        for snap in self._snapshots():
            engine = (snap.get("model_name", ""), str(snap.get("engine", "0")))
            for name, labels, value in snap.get("counters", ()):
                if name in families and BY_NAME[name].kind == "counter":
                    families[name].add_metric([*engine, *labels], value)
            for name, labels, value in snap.get("gauges", ()):
                if name in families and BY_NAME[name].kind == "gauge":
                    families[name].add_metric([*engine, *labels], value)
            for name, labels, counts, total, _count in snap.get("histograms", ()):
                metric = BY_NAME.get(name)
                if metric is None or metric.kind != "histogram":
                    continue
                buckets, running = [], 0
                for bound, n in zip([*map(str, metric.buckets), "+Inf"], counts):
                    running += n
                    buckets.append((bound, running))
                families[name].add_metric([*engine, *labels], buckets, total)
        yield from families.values()


def install(directory: str) -> SnapshotCollector | None:
    """Register the collector for ``directory`` in prometheus_client's
    default registry (what vLLM's single API server serves), once; and in
    the registry vLLM builds for ``/metrics`` when several API-server
    processes share prometheus_client's multiprocess mode."""
    if directory in _installed_dirs:
        return None
    from prometheus_client import REGISTRY

    collector = SnapshotCollector(directory)
    REGISTRY.register(collector)
    _installed_dirs.add(directory)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        _hook_multiprocess_registry(collector)
    return collector


def _hook_multiprocess_registry(collector: SnapshotCollector) -> None:
    """With ``--api-server-count N > 1`` vLLM sets PROMETHEUS_MULTIPROC_DIR,
    and each API server's ``/metrics`` (prometheus-fastapi-instrumentator's
    handler, and vLLM's ``get_prometheus_registry``) builds a fresh registry
    per scrape holding only prometheus_client's ``MultiProcessCollector``,
    looked up on its module at call time. Replace that class by a subclass
    that also yields the engine snapshots: they are files every API server
    can read, so whichever one answers a scrape shows each engine's series
    once, and the counters are not summed over API servers."""
    from prometheus_client import multiprocess

    upstream = multiprocess.MultiProcessCollector
    if getattr(upstream, "_output_rate_snapshots", None) is not None:
        upstream._output_rate_snapshots = collector
        return

    class MultiProcessCollector(upstream):  # type: ignore[misc, valid-type]
        _output_rate_snapshots = collector

        def collect(self):  # type: ignore[no-untyped-def]
            yield from super().collect()
            yield from type(self)._output_rate_snapshots.collect()

    multiprocess.MultiProcessCollector = MultiProcessCollector
