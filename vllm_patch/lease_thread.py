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
longer; a short lease granted after it never expires before it. Each store
(a cluster's shard) is called on its rounds (``lease_store.round_s``) and a
round's call carries the long slices of its users due before the next
round (``_piggyback``): a shard's slices in one call a round.

**Lanes** (``lease_lane``): the users' rates are one kind of budget; their
ceilings and prompt budgets, where the limits set them, are two more, each
a lane of this thread with a limiter of its own (``attach``). A round asks
for every lane's users in the same call (per shard), so a user's budgets
cost no second round trip; a fault, a fallback or a reset is the shard's,
for every lane.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_output_rate.lease_lane import LeaseLane, LeasingLimiter
from vllm_output_rate.lease_store import (
    KIND_KEYS, LIVE_S, RATE, LeaseAsk, LeaseReply, RedisStore, new_engine_id)
from vllm_output_rate.limiter import NS_PER_S
from vllm_output_rate.partition import PartitionWatch
from vllm_output_rate.shared_settings import SharedStateSettings

logger = logging.getLogger("vllm_output_rate")

#: Failed calls in a row that put an engine in fallback.
FAILURES_TO_FALLBACK = 2


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
    #: per kind of budget (``KIND_KEYS``, every key there from the start:
    #: read from any thread): tokens spent in fallback without a lease, and
    #: budget entries sent [in calls answered, in calls that failed]
    unleased: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KIND_KEYS, 0))
    entries: dict[str, list[int]] = field(
        default_factory=lambda: {kind: [0, 0] for kind in KIND_KEYS})
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
        self.in_fallback = False
        self._asked_sweep_ns = 0
        self._alive_seen: tuple[str, ...] = ()
        self._partitioned_episode = False
        self.stats = LeaseStats()
        #: kind -> its lane (``lease_lane``): the users' rates (``limiter``'s)
        #: and, joined from the scheduler's thread (``attach``), their
        #: ceilings and prompt budgets. Replaced whole by this thread only.
        self.lanes: dict[str, LeaseLane] = {RATE: LeaseLane(RATE, limiter, settings)}
        #: scheduler -> thread: lanes to join (a lane) or leave (kind, None),
        #: taken up at the next round
        self._lane_changes: deque[tuple[str, LeaseLane | None]] = deque()
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

    # -- the users' rates: the first lane's books ------------------------------

    @property
    def sharing(self) -> dict[str, int]:
        """User -> engines sharing its rate, as the store last said."""
        return self.lanes[RATE].sharing

    @property
    def retry_at(self) -> dict[str, int]:
        """User -> when its rate is asked for again (``LeaseLane.retry_at``)."""
        return self.lanes[RATE].retry_at

    @property
    def sizer(self) -> Any:
        return self.lanes[RATE].sizer

    @property
    def sharing_peak(self) -> dict[str, tuple[int, int]]:
        """User -> the most engines seen sharing its rate lately, and when."""
        return self.lanes[RATE].sharing_peak

    def fallback_sharing(self) -> dict[str, int]:
        """Per user, the most engines seen sharing its rate lately."""
        return self.lanes[RATE].fallback_sharing()

    @property
    def asked(self) -> dict[str, tuple[int, int]]:
        """User -> its rate's last answered ask and divisor (``LeaseLane.asked``)."""
        return self.lanes[RATE].asked

    # -- lanes of a user's other budgets (``lease_lane``) ----------------------------

    def attach(self, kind: str, limiter: LeasingLimiter) -> LeaseLane:
        """(Scheduler's thread) A limiter of another kind of budget
        (``lease_store.KIND_KEYS``) leased by this thread from its next
        round on, in the same calls; returns its lane."""
        lane = LeaseLane(kind, limiter, self.settings)
        self._lane_changes.append((kind, lane))
        self.wake()
        return lane

    def detach(self, kind: str) -> None:
        """(Scheduler's thread) The lane of ``kind`` leases no more (its
        leases lapse; the store stops counting this engine as sharing those
        budgets ``LIVE_S`` later)."""
        self._lane_changes.append((kind, None))

    def _take_lane_changes(self) -> None:
        changes = self._lane_changes
        while changes:
            kind, lane = changes.popleft()
            lanes = dict(self.lanes)
            if lane is None:
                lanes.pop(kind, None)
            else:
                lanes[kind] = lane
            self.lanes = lanes
            if lane is not None and self.in_fallback:
                self._post_fallback([lane])  # (the others' fallbacks stay as they are)

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
        lanes = list(self.lanes.values())
        users = sorted({u for lane in lanes for u in lane.sharing})
        if self._left or (self._store is None and not users):
            return False  # left already, or never leased: nothing to leave
        self._left = True
        try:
            self.store.leave(self.engine_id, users, tuple(lane.kind for lane in lanes))
        except Exception as exc:  # down or slow: the liveness window does it
            logger.warning("output-rate shared state: could not leave the store at %s (%s: %s); "
                           "the other engines stop counting this one within %.0f s",
                           self.settings.redacted_url, type(exc).__name__, str(exc)[:200], LIVE_S)
            return False
        logger.info("output-rate shared state: left the store at %s (%d users)",
                    self.settings.redacted_url, len(users))
        for lane in lanes:
            lane.sharing = {}
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
            wait = tick
            retries = [t for lane in self.lanes.values() for t in lane.retry_at.values()]
            if retries:
                wait = min(tick, max(0.0, (min(retries) - self.clock()) / NS_PER_S))
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
        now_ns = self.clock()
        if self._lane_changes:
            self._take_lane_changes()
        lanes = self.lanes
        asks: list[LeaseAsk] = []
        report = self._report_marks()
        stats = self.stats
        for lane in lanes.values():
            recent, short, unleased = lane.drain(now_ns)
            if unleased:
                stats.unleased[lane.kind] += unleased
            used = {} if report is None else lane.usage_to_report(*report, self.shard_of)
            asks.extend(lane.asks(now_ns, recent, short, used))
        sent_ns = self.clock()
        t0 = time.perf_counter()
        try:
            store = self.store
            plan = store.plan(asks, now_ns)
            if plan and self.settings.slice_s:
                self._piggyback(plan, now_ns)
            # (each budget's own divisor: its lane's fallback share, ``partition``)
            live = self.live_engines
            divisors = {ask.budget: lanes[ask.kind].divisor(ask.user, live)
                        for shard_asks in plan.values() for ask in shard_asks}
            replies = store.lease_shards(self.engine_id, plan,
                                         {k: v.epoch for k, v in self.shards.items()}, now_us=now_us,
                                         divisors=divisors,
                                         **({"now_ns": now_ns} if self.settings.cluster else {}))
        except Exception as exc:  # no store (a cluster: no node) answers
            _count_entries(stats.entries, asks, 1)
            self._failed(None, exc, sent_ns)
            self._watch_alive()
            return
        latency = time.perf_counter() - t0
        if self.settings.cluster:
            self._out_of_the_dark(replies, now_ns)
        retries = {kind: {u: t for u, t in lane.retry_at.items() if t > now_ns}
                   for kind, lane in lanes.items()}
        for shard, reply in replies.items():
            failed = isinstance(reply, Exception)
            _count_entries(stats.entries, plan.get(shard, ()), 1 if failed else 0)
            if failed:
                self._failed(shard, reply, sent_ns)
            else:
                self.stats.latencies.append(latency)
                self._answered(shard, reply, plan[shard], now_ns, sent_ns, retries, divisors)
        for kind, lane in lanes.items():
            lane.retry_at = retries[kind]
        self._watch_alive()
        if now_ns >= self._asked_sweep_ns:
            self._asked_sweep_ns = now_ns + int(LIVE_S * NS_PER_S)
            old = now_ns - int(2 * LIVE_S * NS_PER_S)
            for lane in lanes.values():
                lane.asked = {u: a for u, a in lane.asked.items() if a[0] >= old}
        self.live_engines = max((st.live_engines for k, st in self.shards.items()
                                 if k is not None or not self.settings.cluster), default=1)
        self.stats.failures_in_row = max(st.failures_in_row for st in self.shards.values())

    def _piggyback(self, plan: dict[Any, list[LeaseAsk]], now_ns: int) -> None:
        """(Long slices) Each store (a cluster's shard) called on its round
        this round (``rounds``: shard -> the round's end) takes in the same
        call the long slices of its users due before the round ends
        (``LeaseSizer.early_asks``): a store's slices are asked together on
        its rounds, not each in a call of its own."""
        rounds = getattr(self.store, "rounds", None)
        ends = None if rounds is None else rounds.ends
        if not ends:
            return
        shard_of = self.shard_of
        for lane in self.lanes.values():
            asked = {a.user for shard_asks in plan.values() for a in shard_asks if a.kind == lane.kind}
            for ask in lane.early_asks(now_ns, lambda u: ends.get(shard_of(u), 0), asked):
                plan[shard_of(ask.user)].append(ask)

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
                  sent_ns: int, retries: dict[str, dict[str, int]],
                  divisors: Mapping[Any, int] | None = None) -> None:
        stats = self.stats
        st = self.shards.setdefault(shard, ShardState())
        stats.calls += 1
        st.failures_in_row = 0
        st.ok_ns = sent_ns
        st.first_failed_ns = None
        st.live_engines = reply.live_engines
        lanes = self.lanes
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
            for lane in lanes.values():
                lane.clear(shard, self.shard_of)
            self._wake.set()
            return
        st.epoch = reply.epoch
        granted = reply.granted
        for ask in asks:
            budget = ask.budget
            tokens, sharing = granted[budget]
            lane = lanes[ask.kind]
            lane.asked[ask.user] = (sent_ns, 1 if divisors is None else divisors.get(budget, 1))
            lane.answer(ask, tokens, sharing, now_ns, sent_ns, retries[ask.kind])
        if st.report:
            st.report = False
            st.reported_ns = now_ns
            if shard is None:
                for lane in lanes.values():
                    lane.spends.clear()
        if st.in_fallback:
            self._leave_fallback(shard)

    def _report_marks(self) -> tuple[dict[Any, int] | None, int] | None:
        """After a fallback or a reset of a shard (one store: the store):
        the spends each lane reports (``LeaseLane.usage_to_report``):
        everything its users spent within the window the store must know
        of (over-charges the leased part the store still knows after a
        plain fallback: allowed, and brief), every user's since a mark
        (None), or per reporting shard since its mark; None: no report."""
        shards = self.shards
        if not any(st.report for st in shards.values()):
            return None
        whole = shards.get(None)
        if whole is not None and whole.report:
            return None, whole.reported_ns
        reporting = {k: st.reported_ns for k, st in shards.items() if st.report}
        return reporting, min(reporting.values())

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
            shard_of = self.shard_of
            for lane in self.lanes.values():
                if shard is None:
                    lane.limiter.grants.clear()
                    lane.retry_at = {}
                else:
                    lane.retry_at = {u: t for u, t in lane.retry_at.items() if shard_of(u) != shard}
            self._post_fallback()
        st.report = True

    def _post_fallback(self, lanes: list[LeaseLane] | None = None) -> None:
        """Tell the limiters (of ``lanes``, every lane's by default) which
        users are in fallback now (every user when the one store, or no
        node of a cluster, answers)."""
        down = [k for k, st in self.shards.items() if st.in_fallback]
        lanes = list(self.lanes.values()) if lanes is None else lanes
        if not down:
            for lane in lanes:
                lane.limiter.end_fallback()
            return
        scope = None if None in down else frozenset(down)
        live = max(self.shards[k].live_engines for k in down)
        self._alive_seen = self._alive_states()
        self.stats.partitioned = partitioned = self.fallback_terms({}).reserved()
        if partitioned and not self._partitioned_episode:
            self.stats.partitions += 1
        self._partitioned_episode = partitioned
        for lane in lanes:
            # (every kind's fallback on the cut-off terms, at the divisors
            # its asks told the store: ``partition``)
            lane.limiter.begin_fallback(lane.fallback_sharing(), live, scope,
                                        self.shard_of if scope is not None else None,
                                        terms=self.fallback_terms(lane.asked))

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
        for lane in self.lanes.values():
            lane.limiter.end_fallback()
        logger.warning("output-rate shared state: the store at %s answers again; shared "
                       "budgets resumed", self.settings.redacted_url)


def _count_entries(entries: dict[str, list[int]], asks: Any, failed: int) -> None:
    """Count the budget entries of a call per kind (``failed``: 1 for a
    call that failed or timed out, else 0)."""
    for ask in asks:
        entries[ask.kind][failed] += 1


def _shard_text(shard: Any) -> str:
    return "" if shard is None else f"; shard of slot {shard}"
