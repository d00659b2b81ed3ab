"""What the limiter's scheduler-level modules (``test_scheduler_*.py``)
share: the four charge paths every test of theirs runs under (the
``charge_path`` fixture, autouse: each module imports it), the limits, and
a limited scheduler on a virtual clock with its driver (see harness)."""

from __future__ import annotations

import pytest

from harness import Driver, VirtualClock, make_scheduler
from vllm_output_rate import scheduler as orl_scheduler
from vllm_output_rate.ledger import OutputRateState
from vllm_output_rate.limiter import OutputRateLimiter

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


class SettledLimiter(OutputRateLimiter):
    """The plain limiter's rules, through the scheduler's other books: a
    limiter that is not exactly ``OutputRateLimiter`` (shared budgets) is
    asked once per user in a step and settled once at its end, where the
    plain one is charged token by token as the step goes."""


@pytest.fixture(autouse=True, params=["held", "tail", "held-settled", "tail-settled"])
def charge_path(request, monkeypatch):
    """Every test of a module that imports this runs four times: with
    throttled running requests held out of vLLM's loop (where the KV cache
    has room) and with them left at the tail of ``running`` for the charge
    point to refuse (as under KV pressure); each with the plain limiter
    charged token by token and with a limiter settled once per step. One
    set of charge rules."""
    if request.param.startswith("tail"):
        monkeypatch.setattr(OutputRateState, "hold_back", False)
    if request.param.endswith("settled"):
        monkeypatch.setattr(
            orl_scheduler.OutputRateSchedulerMixin, "_orl_new_limiter",
            lambda self, config: SettledLimiter(config.default_rate, config.user_rates))
    return request.param


def limits(default, **users):
    return {
        "default_user_output_tokens_per_second": default,
        "user_output_tokens_per_second": users,
    }


def ahead(lim):
    """``lim`` with ``--output-rate-prefill-ahead``: the prompts of users out
    of budget computed ahead of it (short of their first token)."""
    return {**lim, "prefill_ahead": True}


def setup(lim, is_async=False, step_ms=10.0, **kw):
    clock = VirtualClock()
    sched = make_scheduler(lim, clock=clock, async_scheduling=is_async, **kw)
    return sched, Driver(sched, clock, step_ms=step_ms, is_async=is_async), clock


def exhaust(sched, drv, user="a"):
    """Take the user's whole budget now, through a running request."""
    sched.output_rate.limiter.try_take(user, sched.output_rate.clock())
    while sched.output_rate.limiter.try_take(user, sched.output_rate.clock()):
        pass
