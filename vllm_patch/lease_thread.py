"""The lease thread of shared-budget mode: one per engine core, the only one on the network.

Every tick (or at once when the scheduler ran short of leases) it reads
what the scheduler's thread spent (``SharedBudgetLimiter.usage``), asks the
store (``lease_store``) for what ``fleet_math.LeaseSizer`` sizes, and posts
the grants back (``SharedBudgetLimiter.grants``); the scheduler's thread
takes them up at its next step (``shared_limiter``). Its counters are one
``LeaseStats``, read from any thread for the metrics.

**Faults.** Two calls in a row that fail or time out (``socket_timeout``,
250 ms; the thread waits, not the scheduler) put the engine in *fallback*: its
leases are dropped and each user gets ``limit / n`` on this engine alone,
``n`` being the most engines the store said were sharing that user within
the last ``SHARING_MEMORY_S`` (users it never saw: the live engines it last
saw; the most, not the last: an engine whose last reply missed a sharer
that had not leased for a moment, on a loaded machine, would otherwise
take the whole limit beside it), one log line per
episode, time and failed calls counted. The thread keeps trying every tick.
One failed call alone (a blip) changes nothing: the leases held stay
valid until their deadlines. When a call succeeds again, the engine first
charges the store with what it spent within the last ``H + B`` (so the
fleet does not get a fresh burst on top of what it spent; the leased part
of it is charged twice, which over-charges briefly), then leases as
before. A store that
lost its data (restarted empty) is told apart by an epoch key: every engine
that sees a new epoch does the same before leasing again.

**A cluster** (``cluster_store``): each shard is a store of its own to
this thread (``ShardState``: its epoch, failures, fallback and report), so
a shard's outage puts only its users in fallback (the limiter's fallback
has a scope: the shards down), and a shard that lost its data, or whose
master changed, is reported to alone; when no node answers at all, every
user is in fallback, as with one store (the shard ``None``).

**Long slices** (``slice_ms``): a long slice's grant goes to the limiter
to be released over the slice (``long_grants``), its lease living a slice
longer; a short lease granted after it never expires before it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

from vllm_output_rate.fleet_math import LeaseSizer
from vllm_output_rate.lease_book import LeaseBook
from vllm_output_rate.lease_store import LIVE_S, LeaseAsk, LeaseReply, RedisStore, new_engine_id, report_window_s
from vllm_output_rate.limiter import NS_PER_S
from vllm_output_rate.partition import FallbackTerms, PartitionWatch
from vllm_output_rate.shared_settings import SharedStateSettings

#: How long the most engines seen sharing a user is remembered for its
#: fallback share (a larger count seen again restarts it).
SHARING_MEMORY_S = 10.0

logger = logging.getLogger("vllm_output_rate")

#: Failed calls in a row that put an engine in fallback.
FAILURES_TO_FALLBACK = 2


class LeasingLimiter(Protocol):
    """What the lease thread uses of its engine's limiter
    (``shared_limiter.SharedBudgetLimiter``, which starts the thread)."""

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
                       terms: FallbackTerms | None = None) -> None: ...

    def end_fallback(self) -> None: ...

    def clear_leases(self, scope: frozenset[Any] | None,
                     shard_of: Callable[[str], Any] | None) -> None: ...


@dataclass(slots=True)
class ShardState:
    """What the lease thread knows of one shard (one store: the only one,
    ``None``): its epoch, its failures, its fallback."""

    epoch: str = ""
    failures_in_row: int = 0
    in_fallback: bool = False
    #: report what was spent before leasing again (after a fallback or a reset)
    report: bool = False
    #: spends up to here were reported (ns)
    reported_ns: int = 0
    live_engines: int = 1
    #: (``partition``) send time of the last answered call, of the first
    #: failed one after it, and whether the alive channel was seen closed
    #: when this shard fell back
    ok_ns: int = 0
    first_failed_ns: int | None = None
    closed_at_fallback: bool = False


@dataclass(slots=True)
class LeaseStats:
    """The lease thread's counters: written by that thread alone, read
    (plain numbers) from any thread."""

    #: store calls made, and those that failed
    calls: int = 0
    failed_calls: int = 0
    #: failed calls in a row (two make an outage)
    failures_in_row: int = 0
    fallback_episodes: int = 0
    #: times the store was found to have lost its data
    resets: int = 0
    #: tokens spent in fallback, without a lease
    unleased_spent: int = 0
    #: when the current fallback began (time.monotonic), and the seconds
    #: of the fallbacks that ended
    fallback_since: float | None = None
    fallback_total: float = 0.0
    #: fallbacks with the alive channel standing (the store keeps this
    #: engine's share reserved: ``partition``), and whether one is on
    partitions: int = 0
    partitioned: bool = False
    #: latencies (seconds) of the calls that succeeded, not drained yet
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=4096))

    def fallback_seconds(self) -> float:
        since = self.fallback_since
        return self.fallback_total + (0.0 if since is None else time.monotonic() - since)


class LeaseThread(PartitionWatch):
    """The engine core's background thread that leases from the store."""

    def __init__(self, limiter: LeasingLimiter, settings: SharedStateSettings,
                 store: Any | None = None, clock: Callable[[], int] = time.monotonic_ns,
                 engine_id: str | None = None) -> None:
        self.limiter = limiter
        self.settings = settings
        self._store = store
        self.clock = clock
        self.engine_id = engine_id or new_engine_id()
        #: per shard (one store: ``None`` alone); a cluster's shards appear
        #: as they are called (``None`` then stands for "no node answers")
        self.shards: dict[Any, ShardState] = {None: ShardState()}
        self.live_engines = 1
        #: user -> engines sharing it, as the store last said (lease sizes)
        self.sharing: dict[str, int] = {}
        #: user -> (the most engines seen sharing it, when last seen that
        #: many) over ``SHARING_MEMORY_S``: the fallback share's divisor
        self.sharing_peak: dict[str, tuple[int, int]] = {}
        self.in_fallback = False
        #: user -> (send time of its last answered ask, the fallback divisor
        #: sent with it): what the store holds in reserve (``partition``)
        self.asked: dict[str, tuple[int, int]] = {}
        self._asked_sweep_ns = 0
        self._alive_seen: tuple[str, ...] = ()
        self._partitioned_episode = False
        self.stats = LeaseStats()
        self.sizer = LeaseSizer(settings)
        # The spends of the report window per call, (monotonic ns, {user:
        # tokens}), for the report after a fallback or a reset.
        self._spends: deque[tuple[int, dict[str, int]]] = deque()
        #: user -> deadline of its last long slice (ns): a short lease
        #: granted after it never expires before it (leases stay in order)
        self._long_until: dict[str, int] = {}
        #: user -> when to ask the store again (ns), for users the store
        #: granted less than asked: the fleet's budget is spent for now.
        #: Replaced whole after each call (the scheduler's thread reads it).
        self.retry_at: dict[str, int] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        #: shortest time between two calls (a user short of budget wakes
        #: the thread at once, but not more often than this)
        self.min_gap_ns = int(settings.tick_s * NS_PER_S) // 5
        #: how long after its call a grant is taken to be there (the engine
        #: loop looks again then)
        self.round_trip_ns = 2_000_000
        self._thread: threading.Thread | None = None
        self._left = False

    # -- scheduler's side (cheap, lock-free reads) ---------------------------

    def wake(self) -> None:
        if not self._wake.is_set():
            self._wake.set()

    def drain_latencies(self) -> list[float]:
        """Call latencies (seconds) since the last drain (one reader)."""
        out, latencies = [], self.stats.latencies
        while latencies:
            out.append(latencies.popleft())
        return out

    # -- the thread --------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="output-rate-leases", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.settings.timeout_s + 1)

    def leave(self) -> bool:
        """Leave the fleet (the engine core is shutting down, its thread
        stopped): one store call that drops this engine's heartbeat and its
        marks on the users it leased, so that the other engines get their
        share of those users at their next call, not ``LIVE_S`` later.
        A store that does not answer changes nothing: the marks lapse then.
        Returns whether the store took it."""
        if self._left or (self._store is None and not self.sharing):
            return False  # left already, or never leased: nothing to leave
        self._left = True
        try:
            self.store.leave(self.engine_id, sorted(self.sharing))
        except Exception as exc:  # down or slow: the liveness window does it
            logger.warning("output-rate shared state: could not leave the store at %s (%s: %s); "
                           "the other engines stop counting this one within %.0f s",
                           self.settings.redacted_url, type(exc).__name__, str(exc)[:200], LIVE_S)
            return False
        logger.info("output-rate shared state: left the store at %s (%d users)",
                    self.settings.redacted_url, len(self.sharing))
        self.sharing = {}
        return True

    @property
    def store(self) -> Any:
        if self._store is None:
            if self.settings.cluster:
                from vllm_output_rate.cluster_store import ClusterStore

                self._store = ClusterStore(self.settings)
            else:
                self._store = RedisStore(self.settings)
        return self._store

    @property
    def epoch(self) -> str:
        """The epoch of the store (one store; a cluster's first shard)."""
        return next(iter(self.shards.values())).epoch

    def shard_of(self, user: str) -> Any:
        """The shard of ``user`` (one store: ``None``); read by the
        scheduler's thread for a fallback of some shards only."""
        store = self._store
        return None if store is None else store.shard_of(user)

    def _run(self) -> None:
        tick = self.settings.tick_s
        gap = self.min_gap_ns / NS_PER_S
        while not self._stop.is_set():
            started = time.monotonic()
            # At the next tick, or when the first retry falls due.
            retry_at = self.retry_at
            wait = tick
            if retry_at:
                wait = min(tick, max(0.0, (min(retry_at.values()) - self.clock()) / NS_PER_S))
            self._wake.wait(wait)
            self._wake.clear()
            if self._stop.is_set():
                break
            rest = gap - (time.monotonic() - started)
            if rest > 0 and self._stop.wait(rest):
                break
            try:
                self.tick()
            except Exception:  # never let the thread die: log, count, go on
                logger.exception("output-rate shared state: lease thread error")
                self._enter_fallback("internal error")

    def tick(self, now_us: float | None = None) -> None:
        """One round: read what the scheduler spent, ask the store (each
        shard of a cluster), post the grants (tests call it directly, with
        the store's time)."""
        limiter = self.limiter
        now_ns = self.clock()
        recent, short = self._drain(now_ns)
        held = limiter.book.balance
        if self.settings.slice_s and limiter.unreleased:
            held = _Held(held, limiter.unreleased)
        paced: set[str] = set()
        while limiter.paced:
            paced.add(limiter.paced.popleft())
        asks = self.sizer.asks(now_ns, recent, short, self._usage_to_report(),
                               held, self.sharing, self.retry_at, limiter.rate_of, paced)
        divisors = {ask.user: self._divisor(ask.user) for ask in asks}
        sent_ns = self.clock()
        t0 = time.perf_counter()
        try:
            store = self.store
            plan = store.plan(asks, now_ns)
            replies = store.lease_shards(self.engine_id, plan,
                                         {k: v.epoch for k, v in self.shards.items()}, now_us=now_us,
                                         divisors=divisors,
                                         **({"now_ns": now_ns} if self.settings.cluster else {}))
        except Exception as exc:  # no store (a cluster: no node) answers
            self._failed(None, exc, sent_ns)
            self._watch_alive()
            return
        latency = time.perf_counter() - t0
        if self.settings.cluster:
            self._out_of_the_dark(replies, now_ns)
        retry_at = {u: t for u, t in self.retry_at.items() if t > now_ns}
        for shard, reply in replies.items():
            if isinstance(reply, Exception):
                self._failed(shard, reply, sent_ns)
            else:
                self.stats.latencies.append(latency)
                self._answered(shard, reply, plan[shard], now_ns, sent_ns, retry_at, divisors)
        self.retry_at = retry_at
        self._watch_alive()
        if now_ns >= self._asked_sweep_ns:
            self._asked_sweep_ns = now_ns + int(LIVE_S * NS_PER_S)
            old = now_ns - int(2 * LIVE_S * NS_PER_S)
            self.asked = {u: a for u, a in self.asked.items() if a[0] >= old}
        self.live_engines = max((st.live_engines for k, st in self.shards.items()
                                 if k is not None or not self.settings.cluster), default=1)
        self.stats.failures_in_row = max(st.failures_in_row for st in self.shards.values())

    def _out_of_the_dark(self, replies: Mapping[Any, Any], now_ns: int) -> None:
        """(A cluster) A node answered: the "no node answers" state ends;
        its report went out in this round's calls (a shard whose call
        failed reports again)."""
        dark = self.shards.setdefault(None, ShardState())
        dark.failures_in_row = 0
        if dark.report:
            dark.report = False
            for shard, reply in replies.items():
                if isinstance(reply, Exception):
                    st = self.shards.setdefault(shard, ShardState())
                    st.reported_ns = min(st.reported_ns, dark.reported_ns) if st.report else dark.reported_ns
                    st.report = True
            dark.reported_ns = now_ns
        if dark.in_fallback:
            self._leave_fallback(None)

    def _failed(self, shard: Any, exc: Exception, sent_ns: int = 0) -> None:
        stats = self.stats
        stats.calls += 1
        stats.failed_calls += 1
        st = self.shards.setdefault(shard, ShardState())
        if st.first_failed_ns is None:
            st.first_failed_ns = sent_ns
        st.failures_in_row += 1
        stats.failures_in_row = max(stats.failures_in_row, st.failures_in_row)
        # One failed call (a blip: a call slower than the timeout on a
        # loaded machine) keeps the leases held; two in a row is an outage.
        if st.failures_in_row >= FAILURES_TO_FALLBACK:
            self._enter_fallback(f"{type(exc).__name__}: {exc}", shard)

    def _answered(self, shard: Any, reply: LeaseReply, asks: list[LeaseAsk], now_ns: int,
                  sent_ns: int, retry_at: dict[str, int],
                  divisors: Mapping[str, int] | None = None) -> None:
        limiter = self.limiter
        stats = self.stats
        st = self.shards.setdefault(shard, ShardState())
        stats.calls += 1
        st.failures_in_row = 0
        st.ok_ns = sent_ns
        st.first_failed_ns = None
        st.live_engines = reply.live_engines
        if reply.reset or (st.epoch and reply.epoch != st.epoch):
            # The store lost its data (or this engine first met it after a
            # fallback): report what was spent, then lease again.
            if st.epoch:
                stats.resets += 1
                logger.warning("output-rate shared state: the store at %s lost its data "
                               "(new epoch%s); reporting recent spends before leasing again",
                               self.settings.redacted_url, _shard_text(shard))
            st.epoch = reply.epoch
            st.report = True
            # The store forgot the slots of the leases held: drop them.
            if shard is None:
                limiter.grants.clear()
                limiter.clear_requests += 1
            else:
                limiter.clear_leases(frozenset((shard,)), self.shard_of)
            self._wake.set()
            return
        st.epoch = reply.epoch
        horizon_ns = int(self.settings.horizon_s * NS_PER_S)
        slice_ns = int(self.settings.slice_s * NS_PER_S)
        retry = now_ns + self.sizer.retry_ns
        peak = self.sharing_peak
        memory_ns = int(SHARING_MEMORY_S * NS_PER_S)
        long_until = self._long_until
        asked = self.asked
        for ask in asks:
            tokens, sharing = reply.granted[ask.user]
            asked[ask.user] = (sent_ns, 1 if divisors is None else divisors.get(ask.user, 1))
            self.sharing[ask.user] = sharing
            seen = peak.get(ask.user)
            if seen is None or sharing >= seen[0] or now_ns - seen[1] > memory_ns:
                peak[ask.user] = (sharing, now_ns)
            if tokens > 0:
                deadline = sent_ns + horizon_ns
                if ask.long:
                    deadline += slice_ns
                    long_until[ask.user] = deadline
                    # released over the slice by the scheduler's thread
                    limiter.long_grants.append((ask.user, tokens, deadline, sent_ns, slice_ns))
                elif long_until:
                    last = long_until.get(ask.user)
                    if last is not None:
                        if last > deadline:
                            deadline = last
                        else:
                            del long_until[ask.user]
                if not ask.long:
                    limiter.grants.append((ask.user, tokens, deadline))
            if ask.long:
                self.sizer.long_granted(ask.user, tokens, ask.want, now_ns)
            if tokens < ask.want:
                retry_at[ask.user] = retry
            else:
                retry_at.pop(ask.user, None)
        if st.report:
            st.report = False
            st.reported_ns = now_ns
            if shard is None:
                self._spends.clear()
        if st.in_fallback:
            self._leave_fallback(shard)

    def _drain(self, now_ns: int) -> tuple[dict[str, int], set[str]]:
        """What the scheduler's thread posted since the last round: tokens
        spent per user, and the users it ran short of leases for."""
        limiter = self.limiter
        usage = limiter.usage
        recent: dict[str, int] = {}
        while usage:
            _, taken, unleased = usage.popleft()
            for user, n in taken.items():
                if n > 0:
                    recent[user] = recent.get(user, 0) + n
                    if unleased:
                        self.stats.unleased_spent += n
        short: set[str] = set()
        while limiter.starved:
            short.add(limiter.starved.popleft())
        spends = self._spends
        if recent:
            spends.append((now_ns, recent))
        window_ns = int(report_window_s(self.settings) * NS_PER_S)
        while spends and spends[0][0] < now_ns - window_ns:
            spends.popleft()
        return recent, short

    def _usage_to_report(self) -> dict[str, int]:
        """After a fallback or a reset of a shard (one store: the store):
        everything its users spent within the window the store must know
        of (over-charges the leased part the store still knows after a
        plain fallback: allowed, and brief)."""
        used: dict[str, int] = {}
        shards = self.shards
        if not any(st.report for st in shards.values()):
            return used
        whole = shards.get(None)
        if whole is not None and whole.report:
            since, pick = whole.reported_ns, None
        else:
            reporting = {k: st.reported_ns for k, st in shards.items() if st.report}
            since, pick = min(reporting.values()), reporting
        shard_of = self.shard_of
        for t, spent in self._spends:
            if t <= since:
                continue
            for user, n in spent.items():
                if pick is not None:
                    mark = pick.get(shard_of(user))
                    if mark is None or t <= mark:
                        continue
                used[user] = used.get(user, 0) + n
        return used

    def _enter_fallback(self, why: str, shard: Any = None) -> None:
        st = self.shards.setdefault(shard, ShardState())
        if not st.in_fallback:
            if not self.in_fallback:
                self.in_fallback = True
                self.stats.fallback_episodes += 1
                self.stats.fallback_since = time.monotonic()
            st.in_fallback = True
            self._note_alive(shard)
            logger.warning(
                "output-rate shared state: the store at %s is unreachable (%s%s); each user "
                "gets its limit divided by the engines last seen sharing it (%d live "
                "engines last seen) until it answers again",
                self.settings.redacted_url, why[:200], _shard_text(shard), st.live_engines)
            if shard is None:
                self.limiter.grants.clear()
                self.retry_at = {}
            else:
                shard_of = self.shard_of
                self.retry_at = {u: t for u, t in self.retry_at.items() if shard_of(u) != shard}
            self._post_fallback()
        st.report = True

    def _post_fallback(self) -> None:
        """Tell the limiter which users are in fallback now (every user
        when the one store, or no node of a cluster, answers)."""
        down = [k for k, st in self.shards.items() if st.in_fallback]
        if not down:
            self.limiter.end_fallback()
            return
        scope = None if None in down else frozenset(down)
        live = max(self.shards[k].live_engines for k in down)
        terms = self.fallback_terms()
        self._alive_seen = self._alive_states()
        self.stats.partitioned = partitioned = terms.reserved()
        if partitioned and not self._partitioned_episode:
            self.stats.partitions += 1
        self._partitioned_episode = partitioned
        self.limiter.begin_fallback(self.fallback_sharing(), live,
                                    scope, self.shard_of if scope is not None else None, terms)

    def fallback_sharing(self) -> dict[str, int]:
        """Per user, the most engines seen sharing it lately (the
        fallback share's divisor)."""
        return {user: n for user, (n, _) in self.sharing_peak.items()}

    def _leave_fallback(self, shard: Any = None) -> None:
        self.shards[shard].in_fallback = False
        if any(st.in_fallback for st in self.shards.values()):
            self._post_fallback()
            return
        stats = self.stats
        since = stats.fallback_since
        if since is not None:
            stats.fallback_total += time.monotonic() - since
        stats.fallback_since = None
        self.in_fallback = False
        stats.partitioned = self._partitioned_episode = False
        self.limiter.end_fallback()
        logger.warning("output-rate shared state: the store at %s answers again; shared "
                       "budgets resumed", self.settings.redacted_url)


class _Held:
    """Tokens an engine holds per user for the sizer: its leases and what
    of its long slices is not released yet (``get`` only)."""

    __slots__ = ("balance", "unreleased")

    def __init__(self, balance: Mapping[str, int], unreleased: Mapping[str, int]) -> None:
        self.balance, self.unreleased = balance, unreleased

    def get(self, user: str, default: int = 0) -> int:
        return self.balance.get(user, default) + self.unreleased.get(user, 0)


def _shard_text(shard: Any) -> str:
    return "" if shard is None else f"; shard of slot {shard}"
