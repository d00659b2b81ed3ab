"""A cut-off engine told apart from a dead one (shared-budget mode).

An engine that cannot reach the store falls back to a share of each user's
limit (``lease_thread``). The store cannot hear from it, so it must decide
whether to give that share to the other engines:

- **Dead** (killed whole, its host's kernel alive): its sockets were closed
  at once, so its idle subscription on its *alive channel*
  (``<heartbeat key>:alive:<engine id>``; in a Redis Cluster a sharded
  channel, ``SSUBSCRIBE``, on the slot of the shard's heartbeat key) is
  gone. Once its last call is older than its silent window
  (``lease_store.silent_window_s``: 0.25 s at the defaults, 1 s with long
  slices or a cluster) the store drops its
  marks on every user: its share goes to the others at their next call.
- **Cut off** (a partition: the store saw no FIN): its subscription still
  stands. The store keeps its fallback share of each user it had marked
  reserved (the others are granted from the rest of the limit) until the
  partition window ``P`` (``partition_ms``, 30 s) has passed since its last
  call that reached the store.

The engine's side (``FallbackTerms``), so that it never spends what the
store has not reserved for it: after its calls start failing it spends no
fallback share before the store must have seen it silent (the first failed
call's send time + the call timeout + the silent window; the leases it holds
stay valid meanwhile), only for the users it leased recently enough that
the store still holds its mark on them, at the divisor it told the store,
and nothing once ``P`` has passed since its last answered ask of the user
(its own clock). If its subscription was seen closed before it fell back
(the store's process went away: restarted or stopped, and every engine
with it), nothing is reserved and nobody leases: the plain fallback share
of ``lease_thread``, for as long as it lasts (the same when it was never
made: a store, or a proxy before it, that refuses ``SUBSCRIBE``). If it is seen closed later,
the store no longer reserves anything: the engine stops spending.

``alive.AliveChannel`` is the subscription, one per store (per shard),
polled without blocking once a round; the stores (``lease_store``,
``cluster_store``) keep them. ``PartitionWatch`` is the lease thread's part
of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_output_rate.alive import CLOSED, UP
from vllm_output_rate.lease_store import LIVE_S, silent_window_s
from vllm_output_rate.limiter import NS_PER_S

@dataclass(frozen=True, slots=True)
class ShardContact:
    """What the engine knows of its last contact with one store (shard)."""

    #: send time (ns, the engine's clock) of the last answered call
    ok_ns: int
    #: send time of the first call after it that failed (None: none sent)
    first_failed_ns: int | None
    #: the alive channel's state when it fell back, and now
    closed_at_fallback: bool
    closed_now: bool


class FallbackTerms:
    """Per user in fallback: may it spend, when, and at what divisor.

    ``window(user)`` is ``None`` for the plain fallback share (the store's
    process went away: ``_FallbackLimiter``'s own divisor), else
    ``(start_ns, end_ns, divisor)``; a user the store holds no reserve for
    gets ``(0, 0, 1)``: nothing."""

    NOTHING = (0, 0, 1)

    def __init__(self, contacts: Mapping[Any, ShardContact], asked: Mapping[str, tuple[int, int]],
                 shard_of: Callable[[str], Any], timeout_s: float, partition_s: float,
                 live_s: float, silent_s: float) -> None:
        self._contacts = dict(contacts)
        self._asked = asked
        self._shard_of = shard_of
        self._timeout_ns = int(timeout_s * NS_PER_S)
        self._silent_ns = int(silent_s * NS_PER_S)
        self._live_ns = int(live_s * NS_PER_S)
        self._partition_ns = int(partition_s * NS_PER_S)
        self._cache: dict[str, tuple[int, int, int] | None] = {}

    def reserved(self) -> bool:
        """Whether the store keeps a share reserved for this engine (an
        alive channel standing at the fallback of some store or shard)."""
        return any(c.ok_ns > 0 and not c.closed_at_fallback and not c.closed_now
                   for c in self._contacts.values())

    def window(self, user: str) -> tuple[int, int, int] | None:
        cache = self._cache
        if user in cache:
            return cache[user]
        out = cache[user] = self._window(user)
        return out

    def _window(self, user: str) -> tuple[int, int, int] | None:
        contacts = self._contacts
        c = contacts.get(self._shard_of(user)) if len(contacts) > 1 else next(iter(contacts.values()), None)
        if c is None:
            c = contacts.get(None)
        if c is None or c.ok_ns <= 0:
            return None  # never answered: no store holds anything of it
        if c.closed_at_fallback:
            return None  # the store went away: nothing reserved, nobody leases
        if c.closed_now:
            return self.NOTHING  # the store saw it go: it reserves nothing now
        # The store's last call from this engine ran before this (a call
        # answered ran before its reply; one that failed, within its timeout).
        last_seen = (c.first_failed_ns if c.first_failed_ns is not None else c.ok_ns) + self._timeout_ns
        asked = self._asked.get(user)
        if asked is None:
            return self.NOTHING
        sent_ns, divisor = asked
        # The store drops the mark of a live engine on a user it did not
        # lease for LIVE_S: it holds this one if it was leased since then.
        if sent_ns < last_seen + self._silent_ns - self._live_ns:
            return self.NOTHING
        return (last_seen + self._silent_ns, sent_ns + self._partition_ns, max(1, divisor))


class PartitionWatch:
    """The lease thread's part (``lease_thread.LeaseThread`` is one): the
    alive channels watched, and the fallback's terms (each lane's: the
    divisors it told the store with its asks, ``LeaseLane.asked``). Uses
    the thread's ``shards`` (``ShardState`` each), ``settings`` and its
    store."""

    def _alive_states(self) -> tuple[str, ...]:
        store = self._store
        if store is None:
            return ()
        return tuple(store.alive_status(k) for k in self.shards)

    def _note_alive(self, shard: Any) -> None:
        """A shard (or the one store; ``None`` of a cluster: every shard)
        falls back: was its alive channel seen closed (the store went away),
        or never made (a store that refuses SUBSCRIBE): nothing reserved?"""
        store = self._store
        if store is None:
            return
        for k, st in self.shards.items():
            if k == shard or (shard is None and self.settings.cluster):
                st.closed_at_fallback = store.alive_status(k) != UP

    def _watch_alive(self) -> None:
        """In fallback, an alive channel seen closed since: the store no
        longer reserves this engine's share (new terms)."""
        if not self.in_fallback:
            return
        seen = self._alive_states()
        if seen != self._alive_seen:
            self._alive_seen = seen
            self._post_fallback()

    def fallback_terms(self, asked: Mapping[str, tuple[int, int]]) -> FallbackTerms:
        """What each user may spend in fallback of the budget whose last
        answered asks are ``asked`` (a lane's, ``LeaseLane.asked``)."""
        store = self._store
        contacts = {}
        for k, st in self.shards.items():
            if k is None and self.settings.cluster:
                continue
            closed_now = store is not None and store.alive_status(k) == CLOSED
            contacts[k] = ShardContact(st.ok_ns, st.first_failed_ns, st.closed_at_fallback, closed_now)
        s = self.settings
        return FallbackTerms(contacts, asked, self.shard_of, s.timeout_s, s.partition_s,
                             LIVE_S, silent_window_s(s))
