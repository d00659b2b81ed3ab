"""Sample statistics of the tools' reports (``verify``, ``compare_upstream``).

The engine's spans compute their spacing quantiles differently on purpose:
see ``vllm_output_rate.tracing.attributes.quantile``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0 <= q <= 1) of ``values``, interpolated linearly
    between the two nearest ranks (numpy's default "linear" method): position
    q x (n - 1) in the sorted values. NaN when there are no values."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class CountedSamples:
    """Integer samples kept exactly as value -> count: memory grows with the
    distinct values, not with the samples (a token spacing in virtual time
    takes few: a multiple of the step with a fixed step). ``quantile`` is
    ``quantile``'s of the same samples; iterating yields them in order."""

    __slots__ = ("counts", "n")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.n = 0

    def append(self, value: int) -> None:
        counts = self.counts
        counts[value] = counts.get(value, 0) + 1
        self.n += 1

    def add(self, value: int, times: int) -> None:
        if times > 0:
            self.counts[value] = self.counts.get(value, 0) + times
            self.n += times

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for value in sorted(self.counts):
            for _ in range(self.counts[value]):
                yield value

    def quantile(self, q: float) -> float:
        if not self.n:
            return float("nan")
        k = (self.n - 1) * q
        lo, hi = math.floor(k), math.ceil(k)
        lo_v = hi_v = None
        seen = 0
        for value in sorted(self.counts):
            seen += self.counts[value]
            if lo_v is None and seen > lo:
                lo_v = value
            if seen > hi:
                hi_v = value
                break
        return lo_v + (hi_v - lo_v) * (k - lo)

