"""One kind of budget on an engine's lease thread: a lane (shared-budget mode).

A user may have up to three fleet-wide budgets in the store, each a GCRA of
its own leased the same way (``lease_store.KIND_KEYS``): its output rate,
its ceiling (a limit ``{rate, ceiling}``: every output token of the user,
guaranteed or borrowed) and its prompt budget (``prompt_rate``: prompt
tokens computed). On an engine each is one ``shared_limiter.SharedBudgetLimiter``
(its lease book, its fallback), and on the engine's one lease thread
(``lease_thread``) one ``LeaseLane``: that limiter and what the thread keeps
per user of it (the sizer's demand, the engines sharing each user, when to
ask again, the spends to report after a fallback or a reset). Every round
the thread asks for each lane's users in the same call (one per shard of a
cluster), and hands each reply's grants to the lane they were asked for;
the store's epoch, failures and fallback are the shard's, so every lane of
a shard falls back, resets and reports together.

Pure logic: imports nothing from vLLM or Redis.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any, Protocol

from vllm_output_rate.fleet_math import LeaseSizer
from vllm_output_rate.lease_book import LeaseBook
from vllm_output_rate.lease_store import LeaseAsk, report_window_s
from vllm_output_rate.limiter import NS_PER_S
from vllm_output_rate.shared_settings import SharedStateSettings

#: How long the most engines seen sharing a user is remembered for its
#: fallback share (a larger count seen again restarts it).
SHARING_MEMORY_S = 10.0


class LeasingLimiter(Protocol):
    """What the lease thread uses of a lane's limiter
    (``shared_limiter.SharedBudgetLimiter``)."""

    #: scheduler -> thread: (now_ns, {user: tokens}, fallback?) per step
    #: that charged, and the users short of leases
    usage: deque[tuple[int, Mapping[str, int], bool]]
    starved: deque[str]
    #: thread -> scheduler: (user, tokens, deadline_ns), and a count bumped
    #: to have every lease dropped
    grants: deque[tuple[str, int, int]]
    #: thread -> scheduler: long slices, (user, tokens, deadline_ns,
    #: sent_ns, span_ns), released over the span; user -> tokens not
    #: released yet
    long_grants: deque[tuple[str, int, int, int, int]]
    #: scheduler -> thread: users that waited for their slice's release
    paced: deque[str]
    unreleased: dict[str, int]
    clear_requests: int
    book: LeaseBook

    def rate_of(self, user: str) -> Fraction: ...

    def begin_fallback(self, sharing: Mapping[str, int], live: int,
                       scope: frozenset[Any] | None = None,
                       shard_of: Callable[[str], Any] | None = None,
                       terms: Any = None) -> None: ...

    def end_fallback(self) -> None: ...

    def clear_leases(self, scope: frozenset[Any] | None,
                     shard_of: Callable[[str], Any] | None) -> None: ...


class LeaseLane:
    """One kind of budget (``kind``, ``lease_store.KIND_KEYS``) on the
    lease thread: its limiter, and the thread's books of its users."""

    def __init__(self, kind: str, limiter: LeasingLimiter, settings: SharedStateSettings) -> None:
        self.kind = kind
        self.limiter = limiter
        self.settings = settings
        self.sizer = LeaseSizer(settings, kind)
        #: user -> engines sharing this budget of it, as the store last said
        self.sharing: dict[str, int] = {}
        #: user -> (the most engines seen sharing it, when last seen that
        #: many) over ``SHARING_MEMORY_S``: the fallback share's divisor
        self.sharing_peak: dict[str, tuple[int, int]] = {}
        #: user -> when to ask the store again (ns), for users the store
        #: granted less than asked: the fleet's budget is spent for now.
        #: Replaced whole after each call (the scheduler's thread reads it).
        self.retry_at: dict[str, int] = {}
        # The spends of the report window per round, (ns, {user: tokens}),
        # for the report after a fallback or a reset.
        self.spends: deque[tuple[int, dict[str, int]]] = deque()
        #: user -> deadline of its last long slice (ns): a short lease
        #: granted after it never expires before it (leases stay in order)
        self.long_until: dict[str, int] = {}
        #: user -> (send time of its last answered ask, the fallback divisor
        #: sent with it): what the store holds in reserve of this budget
        #: of the user for this engine while it is cut off (``partition``)
        self.asked: dict[str, tuple[int, int]] = {}

    def drain(self, now_ns: int) -> tuple[dict[str, int], set[str], int]:
        """What the scheduler's thread posted since the last round: tokens
        spent per user, the users it ran short of leases for, and the
        tokens spent in fallback (without a lease)."""
        limiter = self.limiter
        usage = limiter.usage
        recent: dict[str, int] = {}
        unleased = 0
        while usage:
            _, taken, in_fallback = usage.popleft()
            for user, n in taken.items():
                if n > 0:
                    recent[user] = recent.get(user, 0) + n
                    if in_fallback:
                        unleased += n
        short: set[str] = set()
        while limiter.starved:
            short.add(limiter.starved.popleft())
        spends = self.spends
        if recent:
            spends.append((now_ns, recent))
        window_ns = int(report_window_s(self.settings) * NS_PER_S)
        while spends and spends[0][0] < now_ns - window_ns:
            spends.popleft()
        return recent, short, unleased

    def asks(self, now_ns: int, recent: Mapping[str, int], short: set[str],
             used: Mapping[str, int]) -> list[LeaseAsk]:
        """This round's asks of the lane (``fleet_math.LeaseSizer``)."""
        limiter = self.limiter
        paced: set[str] = set()
        while limiter.paced:
            paced.add(limiter.paced.popleft())
        return self.sizer.asks(now_ns, recent, short, used, self._held(), self.sharing, self.retry_at,
                               limiter.rate_of, paced)

    def early_asks(self, now_ns: int, until: Callable[[str], int], asked: set[str]) -> list[LeaseAsk]:
        """(Long slices) The long slices due before ``until(user)`` (the end
        of its store's round, when called on it now): ``LeaseSizer.early_asks``."""
        return self.sizer.early_asks(now_ns, until, asked, self._held(), self.sharing, self.retry_at,
                                     self.limiter.rate_of)

    def _held(self) -> Any:
        limiter = self.limiter
        held: Any = limiter.book.balance
        if self.settings.slice_s and limiter.unreleased:
            held = _Held(held, limiter.unreleased)
        return held

    def answer(self, ask: LeaseAsk, tokens: int, sharing: int, now_ns: int, sent_ns: int,
               retry_at: dict[str, int]) -> None:
        """The store's answer to one of the lane's asks: ``tokens`` granted,
        ``sharing`` engines share the budget; the grant posted to the
        scheduler's thread (a long slice to be released over the slice)."""
        s = self.settings
        limiter, user = self.limiter, ask.user
        self.sharing[user] = sharing
        peak = self.sharing_peak
        seen = peak.get(user)
        if seen is None or sharing >= seen[0] or now_ns - seen[1] > SHARING_MEMORY_S * NS_PER_S:
            peak[user] = (sharing, now_ns)
        long_until = self.long_until
        if tokens > 0:
            deadline = sent_ns + int(s.horizon_s * NS_PER_S)
            if ask.long:
                deadline += int(s.slice_s * NS_PER_S)
                long_until[user] = deadline
                # released over the slice by the scheduler's thread
                limiter.long_grants.append((user, tokens, deadline, sent_ns,
                                            int(s.slice_s * NS_PER_S)))
            else:
                last = long_until.get(user) if long_until else None
                if last is not None:
                    if last > deadline:
                        deadline = last
                    else:
                        del long_until[user]
                limiter.grants.append((user, tokens, deadline))
        if ask.long:
            self.sizer.long_granted(user, tokens, ask.want, now_ns)
        if tokens < ask.want:
            retry_at[user] = now_ns + self.sizer.retry_ns
        else:
            retry_at.pop(user, None)

    def usage_to_report(self, reporting: Mapping[Any, int] | None, since: int,
                        shard_of: Callable[[str], Any]) -> dict[str, int]:
        """What the lane's users spent after ``since`` (ns): every user's
        (``reporting`` None), or those of the shards in ``reporting``, each
        after its own mark."""
        used: dict[str, int] = {}
        for t, spent in self.spends:
            if t <= since:
                continue
            for user, n in spent.items():
                if reporting is not None:
                    mark = reporting.get(shard_of(user))
                    if mark is None or t <= mark:
                        continue
                used[user] = used.get(user, 0) + n
        return used

    def clear(self, shard: Any, shard_of: Callable[[str], Any]) -> None:
        """The store (``shard`` None) or a shard lost its data: the lane's
        leases of its users are dropped at the next step."""
        limiter = self.limiter
        if shard is None:
            limiter.grants.clear()
            limiter.clear_requests += 1
        else:
            limiter.clear_leases(frozenset((shard,)), shard_of)

    def divisor(self, user: str, live: int) -> int:
        """The divisor of this budget's fallback share of ``user``, told
        the store with each ask (the most engines seen sharing it lately,
        else ``live``, the live engines)."""
        seen = self.sharing_peak.get(user)
        return max(1, seen[0] if seen is not None else live)

    def fallback_sharing(self) -> dict[str, int]:
        """Per user, the most engines seen sharing it lately (the
        fallback share's divisor)."""
        return {user: n for user, (n, _) in self.sharing_peak.items()}


class _Held:
    """Tokens an engine holds per user for the sizer: its leases and what
    of its long slices is not released yet (``get`` only)."""

    __slots__ = ("balance", "unreleased")

    def __init__(self, balance: Mapping[str, int], unreleased: Mapping[str, int]) -> None:
        self.balance, self.unreleased = balance, unreleased

    def get(self, user: str, default: int = 0) -> int:
        return self.balance.get(user, default) + self.unreleased.get(user, 0)

