"""The arithmetic of shared-budget mode: the fleet bound and the size of each ask.

Pure logic, no I/O: ``fleet_bound`` states how many tokens of one user the
whole fleet may spend in a window (tests check the lease protocol against
it), and ``LeaseSizer`` decides, each round of an engine's lease thread
(``lease_thread``), how many tokens to ask the store (``lease_store``) for
per user.

**The fleet bound.** Every token spent was granted at most ``H`` before it
was spent, and every granted token occupies one GCRA slot of length
``1/limit`` that starts no earlier than its grant and no later than ``B``
after it. So in any window of ``W`` seconds the whole fleet spends at most
``floor((W + H + B) x limit) + 1`` tokens of a user, with ``H`` the horizon
and ``B`` the lookahead (0.5 s and 0.25 s by default): the long-run rate is
exactly the limit, a short window may hold ``(H + B) x limit`` more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Set
from fractions import Fraction

from vllm_output_rate.lease_store import LeaseAsk
from vllm_output_rate.limiter import NS_PER_S
from vllm_output_rate.shared_settings import SharedStateSettings


def fleet_bound(window_s: float, rate: Fraction | float, horizon_s: float,
                lookahead_s: float) -> int:
    """Most tokens the whole fleet spends for one user in any window of
    ``window_s`` seconds in shared-budget mode (see the module docstring)."""
    return math.floor((window_s + horizon_s + lookahead_s) * float(rate) + 1e-9) + 1


class LeaseSizer:
    """How many tokens one engine asks the store for, per user and round.

    Kept by the engine's lease thread (one caller): each user's recent
    demand, and when it last asked."""

    def __init__(self, settings: SharedStateSettings) -> None:
        self.tick_s = settings.tick_s
        #: how long after the store granted a user less than asked the
        #: engine asks again (ns): the fleet's budget is spent for now
        self.retry_ns = int(max(settings.tick_s, settings.lookahead_s / 2) * NS_PER_S)
        #: user -> tokens per second wanted lately
        self.demand: dict[str, float] = {}
        self._last_ask_ns = 0

    def asks(self, now_ns: int, recent: Mapping[str, int], short: Set[str],
             used: Mapping[str, int], held: Mapping[str, int], sharing: Mapping[str, int],
             retry_at: Mapping[str, int], rate_of: Callable[[str], Fraction]) -> list[LeaseAsk]:
        """Per user with demand on this engine: what to ask for.

        ``recent``: tokens spent per user since the last round; ``short``:
        users the engine ran short of leases for; ``used``: spends to report
        to the store (after a fallback or a reset); ``held``: tokens leased
        and not spent yet; ``sharing``: engines the store last said share
        each user; ``retry_at``: users not to ask for before then (ns).

        A user it ran short of: at least its fair share (limit / engines
        sharing the user; the store caps a contended budget at that), more
        if it spent more lately, to last until the next ask (a retry
        interval and two ticks). Any other user: one and a half times what
        it spent lately, for two ticks. What an engine holds stays well
        under the horizon's worth, so leases are spent, not left to expire.
        Never above the limit."""
        tick = self.tick_s
        elapsed = max((now_ns - self._last_ask_ns) / NS_PER_S, tick)
        self._last_ask_ns = now_ns
        cover_short = self.retry_ns / NS_PER_S + 2 * tick
        demand = self.demand
        users = set(recent) | short
        # A user's demand estimate decays over a few ticks without spends.
        for user in list(demand):
            if user not in users:
                demand[user] *= 0.5
                if demand[user] * 2 * tick < 0.5:
                    del demand[user]
        asks = []
        for user in users | set(demand) | set(used):
            if retry_at.get(user, 0) > now_ns and not used.get(user):
                continue  # the store said no for now: ask again later
            rate = rate_of(user)
            limit = float(rate)
            spend = recent.get(user, 0) / elapsed
            if user in short:
                # (Doubling from what it spent or asked last: a user whose
                # limit is far above what one engine serves gets no lease it
                # cannot use, and reaches what it can use in a few asks.)
                fair = limit / max(1, sharing.get(user, 1))
                grown = 2 * max(spend, demand.get(user, 0.0)) + 4 / cover_short
                wanted, cover = max(min(fair, grown), spend), cover_short
            else:
                wanted, cover = max(1.5 * spend, demand.get(user, 0.0)), 2 * tick
            wanted = demand[user] = min(wanted, limit)
            want = max(0, math.ceil(wanted * cover) - held.get(user, 0))
            if want or used.get(user):
                asks.append(LeaseAsk(user, rate, want, used.get(user, 0)))
        return asks
