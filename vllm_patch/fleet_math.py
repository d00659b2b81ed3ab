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
The same holds for each of a user's other fleet-wide budgets, leased the
same way (``lease_lane``): its ceiling C bounds every output token of the
user, guaranteed or borrowed, by ``floor((W + H + B) x C) + 1``, and its
prompt budget P the prompt tokens computed for it (with chunked prefill) by
``floor((W + H + B) x P) + 1``.

**Long slices** (``slice_ms`` = ``L``, off by default). A user whose
spending on an engine is steady (the tokens it spent in each of the last
two windows of ``L`` differ by at most a quarter, or two tokens) is asked
for a long slice: what it spent lately, and a quarter more, for ``L`` and
the time to the next ask, only when what it holds runs low; the engine
releases the slice over ``L`` (``shared_limiter``). The store may grant
such a slice's slots up to ``B + L`` ahead, and the lease lives ``H + L``:
for such a user the bound's terms are ``H + L`` and ``B + L``, so
``floor((W + H + B + 2L) x limit) + 1`` (``SharedStateSettings.long_horizon_s``,
``long_lookahead_s``); the long-run rate is still the limit. A user never
leased a long slice keeps the terms ``H`` and ``B``. A slice falling due
before the next round of its store is asked on the round
(``LeaseSizer.early_asks``): the same slice, asked up to a round early, so
the terms do not change; its next one is due a slice after this one was
due (one ask a slice, as before).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Set
from fractions import Fraction

from vllm_output_rate.lease_store import RATE, LeaseAsk
from vllm_output_rate.limiter import NS_PER_S
from vllm_output_rate.shared_settings import SharedStateSettings


def fleet_bound(window_s: float, rate: Fraction | float, horizon_s: float,
                lookahead_s: float) -> int:
    """Most tokens the whole fleet spends for one user in any window of
    ``window_s`` seconds in shared-budget mode (see the module docstring)."""
    return math.floor((window_s + horizon_s + lookahead_s) * float(rate) + 1e-9) + 1


class LeaseSizer:
    """How many tokens one engine asks the store for, per user and round.

    Kept by the engine's lease thread (one caller), one per kind of budget
    (``kind``: its asks name it): each user's recent demand, and when it
    last asked."""

    def __init__(self, settings: SharedStateSettings, kind: str = RATE) -> None:
        self.kind = kind
        self.tick_s = settings.tick_s
        #: how long after the store granted a user less than asked the
        #: engine asks again (ns): the fleet's budget is spent for now
        self.retry_ns = int(max(settings.tick_s, settings.lookahead_s / 2) * NS_PER_S)
        #: user -> tokens per second wanted lately
        self.demand: dict[str, float] = {}
        self._last_ask_ns = 0
        self.slice_s = settings.slice_s
        self._slice_ns = int(settings.slice_s * NS_PER_S)
        #: (long slices) user -> [window start ns, tokens spent in it, in
        #: the window before, in the one before that, then the rounds it
        #: was short of leases in the same three windows]
        self.meter: dict[str, list[int]] = {}
        self._sweep_ns = 0
        #: (long slices) user -> when its next long slice is asked for (ns)
        self.next_long: dict[str, int] = {}
        #: (long slices) users whose last long slice came short of the ask
        self.cut: set[str] = set()

    def _long_ask(self, user: str, rate: Fraction, wanted: float, held: Mapping[str, int],
                  now_ns: int) -> LeaseAsk | None:
        """A long slice of ``wanted`` tokens per second, less what it holds
        (None: it holds enough). Its next one is due a slice after this one
        was due (a slice after now if late): a slice asked early
        (``early_asks``) keeps its user's cadence, one ask a slice."""
        want = math.ceil(wanted * self.slice_s) - held.get(user, 0)
        if want <= 0:
            return None
        due = self.next_long.get(user, 0)
        self.next_long[user] = (due if due > now_ns else now_ns) + self._slice_ns
        return LeaseAsk(user, rate, want, 0, long=True, kind=self.kind)

    def early_asks(self, now_ns: int, until: Callable[[str], int], asked: Set[str],
                   held: Mapping[str, int], sharing: Mapping[str, int],
                   retry_at: Mapping[str, int], rate_of: Callable[[str], Fraction]) -> list[LeaseAsk]:
        """(Long slices) The piggyback: the steady users whose next long
        slice falls due before ``until(user)`` (the end of the round of the
        store it is on, a cluster's shard, when that store is called on its
        round now; else 0), asked now in that call instead of a call of
        their own (``asked``: users asked this round already). A slice
        asked early is the same slice (its grant, its lease's life and its
        slots' lookahead are a slice's: the bound's terms do not change),
        and the user's next one is due a slice after this one was due: a
        user is still asked once a slice, and the slices of one store's
        users are asked on its rounds (``lease_store.round_s``)."""
        asks = []
        for user, due in self.next_long.items():
            if due <= now_ns or user in asked or due >= until(user):
                continue
            if retry_at.get(user, 0) > now_ns:
                continue
            rate = rate_of(user)
            limit = float(rate)
            steady = self.steady_rate(user, now_ns, limit / max(1, sharing.get(user, 1)))
            if steady is None:
                continue
            wanted = self.demand[user] = min(steady, limit)
            ask = self._long_ask(user, rate, wanted, held, now_ns)
            if ask is not None:
                asks.append(ask)
        return asks

    def long_granted(self, user: str, tokens: int, want: int, now_ns: int) -> None:
        """(The lease thread) What the store granted of a long slice (the
        next one is asked for a slice later; none at all: a retry later)."""
        if tokens < want:
            self.cut.add(user)
            if tokens <= 0:
                self.next_long[user] = now_ns + self.retry_ns
        else:
            self.cut.discard(user)

    def steady_rate(self, user: str, now_ns: int, fair: float = 0.0) -> float | None:
        """Tokens per second to lease ``user`` on this engine for a long
        slice, if it is steady over the last two whole windows of
        ``slice_s``; else None. Steady: it spent in both, and either ran
        short of leases in both (it wants more than it gets: the most it
        spent, and a quarter more if its last slice came whole, at least its
        fair share ``fair``), or
        spent within a quarter (or two tokens) of the same in both (the
        most, and a quarter more)."""
        m = self.meter.get(user)
        if m is None:
            return None
        self._roll(m, now_ns)
        last, before = m[2], m[3]
        if last <= 0 or before <= 0:
            return None
        most = (last if last > before else before) / self.slice_s
        if m[5] > 0 and m[6] > 0:
            # more than it got only if its last slice came whole
            grown = most if user in self.cut else 1.25 * most
            return grown if grown > fair else fair
        if abs(last - before) > max(2, most * self.slice_s / 4):
            return None
        return 1.25 * most

    def _roll(self, m: list[int], now_ns: int) -> None:
        passed = (now_ns - m[0]) // self._slice_ns
        if passed >= 1:
            if passed == 1:
                m[1], m[2], m[3], m[4], m[5], m[6] = 0, m[1], m[2], 0, m[4], m[5]
            elif passed == 2:
                m[1], m[2], m[3], m[4], m[5], m[6] = 0, 0, m[1], 0, 0, m[4]
            else:
                m[1:] = [0] * 6
            m[0] += passed * self._slice_ns

    def asks(self, now_ns: int, recent: Mapping[str, int], short: Set[str],
             used: Mapping[str, int], held: Mapping[str, int], sharing: Mapping[str, int],
             retry_at: Mapping[str, int], rate_of: Callable[[str], Fraction],
             paced: Set[str] = frozenset()) -> list[LeaseAsk]:
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
        it spent lately, for two ticks. A user the store granted less than
        asked (``retry_at``) is not asked for before its retry, its demand
        kept meanwhile, and after it only once it spends or runs short
        (then as a user short of leases): one ask per retry, whatever its
        limit (a ceiling's, a prompt budget's). What an engine holds stays well
        under the horizon's worth, so leases are spent, not left to expire.
        ``paced``: users that waited for the release of their long slice
        (as good as short, for steadiness). With long slices, a steady user (``steady_rate``): a long slice
        (see the module docstring), nothing while it holds enough (``held``
        counts the part of a slice not released yet). Never above the limit."""
        tick = self.tick_s
        elapsed = max((now_ns - self._last_ask_ns) / NS_PER_S, tick)
        self._last_ask_ns = now_ns
        cover_short = self.retry_ns / NS_PER_S + 2 * tick
        demand = self.demand
        users = set(recent) | short
        slice_s = self.slice_s
        meter = self.meter
        if slice_s:
            for user in users | paced:
                m = meter.get(user)
                if m is None:
                    m = meter[user] = [now_ns, 0, 0, 0, 0, 0, 0]
                self._roll(m, now_ns)
                m[1] += recent.get(user, 0)
                if user in short or user in paced:
                    m[4] += 1
        # A user's demand estimate decays over a few ticks without spends
        # (not while it waits for the store's retry: it spends nothing then
        # because the fleet's budget is spent, not because it wants less).
        for user in list(demand):
            if user not in users and user not in retry_at:
                demand[user] *= 0.5
                if demand[user] * 2 * tick < 0.5:
                    del demand[user]
        if meter and now_ns >= self._sweep_ns:
            # (once a slice: meters that saw nothing for three windows go)
            self._sweep_ns = now_ns + self._slice_ns
            for user in [u for u, m in meter.items() if now_ns - m[0] >= 3 * self._slice_ns]:
                del meter[user]
                self.next_long.pop(user, None)
                self.cut.discard(user)
        # Users the store granted less than asked whose retry falls due now
        # want more than the fleet gives them: each is asked for when it
        # runs short, as a user short of leases (its share, to last until
        # the next ask), not for its demand over two ticks at once (that
        # came whole, ran out a tick later and was asked again: two asks
        # per retry where the rate, its demand gone by then, made one).
        due = {u for u, t in retry_at.items() if t <= now_ns} if retry_at else frozenset()
        asks = []
        for user in users | set(demand) | set(used):
            if retry_at.get(user, 0) > now_ns and not used.get(user):
                continue  # the store said no for now: ask again later
            if user in due and user not in users and not used.get(user):
                continue  # (asked for when it runs short)
            rate = rate_of(user)
            limit = float(rate)
            if slice_s and not used.get(user):
                steady = self.steady_rate(user, now_ns, limit / max(1, sharing.get(user, 1)))
                if steady is not None:
                    # A long slice, once a slice: released over the slice,
                    # it lasts until the next one.
                    wanted = demand[user] = min(steady, limit)
                    if now_ns >= self.next_long.get(user, 0):
                        ask = self._long_ask(user, rate, wanted, held, now_ns)
                        if ask is not None:
                            asks.append(ask)
                    continue
            spend = recent.get(user, 0) / elapsed
            if user in short or user in due:
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
                asks.append(LeaseAsk(user, rate, want, used.get(user, 0), kind=self.kind))
        return asks
