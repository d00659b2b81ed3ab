"""What the borrowing modules (``test_borrowing_*.py``) share: limits with a
guaranteed rate and a ceiling, the real scheduler on a virtual clock with
its step reports, and the readings of those reports: a user's dispatched
tokens, their rate, the GCRA bound in every window."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from harness import Driver, VirtualClock, make_scheduler, observe_steps
from vllm_output_rate.limiter import BURST_NS, NS_PER_S

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


def limits(default, users=None, ceilings=None, default_ceiling=None):
    data = {"default_user_output_tokens_per_second": default,
            "user_output_tokens_per_second": users or {}}
    if ceilings:
        data["ceilings"] = ceilings
    if default_ceiling is not None:
        data["default_ceiling"] = default_ceiling
    return data


def setup(lim, is_async=False, step_ms=10.0, **kw):
    clock = VirtualClock()
    sched = make_scheduler(lim, clock=clock, async_scheduling=is_async, **kw)
    steps = []
    observe_steps(sched, steps.append)
    return sched, Driver(sched, clock, step_ms=step_ms, is_async=is_async), clock, steps


def tokens(steps, user, kind=("charged", "borrowed"), since=0):
    """(now_ns, n) of ``user``'s dispatched tokens per step."""
    out = []
    for s in steps:
        if s.now_ns < since:
            continue
        n = sum(1 for k in kind for u in getattr(s, k).values() if u == user)
        if n:
            out.append((s.now_ns, n))
    return out


def rate(spends):
    """Tokens per second over the span of ``spends`` (first to last)."""
    n = sum(k for _, k in spends) - spends[0][1]
    return n / ((spends[-1][0] - spends[0][0]) / NS_PER_S)


def check_bound(spends, limit):
    """The GCRA bound in every window: tokens <= (W + burst) * limit + 1."""
    times = [t for t, n in spends for _ in range(n)]
    for i in range(len(times)):
        for j in range(i, min(len(times), i + 400)):
            window = Fraction(times[j] - times[i], NS_PER_S)
            assert j - i + 1 <= math.floor((window + Fraction(BURST_NS, NS_PER_S)) * limit + 1), (
                times[i], times[j], j - i + 1)
