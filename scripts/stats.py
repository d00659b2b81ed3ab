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
