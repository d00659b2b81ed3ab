"""The limiter's bound, checked over every window of a user's token events:
tokens <= floor((W + burst) x rate) + 1 (``gcra_worst_window``: the worst
window, ``gcra_max_excess``: the largest excess in one pass, for long
runs). Exact integer arithmetic."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from vllm_output_rate.limiter import BURST_NS, NS_PER_S


def gcra_worst_window(events: list[tuple[int, int]], rate: Fraction,
                      starts: list[int] | None = None, burst_ns: int = BURST_NS,
                      extra: int = 1) -> dict[str, Any]:
    """The window with the largest excess over floor((W + burst) x rate) +
    ``extra`` (1: the limiter's bound; a prompt budget without chunked
    prefill takes a prompt whole: its largest prompt).

    ``events``: (t_ns, tokens) sorted by time, one per step. A window runs from
    event i to event j (both included); its length W is t_j - starts[i] where
    ``starts[i]`` is the earliest moment event i's step can have been
    dispatched (t_i itself for the strict bound). Exact integer arithmetic.
    """
    import numpy as np

    if not events:
        return {"excess": -1, "violations": 0, "windows": 0}
    t = np.array([e[0] for e in events], dtype=np.int64)
    n = np.array([e[1] for e in events], dtype=np.int64)
    s = t if starts is None else np.array(starts, dtype=np.int64)
    s = np.minimum(s, t)
    cum = np.concatenate(([0], np.cumsum(n)))
    num, den = rate.numerator, rate.denominator * 1_000_000_000
    worst: dict[str, Any] = {"excess": None, "violations": 0, "windows": 0}
    big = num * (int(t[-1] - s.min()) + burst_ns) >= (1 << 62)
    for i in range(len(t)):
        w = t[i:] - s[i]
        tokens = cum[i + 1:] - cum[i]
        if big:
            bound = np.array([(int(x) + burst_ns) * num // den + extra for x in w], dtype=object)
            excess = np.array(tokens, dtype=object) - bound
        else:
            bound = (w + burst_ns) * num // den + extra
            excess = tokens - bound
        k = int(np.argmax(excess))
        worst["windows"] += len(w)
        bad = int(np.count_nonzero(excess > 0))
        worst["violations"] += bad
        if worst["excess"] is None or excess[k] > worst["excess"]:
            worst.update(excess=int(excess[k]), tokens=int(tokens[k]), bound=int(bound[k]),
                         window_s=int(t[i + k] - t[i]) / 1e9, from_ns=int(t[i]),
                         to_ns=int(t[i + k]), slack_s=int(t[i] - s[i]) / 1e9)
    return worst


def gcra_max_excess(events: list[tuple[int, int]], rate: Fraction, starts: list[int] | None = None,
                    burst_ns: int = BURST_NS) -> tuple[Fraction, tuple[int, int]]:
    """The largest ``tokens - (W + burst) x rate - 1`` over every window of
    ``events`` (as in ``gcra_worst_window``: event i to event j, W = t_j -
    starts[i]), and its (i, j), in one pass: for soak-length runs.

    Tokens are whole numbers, so a window holds at most ``floor((W + burst)
    x rate) + 1`` of them exactly when this excess is <= 0 (``C - 1 <=
    floor(x)`` iff ``C - 1 <= x``): the same verdict as
    ``gcra_worst_window``, exact (integer arithmetic), in O(n). Empty:
    (-1, (0, 0))."""
    if not events:
        return Fraction(-1), (0, 0)
    num, den = rate.numerator, rate.denominator * NS_PER_S
    # excess(i, j) x den = (den C_j - num t_j) + (num s_i - den C_{i-1}) - num burst - den,
    # with C the running token count: the best i for each j is a running maximum
    best: int | None = None
    where = (0, 0)
    lead = lead_i = None
    before = 0  # C_{i-1}
    for k, (t, n) in enumerate(events):
        s = t if starts is None else min(starts[k], t)
        here = num * s - den * before
        if lead is None or here > lead:
            lead, lead_i = here, k
        before += n
        value = den * before - num * t + lead
        if best is None or value > best:
            best, where = value, (lead_i, k)
    return Fraction(best - num * burst_ns - den, den), where
