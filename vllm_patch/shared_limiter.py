"""Shared-budget mode: one user's limit held across engines through Redis.

``--output-rate-shared-state redis://HOST:PORT[/DB]`` (parsed by
``shared_settings``). Each user's budget lives in the store as one GCRA
state (its TAT, in the store's own clock), shared by every engine that
names the same store. No engine's scheduler thread ever waits on the
network:

* a lease thread of each engine core (``lease_thread.LeaseThread``) asks the
  store every tick (``tick_s``, 50 ms) for slices of the budgets its users
  need, all in one call of an atomic server-side script
  (``lease_store.LEASE_SCRIPT``). The store
  grants a slice only from slots that start no later than ``lookahead_s``
  ahead of its clock (a GCRA with that burst). Each engine asks for what
  its users spent lately, or, for a user it ran short of, at least its
  share (limit / engines sharing the user) until its next ask
  (``fleet_math.LeaseSizer``); while
  another engine sharing a user waits (was given less than it asked), the
  store gives each engine at most that share, so no engine takes every slot
  by asking first. A user the store had nothing for is asked for again
  after ``max(tick, lookahead / 2)``;
* the scheduler's thread spends only what it holds (``LeaseBook``): the
  engine's own limiter still paces each user at its full limit on this
  engine, and a token also needs a leased one. A lease is spendable for
  ``horizon_s`` from the moment its request was sent; what is left then
  expires (an engine that dies holds nothing hostage past that).

This module is that limiter, ``SharedBudgetLimiter``, the one the scheduler
holds in this mode, and the limiter it switches to in fallback. A user's
ceiling and prompt budget, where the limits set them, are fleet-wide
budgets of the same form: limiters of this class too (``second_budget``:
the ceilings' of ``borrowing.Lender``, the prompt budgets' of
``prompt_budget.PromptBudgets``), each a lane of the same lease thread
(``lease_lane``), begun with the users' rates at each step. The bound
the fleet keeps is stated in ``fleet_math``; faults and fallback are the
lease thread's (``lease_thread``).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from vllm_output_rate.lease_book import LeaseBook
from vllm_output_rate.lease_store import KIND_KEYS, RATE
from vllm_output_rate.lease_thread import LeaseThread
from vllm_output_rate.limiter import BURST_NS, OutputRateLimiter
from vllm_output_rate.partition import FallbackTerms
from vllm_output_rate.shared_settings import SharedStateSettings


class _FallbackLimiter(OutputRateLimiter):
    """Each user's limit divided by the engines last seen sharing it; for
    every user, or (a cluster with some shards down) for the users of the
    shards in ``scope``. With ``terms`` (``partition.FallbackTerms``: the
    store keeps this engine's share reserved while it is cut off), a user
    spends only within its window, at the divisor the store was told."""

    def __init__(self, base: OutputRateLimiter, sharing: Mapping[str, int], live: int,
                 scope: frozenset[Any] | None = None,
                 shard_of: Callable[[str], Any] | None = None,
                 terms: FallbackTerms | None = None,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        super().__init__(base.default_rate, base.user_rates, base.burst_ns)
        self._base_rate = base.rate_of
        self._sharing = dict(sharing)
        self._live = max(1, live)
        self.scope = scope
        self._shard_of = shard_of
        self.terms = terms
        self._clock = clock

    def rate_of(self, user: str) -> Fraction:
        terms = self.terms
        if terms is not None:
            window = terms.window(user)
            if window is not None:
                return self._base_rate(user) / window[2]
        return self._base_rate(user) / max(1, self._sharing.get(user, self._live))

    def available(self, user: str, now_ns: int) -> int:
        terms = self.terms
        if terms is not None:
            window = terms.window(user)
            if window is not None and not window[0] <= now_ns < window[1]:
                return 0
        return super().available(user, now_ns)

    def ready_at_ns(self, user: str) -> int:
        terms = self.terms
        if terms is not None:
            window = terms.window(user)
            if window is not None:
                now = self._clock()
                if now < window[0]:
                    return max(window[0], super().ready_at_ns(user))
                if now >= window[1]:
                    # nothing until the store answers: look again a tick later
                    return now + STOPPED_RECHECK_NS
        return super().ready_at_ns(user)

    def covers(self, user: str) -> bool:
        """Whether ``user`` is in fallback."""
        return self.scope is None or self._shard_of(user) in self.scope

    def inherit(self, old: _FallbackLimiter) -> None:
        """Keep the states of users still covered at the same share (the
        scope changed: a shard went down or came back)."""
        for user, st in old._users.items():
            if self.covers(user) and self.rate_of(user) == old.rate_of(user):
                self._users[user] = st


#: How soon a user stopped in fallback (``partition``) is looked at again.
STOPPED_RECHECK_NS = 50_000_000

_plain_available = OutputRateLimiter.available
_plain_ready_at = OutputRateLimiter.ready_at_ns


class SharedBudgetLimiter(OutputRateLimiter):
    """The engine's limiter in shared-budget mode.

    A token needs the engine's own GCRA at the user's full limit (even
    spacing on this engine) and a leased token (the fleet's share). In
    fallback, the engine's GCRA at the user's fallback share alone. The
    scheduler calls ``begin_step`` once per step; every other method is the
    plain limiter's interface.
    """

    def __init__(self, default_rate: Fraction, user_rates: Mapping[str, Fraction] | None,
                 settings: SharedStateSettings, burst_ns: int = BURST_NS,
                 store: Any | None = None, clock: Callable[[], int] = time.monotonic_ns,
                 engine_id: str | None = None, start_thread: bool = True,
                 kind: str = RATE, owner: SharedBudgetLimiter | None = None) -> None:
        super().__init__(default_rate, user_rates, burst_ns)
        self.settings = settings
        #: which of the users' budgets (``lease_store.KIND_KEYS``); the
        #: users' rates own the lease thread, another kind is a lane of
        #: its ``owner``'s (``second_budget``)
        self.kind = kind
        self.owner = owner
        #: kind -> the limiter of another of the users' budgets, leased by
        #: this one's thread and begun with it (the rates' only)
        self.others: dict[str, SharedBudgetLimiter] = {}
        #: kind -> [granted, spent, expired] of that kind's limiters closed
        #: (reloaded limits without it, or a new one): their counters go on
        self.retired: dict[str, list[int]] = {}
        self.book = LeaseBook()
        self._balance = self.book.balance  # (the same dict, for the hot path)
        #: scheduler -> lease thread: (now_ns, {user: tokens}, fallback?)
        #: per step that charged, and users short of leases (one append each)
        self.usage: deque[tuple[int, Mapping[str, int], bool]] = deque()
        self.starved: deque[str] = deque()
        #: lease thread -> scheduler: (user, tokens, deadline_ns)
        self.grants: deque[tuple[str, int, int]] = deque()
        #: lease thread -> scheduler: long slices (user, tokens, deadline_ns,
        #: sent_ns, span_ns), released over the span (at most ``slice_s``)
        #: in parts (``_release``)
        self.long_grants: deque[tuple[str, int, int, int, int]] = deque()
        #: user -> tokens of its long slice not released yet, and the parts
        #: to come: [deadline_ns, deque of (release_ns, tokens)]
        self.unreleased: dict[str, int] = {}
        #: scheduler -> lease thread: users that waited for their slice's release
        self.paced: deque[str] = deque()
        self._parts: dict[str, tuple[int, deque[tuple[int, int]]]] = {}
        self._due: list[tuple[int, str]] = []
        self._part_ns = max(1, int(settings.tick_s * 1e9))
        #: set by the lease thread; taken up at the next step boundary
        self.fallback_next: _FallbackLimiter | None = None
        self._fallback: _FallbackLimiter | None = None
        #: bumped by the lease thread to have every lease dropped (a store
        #: that lost its data); seen at the next step boundary
        self.clear_requests = 0
        self._clears_seen = 0
        #: (a cluster) shards whose leases to drop: (scope, shard_of), one
        #: per shard that lost its data
        self.shard_clears: deque[tuple[frozenset[Any], Callable[[str], Any]]] = deque()
        self._starved_step: set[str] = set()
        if owner is not None:
            self.thread = owner.thread
            self.lane = self.thread.attach(kind, self)
            return
        self.thread = LeaseThread(self, settings, store=store, clock=clock,
                                  engine_id=engine_id)
        self.lane = self.thread.lanes[RATE]
        if start_thread:
            self.thread.start()

    def second_budget(self, kind: str, default_rate: Fraction,
                      user_rates: Mapping[str, Fraction] | None) -> SharedBudgetLimiter:
        """(The users' rates) The fleet-wide limiter of another of the
        users' budgets (``kind``: ``CEILING``, ``PROMPT``), leased by this
        limiter's lease thread in the same calls and begun with it at each
        step; one of each kind (a new one replaces the last)."""
        old = self.others.get(kind)
        if old is not None:
            old.close()
        other = SharedBudgetLimiter(default_rate, user_rates, self.settings, self.burst_ns,
                                    kind=kind, owner=self)
        self.others[kind] = other
        return other

    @property
    def in_fallback(self) -> bool:
        return self._fallback is not None

    def begin_fallback(self, sharing: Mapping[str, int], live: int,
                       scope: frozenset[Any] | None = None,
                       shard_of: Callable[[str], Any] | None = None,
                       terms: FallbackTerms | None = None) -> None:
        """(Lease thread) From the next step on: each user's limit divided
        by the engines last seen sharing it (``live`` for users never seen);
        every user's, or those of the shards in ``scope`` (``shard_of``);
        within ``terms`` (a cut-off engine: ``partition``)."""
        self.fallback_next = _FallbackLimiter(self, sharing, live, scope, shard_of, terms,
                                              self.thread.clock)

    def clear_leases(self, scope: frozenset[Any] | None,
                     shard_of: Callable[[str], Any] | None) -> None:
        """(Lease thread) At the next step: drop the leases of the users of
        the shards in ``scope`` (every lease: ``None``)."""
        if scope is None or shard_of is None:
            self.clear_requests += 1
        else:
            self.shard_clears.append((scope, shard_of))

    def end_fallback(self) -> None:
        """(Lease thread) From the next step on: shared budgets again."""
        self.fallback_next = None

    def begin_step(self, now_ns: int) -> None:
        """Take up grants and a mode change, drop expired leases (and the
        same for the users' other budgets: ``others``)."""
        if self.others:
            for other in self.others.values():
                other.begin_step(now_ns)
        grants = self.grants
        book = self.book
        parts = self._parts
        while grants:
            user, tokens, deadline = grants.popleft()
            if parts and user in parts:
                self._release(user, None)  # (its leases stay in deadline order)
            book.add_grant(user, tokens, deadline)
        if self.long_grants:
            self._take_long_grants()
        if self._due:
            self._release_due(now_ns)
        fallback = self.fallback_next
        if fallback is not self._fallback:
            old, self._fallback = self._fallback, fallback
            if fallback is not None:
                if fallback.scope is None:
                    self._drop_leases(None)
                else:
                    if old is not None:
                        fallback.inherit(old)
                    covered = fallback.covers
                    self._drop_leases(covered if old is None else
                                      (lambda u: covered(u) and not old.covers(u)))
        if self.clear_requests != self._clears_seen:
            self._clears_seen = self.clear_requests
            self._drop_leases(None)
        clears = self.shard_clears
        while clears:
            scope, shard_of = clears.popleft()
            self._drop_leases(lambda u: shard_of(u) in scope)
        book.expire(now_ns)
        self._starved_step.clear()

    # -- long slices: released over the slice, in parts --------------------------

    def _take_long_grants(self) -> None:
        """A long slice: a part at once, the rest every tick or so over its
        span (``slice_s``, or the part of it a cut slice covers) from its
        ask (the user's spending on this engine stays even); every part
        lives until the slice's deadline."""
        parts, unreleased = self._parts, self.unreleased
        while self.long_grants:
            user, tokens, deadline, sent_ns, span = self.long_grants.popleft()
            if user in parts:
                self._release(user, None)
            k = max(1, min(tokens, span // self._part_ns))
            each, extra = divmod(tokens, k)
            queue = deque((sent_ns + i * span // k, each + (1 if i < extra else 0))
                          for i in range(k))
            _, first = queue.popleft()
            self.book.add_grant(user, first, deadline)
            if queue:
                parts[user] = (deadline, queue)
                unreleased[user] = tokens - first
                heapq.heappush(self._due, (queue[0][0], user))

    def _release_due(self, now_ns: int) -> None:
        due = self._due
        while due and due[0][0] <= now_ns:
            _, user = heapq.heappop(due)
            part = self._parts.get(user)
            if part is not None and part[1][0][0] <= now_ns:  # (else a stale entry)
                self._release(user, now_ns)

    def _release(self, user: str, now_ns: int | None) -> None:
        """Release the parts of ``user``'s slice due by ``now_ns`` (None:
        all of them)."""
        deadline, queue = self._parts[user]
        n = 0
        while queue and (now_ns is None or queue[0][0] <= now_ns):
            n += queue.popleft()[1]
        if n:
            self.book.add_grant(user, n, deadline)
        if queue:
            self.unreleased[user] -= n
            heapq.heappush(self._due, (queue[0][0], user))
        else:
            del self._parts[user]
            del self.unreleased[user]

    def _drop_leases(self, drop: Callable[[str], bool] | None) -> None:
        """Drop the leases (and slices not released yet) of the users
        ``drop`` says, or of all (None)."""
        if drop is None:
            self.book.clear()
            self._parts.clear()
            self.unreleased.clear()
            self._due.clear()
            return
        self.book.clear_users(drop)
        for user in [u for u in self._parts if drop(u)]:
            del self._parts[user]
            del self.unreleased[user]

    def available(self, user: str, now_ns: int) -> int:
        fallback = self._fallback
        if fallback is not None and (fallback.scope is None or fallback.covers(user)):
            return fallback.available(user, now_ns)
        held = self._balance.get(user, 0)
        if held <= 0:
            if self.owner is not None:
                # (a ceiling or a prompt budget: no refusal asks for its
                # ready time, this look says it ran short)
                self.ready_at_ns(user)
            return 0
        local = _plain_available(self, user, now_ns)
        return local if local < held else held

    def try_take(self, user: str, now_ns: int) -> bool:
        if self.available(user, now_ns) <= 0:
            return False
        self.settle(now_ns, {user: 1})
        return True

    def take(self, user: str, now_ns: int, n: int) -> None:
        self.settle(now_ns, {user: n})

    def settle(self, now_ns: int, taken: Mapping[str, int]) -> None:
        fallback = self._fallback
        if fallback is not None and fallback.scope is not None:
            # some shards down: their users' tokens in fallback, the rest leased
            down = {u: n for u, n in taken.items() if fallback.covers(u)}
            if down:
                fallback.settle(now_ns, down)
                self.usage.append((now_ns, down, True))
                taken = {u: n for u, n in taken.items() if u not in down}
            fallback = None
        if fallback is not None:
            fallback.settle(now_ns, taken)
        else:
            super().settle(now_ns, taken)
            spend = self.book.spend
            for user, n in taken.items():
                if n > 0:
                    spend(user, n)
        if taken:
            self.usage.append((now_ns, taken, fallback is not None))

    def refund(self, user: str, n: int = 1) -> None:
        # Only the plain limiter's try_take callers refund; the scheduler
        # settles net charges. A refunded token is not handed back to the
        # store (over-charging is allowed).
        fallback = self._fallback
        if fallback is not None and fallback.covers(user):
            fallback.refund(user, n)
        else:
            super().refund(user, n)

    def ready_at_ns(self, user: str) -> int:
        fallback = self._fallback
        if fallback is not None and (fallback.scope is None or fallback.covers(user)):
            return fallback.ready_at_ns(user)
        local = _plain_ready_at(self, user)
        if self._balance.get(user, 0) > 0:
            return local
        thread = self.thread
        now = thread.clock()
        if local > now + thread.min_gap_ns:
            # The engine's own pacing binds (a user throttled at its limit
            # on this engine): no lease is needed before then.
            return local
        part = self._parts.get(user) if self._parts else None
        if part is not None:
            # The next part of its long slice is released then (no ask; the
            # thread hears it waited, once a step).
            if user not in self._starved_step:
                self._starved_step.add(user)
                self.paced.append(user)
            return max(part[1][0][0], local)
        retry = self.lane.retry_at.get(user)
        if retry is not None:
            # The store said the fleet's budget of this user is spent for
            # now: the thread asks again then (and wakes for it), the grant
            # is here a round trip later; never in the past (the engine loop
            # would spin until the thread's next round).
            return max(retry, now) + thread.round_trip_ns
        # Short of leases: the lease thread is asked at once, and the
        # engine loop looks again soon (a round trip to the store).
        if user not in self._starved_step:
            self._starved_step.add(user)
            self.starved.append(user)
            thread.wake()
        return now + thread.min_gap_ns

    def set_limits(self, default_rate: Fraction, user_rates: Mapping[str, Fraction] | None,
                   now_ns: int) -> list[str]:
        changed = super().set_limits(default_rate, user_rates, now_ns)
        fallback = self._fallback
        if fallback is not None:
            fallback.set_limits(default_rate, user_rates, now_ns)
        return changed

    def cleanup_idle_users(self, now_ns: int) -> list[str]:
        if self._fallback is not None:
            self._fallback.cleanup_idle_users(now_ns)
        return super().cleanup_idle_users(now_ns)

    def close(self) -> None:
        """The engine core is shutting down: stop the lease thread, then
        leave the fleet (``LeaseThread.leave``). Another kind of budget
        (reloaded limits without it): its lane leaves the thread."""
        owner = self.owner
        if owner is not None:
            if owner.others.get(self.kind) is self:
                book = self.book
                old = owner.retired.get(self.kind, (0, 0, 0))
                owner.retired[self.kind] = [old[0] + book.granted, old[1] + book.spent,
                                            old[2] + book.expired]
                del owner.others[self.kind]
                self.thread.detach(self.kind)
            return
        self.thread.stop()
        self.thread.leave()

    def stats(self) -> dict[str, float]:
        """Counters and gauges of the lease machinery (plain numbers, read
        from any thread)."""
        t, book = self.thread, self.book
        c = t.stats
        return {
            "leased": book.granted, "spent": book.spent, "expired": book.expired,
            "unleased": c.unleased[RATE], "calls": c.calls, "failed_calls": c.failed_calls,
            "fallback": 1.0 if t.in_fallback else 0.0, "fallback_seconds": c.fallback_seconds(),
            "fallback_episodes": c.fallback_episodes, "resets": c.resets,
            "live_engines": t.live_engines,
            "partitioned": 1.0 if c.partitioned else 0.0, "partitions": c.partitions,
            "kinds": self._kind_stats(),
        }

    def _kind_stats(self) -> dict[str, dict[str, int]]:
        """Per kind of budget the engine leases or leased (the rates
        always): tokens leased, spent, expired and spent unleased, and
        budget entries sent in calls answered and failed."""
        c = self.thread.stats
        out = {}
        for kind in KIND_KEYS:
            limiter = self if kind == RATE else self.others.get(kind)
            old = self.retired.get(kind)
            if limiter is None and old is None:
                continue
            totals = [0, 0, 0] if old is None else list(old)
            if limiter is not None:
                book = limiter.book
                totals = [totals[0] + book.granted, totals[1] + book.spent,
                          totals[2] + book.expired]
            entries = c.entries[kind]
            out[kind] = {"leased": totals[0], "spent": totals[1], "expired": totals[2],
                         "unleased": c.unleased[kind], "entries_ok": entries[0],
                         "entries_failed": entries[1]}
        return out
