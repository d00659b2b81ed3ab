"""Borrowing: capacity nobody within its guaranteed rate uses, lent to users
over their guaranteed rate, up to each one's ceiling.

A limit written as a pair ``{rate: R, ceiling: C}`` (``config``) makes R the
guaranteed rate, kept by the limiter's GCRA exactly as a plain limit is, and
C the ceiling: a second GCRA per user with a finite ceiling (an
``OutputRateLimiter`` of its own: the same integer arithmetic, the same
bound, ``floor((W + burst) * C) + 1`` tokens in any W seconds), charged for
every token of that user, guaranteed or borrowed; an ``unlimited`` ceiling
has none. A borrowed token is not charged to the guaranteed GCRA, so the
moment the engine is contended again each user has its guaranteed rate.

When the scheduler lends (its business: only what a step leaves after every
request with budget, the resident ones and the waiting ones it keeps room
for, see ``lending``), several borrowers, resident or waiting, are ordered by
the service they borrowed so far divided by their guaranteed rate, smallest
first (the weighted counters of VTC, OSDI'24): leftover capacity is split in
proportion to the guaranteed rates. A user who starts borrowing begins at
the smallest counter among those borrowing, not at zero (no catch-up burst).

With shared budgets (``--output-rate-shared-state``) a user's ceiling is a
fleet-wide budget of its own (``shared_limiter.SharedBudgetLimiter.second_budget``,
the ``make`` of ``Lender``), leased beside its guaranteed rate: each engine
lends only its own idle capacity, and only within the ceiling's tokens it
holds, so the fleet spends at most ``floor((W + H + B) * C) + 1`` tokens of
the user in any W seconds (``fleet_math``).

Pure logic: imports nothing from vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from vllm_output_rate.config import UNLIMITED, OutputRateConfig
from vllm_output_rate.limiter import OutputRateLimiter

#: What ``available`` answers for an unlimited ceiling (more than any step
#: can dispatch).
NO_CEILING = 1 << 30

#: Makes the ceilings' limiter from a default rate and the users' rates.
MakeLimiter = Callable[[Fraction, dict[str, Fraction]], OutputRateLimiter]


class Lender:
    """The ceilings and the borrowing counters of one engine (``make``:
    the ceilings' limiter, the engine's own by default)."""

    def __init__(self, config: OutputRateConfig, make: MakeLimiter | None = None) -> None:
        self.config = config
        self.ceilings = (make or OutputRateLimiter)(*_ceiling_rates(config))
        #: user -> tokens borrowed / guaranteed rate (weighted service)
        self.served: dict[str, float] = {}

    def may_borrow(self, user: str) -> bool:
        return self.config.ceiling_of(user) is not None

    def available(self, user: str, now_ns: int) -> int:
        """Tokens the user's ceiling allows at ``now_ns`` (guaranteed and
        borrowed together); ``NO_CEILING`` for an unlimited one and for a
        user who may not borrow (its guaranteed GCRA is its only limit)."""
        ceiling = self.config.ceiling_of(user)
        if ceiling is None or ceiling == UNLIMITED:
            return NO_CEILING
        return self.ceilings.available(user, now_ns)

    def ready_at_ns(self, user: str) -> int:
        """When ``user``'s ceiling has a token again, for the engine loop's
        wait (0: now, or not known here). Only a fleet-wide ceiling says: its
        tokens come from the lease thread (a round trip, or a retry when the
        fleet's is spent), and asking tells the thread this engine ran short;
        an engine's own ceiling is left out (its users' rates wake it)."""
        ceiling = self.config.ceiling_of(user)
        if ceiling is None or ceiling == UNLIMITED or not hasattr(self.ceilings, "owner"):
            return 0
        return self.ceilings.ready_at_ns(user)

    def settle(self, now_ns: int, spent: Mapping[str, int], borrowed: Mapping[str, int]) -> None:
        """A step's net tokens: ``spent`` (every token, per user with a
        finite ceiling) charged to the ceilings, ``borrowed`` added to the
        counters."""
        self.ceilings.settle(now_ns, spent)
        rate_of = self.config.rate_of
        served = self.served
        for user, n in borrowed.items():
            if n > 0:
                served[user] = served.get(user, 0.0) + n / float(rate_of(user))

    def order(self, borrowers: list[Any]) -> list[Any]:
        """``borrowers`` (requests) in lending order: by the user's counter
        plus one token's weight for each of its streams before this one;
        ties keep their order."""
        served = self.served
        present = {r.output_rate_user for r in borrowers}
        floor = min((served[u] for u in present if u in served), default=0.0)
        for user in present:
            if user not in served:
                served[user] = floor
        rate_of = self.config.rate_of
        streams: dict[str, int] = {}
        keyed = []
        for position, request in enumerate(borrowers):
            user = request.output_rate_user
            k = streams.get(user, 0)
            streams[user] = k + 1
            keyed.append((served[user] + k / float(rate_of(user)), position, request))
        keyed.sort(key=lambda item: item[:2])
        return [item[2] for item in keyed]

    def set_limits(self, config: OutputRateConfig, now_ns: int) -> None:
        """New limits at a step boundary: the ceilings keep their debt as
        the limiter's users do (``OutputRateLimiter.set_limits``); counters
        of users who may no longer borrow are dropped."""
        self.config = config
        self.ceilings.set_limits(*_ceiling_rates(config)[:2], now_ns)
        for user in [u for u in self.served if not self.may_borrow(u)]:
            del self.served[user]

    def close(self) -> None:
        """Borrowing stops (reloaded limits): a fleet-wide ceilings'
        limiter leaves its lease thread."""
        close = getattr(self.ceilings, "close", None)
        if close is not None:
            close()

    def cleanup_idle_users(self, now_ns: int) -> None:
        self.ceilings.cleanup_idle_users(now_ns)
        if self.served and len(self.served) > 4 * max(len(self.ceilings), 1):
            # counters of users gone long ago: the floor rule restarts them
            floor = min(self.served.values())
            self.served = {u: v for u, v in self.served.items() if v > floor}


def lender_for(config: OutputRateConfig, lender: Lender | None, now_ns: int,
               make: MakeLimiter | None = None) -> Lender | None:
    """The lender of reloaded limits: borrowing starts (a new one, its
    ceilings made by ``make``), stops (None) or takes new ceilings
    (``lender``, changed at ``now_ns``)."""
    if not config.borrowing:
        if lender is not None:
            lender.close()
        return None
    if lender is None:
        return Lender(config, make)
    lender.set_limits(config, now_ns)
    return lender


def _ceiling_rates(config: OutputRateConfig) -> tuple[Fraction, dict[str, Fraction]]:
    """The ceilings' limiter: finite ceilings of listed users, and of
    unlisted ones (any positive default when theirs is not finite: then
    ``available`` never asks the limiter for them)."""
    default = config.default_ceiling
    finite_default = default if isinstance(default, Fraction) else config.default_rate
    users = {u: c for u, c in config.ceilings.items() if isinstance(c, Fraction)}
    return finite_default, users
