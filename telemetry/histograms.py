"""Histograms in plain Python, and the batch arithmetic the folds use.

The first stop on the data's path: every fold of ``telemetry.folds`` ends
in these. ``Histogram`` holds bucket counts (non-cumulative), sum and
count; ``observe_by_label`` observes a fold's thousands of values (ns)
into their labels' histograms by numpy over the whole batch, and
``sums_by_key`` sums integers per key the same way.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from operator import add
from typing import Any

import numpy as np


class Histogram:
    """Bucket counts (non-cumulative), sum and count, in plain Python."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    def add(self, other: Histogram) -> None:
        """Fold ``other`` (same buckets) into this one."""
        self.counts = [a + b for a, b in zip(self.counts, list(other.counts))]
        self.sum += other.sum
        self.count += other.count

    def snapshot(self) -> list[Any]:
        return [list(self.counts), self.sum, self.count]


def ns_edges(bounds: tuple[float, ...]) -> tuple[int, ...]:
    """Integer edges ``t`` with ``bisect_right(t, v) == bisect_left(bounds,
    v * 1e-9)`` for every integer ``v`` (ns): the smallest ``v`` each bound
    is below."""
    edges = []
    for bound in bounds:
        v = int(bound * 1e9) - 2
        while not bound < v * 1e-9:
            v += 1
        edges.append(v)
    return tuple(edges)


_EDGES: dict[tuple[float, ...], Any] = {}


def _key_index(keys: list[Any]) -> tuple[dict[Any, int], Any]:
    """The distinct keys in order, each with its position (a dict pass in
    C, then one per distinct key), and each key's position as an array."""
    index: dict[Any, int] = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    return index, np.fromiter(map(index.__getitem__, keys), dtype=np.int64, count=len(keys))


def sums_by_key(keys: list[Any], values: list[int]) -> dict[Any, int]:
    """key -> the sum of ``values[i]`` over the ``i`` where ``keys[i]`` is
    that key (integers; numpy over the batch, one Python pass per key)."""
    if not keys:
        return {}
    index, which = _key_index(keys)
    sums = np.bincount(which, weights=np.fromiter(values, dtype=np.int64, count=len(values)),
                       minlength=len(index))
    return dict(zip(index, np.rint(sums).astype(np.int64).tolist()))


def observe_by_label(labels: list[str | None], values_ns: list[int],
                     hist_of: Callable[[Any], Histogram]) -> None:
    """Observe ``values_ns[i]`` (ns) in the histogram of ``labels[i]``: the
    buckets found and counted per (label, bucket) by numpy over the whole
    batch (a fold's thousands of values), then a loop per label."""
    if not values_ns:
        return
    bounds = hist_of(labels[0]).bounds
    edges = _EDGES.get(bounds)
    if edges is None:
        edges = _EDGES[bounds] = np.asarray(ns_edges(bounds), dtype=np.int64)
    n = len(values_ns)
    values = np.fromiter(values_ns, dtype=np.int64, count=n)
    index, which = _key_index(labels)
    width = len(edges) + 1
    counts = np.bincount(which * width + np.searchsorted(edges, values, side="right"),
                         minlength=len(index) * width).reshape(len(index), width)
    sums = np.bincount(which, weights=values, minlength=len(index)).tolist()
    totals = counts.sum(axis=1).tolist()
    rows = counts.tolist()  # (plain ints: no numpy scalar per bucket)
    for label, i in index.items():
        hist = hist_of(label)
        hist.counts = list(map(add, hist.counts, rows[i]))
        hist.count += totals[i]
        hist.sum += sums[i] * 1e-9
