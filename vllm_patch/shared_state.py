"""Shared-budget mode: one user's limit held across engines through Redis.

``--output-rate-shared-state redis://HOST:PORT[/DB]``. Each user's budget
lives in the store as one GCRA state (its TAT, in the store's own clock),
shared by every engine that names the same store. No engine's scheduler
thread ever waits on the network:

* a lease thread of each engine core (``LeaseThread``) asks the store every
  tick (``tick_s``, 50 ms) for slices of the budgets its users need, all in
  one call of an atomic server-side script (``LEASE_SCRIPT``). The store
  grants a slice only from slots that start no later than ``lookahead_s``
  ahead of its clock (a GCRA with that burst). Each engine asks for what
  its users spent lately, or, for a user it ran short of, at least its
  share (limit / engines sharing the user) until its next ask; while
  another engine sharing a user waits (was given less than it asked), the
  store gives each engine at most that share, so no engine takes every slot
  by asking first. A user the store had nothing for is asked for again
  after ``max(tick, lookahead / 2)``;
* the scheduler's thread spends only what it holds (``LeaseBook``): the
  engine's own limiter still paces each user at its full limit on this
  engine, and a token also needs a leased one. A lease is spendable for
  ``horizon_s`` from the moment its request was sent; what is left then
  expires (an engine that dies holds nothing hostage past that).

**The fleet bound.** Every token spent was granted at most ``H`` before it
was spent, and every granted token occupies one GCRA slot of length
``1/limit`` that starts no earlier than its grant and no later than ``B``
after it. So in any window of ``W`` seconds the whole fleet spends at most
``floor((W + H + B) x limit) + 1`` tokens of a user, with ``H`` the horizon
and ``B`` the lookahead (0.5 s and 0.25 s by default): the long-run rate is
exactly the limit, a short window may hold ``(H + B) x limit`` more.
``fleet_bound()`` states it; tests check it against a brute-force oracle.

**Faults.** Two calls in a row that fail or time out (``socket_timeout``,
250 ms; the thread waits, not the scheduler) put the engine in *fallback*: its
leases are dropped and each user gets ``limit / n`` on this engine alone,
``n`` being the number of engines the store last said were sharing that
user (users it never saw: the live engines it last saw), one log line per
episode, time and failed calls counted. The thread keeps trying every tick.
One failed call alone (a blip) changes nothing: the leases held stay
valid until their deadlines. When a call succeeds again, the engine first
charges the store with what it spent within the last ``H + B`` (so the
fleet does not get a fresh burst on top of what it spent; the leased part
of it is charged twice, which over-charges briefly), then leases as
before. A store that
lost its data (restarted empty) is told apart by an epoch key: every engine
that sees a new epoch does the same before leasing again.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any
from urllib.parse import parse_qs, urlsplit

from vllm_output_rate.lease_book import LeaseBook
from vllm_output_rate.limiter import BURST_NS, NS_PER_S, OutputRateLimiter

logger = logging.getLogger("vllm_output_rate")

SHARED_STATE_OPTION = "--output-rate-shared-state"

#: Defaults of the lease protocol (each can be set in the URL's query:
#: ``?tick_ms=50&horizon_ms=500&lookahead_ms=250&timeout_ms=250``).
TICK_S = 0.05
HORIZON_S = 0.5
LOOKAHEAD_S = 0.25
TIMEOUT_S = 0.25
#: An engine counts as live (heartbeat) and as sharing a user (lease) for
#: this long after its last call that said so.
LIVE_S = 2.0
#: Store key prefix.
KEY_PREFIX = "output_rate:"
#: Failed calls in a row that put an engine in fallback.
FAILURES_TO_FALLBACK = 2


class SharedStateError(ValueError):
    """The shared-state option has a value that cannot be used."""


@dataclass(frozen=True)
class SharedStateSettings:
    """Where the shared budgets live and the protocol's times."""

    url: str
    tick_s: float = TICK_S
    horizon_s: float = HORIZON_S
    lookahead_s: float = LOOKAHEAD_S
    timeout_s: float = TIMEOUT_S

    @property
    def redacted_url(self) -> str:
        """The URL without a password (for logs and metrics)."""
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{host}{port}{parts.path}"


_QUERY_KEYS = {"tick_ms": "tick_s", "horizon_ms": "horizon_s",
               "lookahead_ms": "lookahead_s", "timeout_ms": "timeout_s"}


def parse_shared_state(value: Any) -> SharedStateSettings:
    """``redis://[:PASSWORD@]HOST:PORT[/DB][?tick_ms=..&horizon_ms=..&
    lookahead_ms=..&timeout_ms=..]`` (or ``rediss://``, ``valkey://``)."""
    if not isinstance(value, str) or not value.strip():
        raise SharedStateError(f"{SHARED_STATE_OPTION}: expected redis://HOST:PORT[/DB], got {value!r}")
    text = value.strip()
    parts = urlsplit(text)
    if parts.scheme not in ("redis", "rediss", "valkey", "valkeys"):
        raise SharedStateError(
            f"{SHARED_STATE_OPTION}: expected a redis:// (or rediss://, valkey://) URL, got {_safe(text)!r}")
    try:
        port = parts.port
    except ValueError:
        raise SharedStateError(f"{SHARED_STATE_OPTION}: bad port in {_safe(text)!r}") from None
    if not parts.hostname or port is None:
        raise SharedStateError(
            f"{SHARED_STATE_OPTION}: the URL needs a host and a port (redis://HOST:PORT[/DB]), got {_safe(text)!r}")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise SharedStateError(f"{SHARED_STATE_OPTION}: the database must be a number, got {db!r}")
    times: dict[str, float] = {}
    for key, values in parse_qs(parts.query, keep_blank_values=True).items():
        if key not in _QUERY_KEYS:
            raise SharedStateError(
                f"{SHARED_STATE_OPTION}: unknown setting {key!r} (known: {', '.join(_QUERY_KEYS)})")
        try:
            ms = float(values[-1])
        except ValueError:
            ms = float("nan")
        if not (ms > 0 and math.isfinite(ms)):
            raise SharedStateError(
                f"{SHARED_STATE_OPTION}: {key} must be a positive number of milliseconds, got {values[-1]!r}")
        times[_QUERY_KEYS[key]] = ms / 1000
    settings = SharedStateSettings(text, **times)
    if settings.horizon_s < 2 * settings.tick_s:
        raise SharedStateError(
            f"{SHARED_STATE_OPTION}: horizon_ms ({settings.horizon_s * 1000:g}) must be at least "
            f"two ticks (tick_ms {settings.tick_s * 1000:g}), or leases expire before they are renewed")
    return settings


def _safe(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return url.replace(parts.password, "***")
    return url


def fleet_bound(window_s: float, rate: Fraction | float, horizon_s: float,
                lookahead_s: float) -> int:
    """Most tokens the whole fleet spends for one user in any window of
    ``window_s`` seconds in shared-budget mode (see the module docstring)."""
    return math.floor((window_s + horizon_s + lookahead_s) * float(rate) + 1e-9) + 1


# -- the store's side ------------------------------------------------------------

#: One call per engine per tick. KEYS: the engines' heartbeat set, the epoch
#: key, then one hash per user (field ``tat``: its TAT in us of the store's
#: clock; ``slot``: 1/limit in us when it was last leased; ``e:<engine>``: when that engine last leased the user; ``s:<engine>``:
#: the TAT of that engine's share; ``w:<engine>``: when the store last gave it
#: less than it asked: while another engine waits, each gets its share).
#: ARGV: engine id, now in us ('' = the store's clock), live window (us),
#: lookahead (us), report window (us), the epoch the engine knows ('' =
#: none), a fresh epoch to set if the store has none, then per user: slot
#: length 1/limit (us), tokens wanted, tokens spent to report (after a
#: fallback or a reset). Returns {now, epoch, live engines, reset, then per
#: user: granted, engines sharing the user}. On ``reset`` (the engine's epoch
#: is not the store's) nothing is granted: the engine reports what it spent
#: and asks again. Three commands per user (HGETALL, HSET, PEXPIRE).
LEASE_SCRIPT = """
local now
if ARGV[2] ~= '' then
  now = tonumber(ARGV[2])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local live_us = tonumber(ARGV[3])
local lookahead = tonumber(ARGV[4])
local window = tonumber(ARGV[5])
local epoch = redis.call('GET', KEYS[2])
if not epoch then
  epoch = ARGV[7]
  redis.call('SET', KEYS[2], epoch)
end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - live_us)
redis.call('PEXPIRE', KEYS[1], math.ceil(live_us / 1000) * 2)
local live = redis.call('ZCARD', KEYS[1])
local reset = 0
if ARGV[6] ~= '' and ARGV[6] ~= epoch then reset = 1 end
local out = {string.format('%.0f', now), epoch, live, reset}
local me = 'e:' .. ARGV[1]
local my_share = 's:' .. ARGV[1]
local my_wait = 'w:' .. ARGV[1]
local stamp = string.format('%.0f', now)
local keep_ms = math.ceil(live_us / 1000) * 2
for i = 1, #KEYS - 2 do
  local key = KEYS[2 + i]
  local slot = tonumber(ARGV[5 + 3 * i])
  local want = tonumber(ARGV[6 + 3 * i])
  local used = tonumber(ARGV[7 + 3 * i])
  local fields = redis.call('HGETALL', key)
  local tat = 0
  local old_slot = slot
  local share_tat = 0
  local sharing = 1
  local others_waiting = false
  local stale = {}
  for j = 1, #fields, 2 do
    local f = fields[j]
    local kind = string.sub(f, 1, 2)
    if f == 'tat' then
      tat = tonumber(fields[j + 1])
    elseif f == 'slot' then
      old_slot = tonumber(fields[j + 1])
    elseif f == my_share then
      share_tat = tonumber(fields[j + 1])
    elseif kind == 'w:' and f ~= my_wait then
      if tonumber(fields[j + 1]) >= now - lookahead then
        others_waiting = true
      end
    elseif kind == 'e:' and f ~= me then
      if tonumber(fields[j + 1]) >= now - live_us then
        sharing = sharing + 1
      else
        local engine = string.sub(f, 3)
        stale[#stale + 1] = f
        stale[#stale + 1] = 's:' .. engine
        stale[#stale + 1] = 'w:' .. engine
      end
    end
  end
  if old_slot ~= slot then
    -- The limit changed (a reloaded limits file): the debt is kept in
    -- tokens, as the engines' own limiters keep it; shares start afresh.
    if tat > now then
      tat = now + (tat - now) * slot / old_slot
    end
    share_tat = 0
  end
  local granted = 0
  if reset == 0 then
    if used > 0 then
      tat = math.max(tat, now - window) + used * slot
    end
    local base = math.max(tat, now)
    if want > 0 and base - now <= lookahead then
      granted = math.min(want, math.floor((now + lookahead - base) / slot) + 1)
      -- Contended (another engine sharing the user was refused within the
      -- lookahead): each engine gets at most its share, limit / sharing,
      -- kept as a GCRA of its own. Otherwise an engine may take more (its
      -- share's TAT still advances: it pays that back under contention).
      local share_slot = slot * sharing
      local share_base = math.max(share_tat, now)
      if others_waiting then
        local fair = 0
        if share_base - now <= lookahead then
          fair = math.floor((now + lookahead - share_base) / share_slot) + 1
        end
        granted = math.min(granted, fair)
      end
      tat = base + granted * slot
      share_tat = share_base + granted * share_slot
    end
  end
  redis.call('HSET', key, 'tat', string.format('%.3f', tat), 'slot', ARGV[5 + 3 * i],
             me, stamp, my_share, string.format('%.3f', share_tat))
  if granted < want then
    redis.call('HSET', key, my_wait, stamp)
  end
  if #stale > 0 then
    redis.call('HDEL', key, unpack(stale))
  end
  redis.call('PEXPIRE', key, math.max(0, math.ceil((tat - now) / 1000)) + keep_ms)
  out[#out + 1] = granted
  out[#out + 1] = sharing
end
return out
"""


@dataclass(frozen=True)
class LeaseAsk:
    """What an engine asks of the store for one user in one call."""

    user: str
    rate: Fraction
    want: int
    used: int = 0


@dataclass(frozen=True)
class LeaseReply:
    """The store's answer to one call."""

    now_us: float
    epoch: str
    live_engines: int
    reset: bool
    #: user -> (tokens granted, engines sharing the user)
    granted: dict[str, tuple[int, int]]


class RedisStore:
    """The shared store: one script call per engine per tick."""

    def __init__(self, settings: SharedStateSettings, client: Any | None = None) -> None:
        if client is None:
            try:
                import redis
            except ImportError:
                raise SharedStateError(
                    f"{SHARED_STATE_OPTION} needs the 'redis' Python client: "
                    f"pip install 'vllm-output-rate[shared]'") from None
            url = settings.url.replace("valkey", "redis", 1) if settings.url.startswith("valkey") else settings.url
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            # No retries inside the client (its default retries with a
            # backoff of seconds): the lease thread asks again next tick.
            client = redis.Redis.from_url(
                url.split("?", 1)[0], socket_timeout=settings.timeout_s,
                socket_connect_timeout=settings.timeout_s, retry=Retry(NoBackoff(), 0),
                health_check_interval=0)
        self.client = client
        self.settings = settings
        self._script = client.register_script(LEASE_SCRIPT)
        #: script calls made, and user entries sent in them
        self.calls = 0
        self.entries = 0

    def lease(self, engine: str, asks: list[LeaseAsk], known_epoch: str,
              now_us: float | None = None) -> LeaseReply:
        s = self.settings
        keys = [KEY_PREFIX + "engines", KEY_PREFIX + "epoch"]
        args: list[Any] = [engine, "" if now_us is None else repr(float(now_us)),
                           int(LIVE_S * 1e6), int(s.lookahead_s * 1e6),
                           int((s.horizon_s + s.lookahead_s) * 1e6), known_epoch,
                           secrets.token_hex(8)]
        for ask in asks:
            keys.append(KEY_PREFIX + "user:" + ask.user)
            args.append(repr(float(ask.rate.denominator * 1e6 / ask.rate.numerator)))
            args.append(ask.want)
            args.append(ask.used)
        self.calls += 1
        self.entries += len(asks)
        out = self._script(keys=keys, args=args)
        granted = {}
        for i, ask in enumerate(asks):
            granted[ask.user] = (int(out[4 + 2 * i]), int(out[5 + 2 * i]))
        epoch = out[1].decode() if isinstance(out[1], bytes) else str(out[1])
        return LeaseReply(float(out[0]), epoch, int(out[2]), bool(int(out[3])), granted)


# -- the engine's side -------------------------------------------------------------


class _FallbackLimiter(OutputRateLimiter):
    """Each user's limit divided by the engines last seen sharing it."""

    def __init__(self, base: OutputRateLimiter, sharing: Mapping[str, int], live: int) -> None:
        super().__init__(base.default_rate, base.user_rates, base.burst_ns)
        self._base_rate = base.rate_of
        self._sharing = dict(sharing)
        self._live = max(1, live)

    def rate_of(self, user: str) -> Fraction:
        return self._base_rate(user) / max(1, self._sharing.get(user, self._live))


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
                 engine_id: str | None = None, start_thread: bool = True) -> None:
        super().__init__(default_rate, user_rates, burst_ns)
        self.settings = settings
        self.book = LeaseBook()
        self._balance = self.book.balance  # (the same dict, for the hot path)
        #: scheduler -> lease thread: (now_ns, {user: tokens}, fallback?)
        #: per step that charged, and users short of leases (one append each)
        self.usage: deque[tuple[int, Mapping[str, int], bool]] = deque()
        self.starved: deque[str] = deque()
        #: lease thread -> scheduler: (user, tokens, deadline_ns)
        self.grants: deque[tuple[str, int, int]] = deque()
        #: set by the lease thread; taken up at the next step boundary
        self.fallback_next: _FallbackLimiter | None = None
        self._fallback: _FallbackLimiter | None = None
        #: bumped by the lease thread to have every lease dropped (a store
        #: that lost its data); seen at the next step boundary
        self.clear_requests = 0
        self._clears_seen = 0
        self._starved_step: set[str] = set()
        self.thread = LeaseThread(self, settings, store=store, clock=clock,
                                  engine_id=engine_id)
        if start_thread:
            self.thread.start()

    @property
    def in_fallback(self) -> bool:
        return self._fallback is not None

    def begin_step(self, now_ns: int) -> None:
        """Take up grants and a mode change, drop expired leases."""
        grants = self.grants
        book = self.book
        while grants:
            user, tokens, deadline = grants.popleft()
            book.add_grant(user, tokens, deadline)
        fallback = self.fallback_next
        if fallback is not self._fallback:
            self._fallback = fallback
            if fallback is not None:
                book.clear()
        if self.clear_requests != self._clears_seen:
            self._clears_seen = self.clear_requests
            book.clear()
        book.expire(now_ns)
        self._starved_step.clear()

    def available(self, user: str, now_ns: int) -> int:
        fallback = self._fallback
        if fallback is not None:
            return fallback.available(user, now_ns)
        held = self._balance.get(user, 0)
        if held <= 0:
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

    def refund(self, user: str) -> None:
        # Only the plain limiter's try_take callers refund; the scheduler
        # settles net charges. A refunded token is not handed back to the
        # store (over-charging is allowed).
        if self._fallback is not None:
            self._fallback.refund(user)
        else:
            super().refund(user)

    def ready_at_ns(self, user: str) -> int:
        fallback = self._fallback
        if fallback is not None:
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
        retry = thread.retry_at.get(user)
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
        self.thread.stop()

    def stats(self) -> dict[str, float]:
        """Counters and gauges of the lease machinery (plain numbers, read
        from any thread)."""
        t, book = self.thread, self.book
        return {
            "leased": book.granted, "spent": book.spent, "expired": book.expired,
            "unleased": t.unleased_spent, "calls": t.calls, "failed_calls": t.failed_calls,
            "fallback": 1.0 if t.in_fallback else 0.0, "fallback_seconds": t.fallback_seconds(),
            "fallback_episodes": t.fallback_episodes, "resets": t.resets,
            "live_engines": t.live_engines,
        }


def new_engine_id(rank: int | str = 0) -> str:
    """A fleet-unique name for one engine core: host, process, rank, random."""
    return f"{socket.gethostname()}:{os.getpid()}:{rank}:{secrets.token_hex(3)}"


class LeaseThread:
    """The engine core's background thread that leases from the store."""

    def __init__(self, limiter: SharedBudgetLimiter, settings: SharedStateSettings,
                 store: Any | None = None, clock: Callable[[], int] = time.monotonic_ns,
                 engine_id: str | None = None) -> None:
        self.limiter = limiter
        self.settings = settings
        self._store = store
        self.clock = clock
        self.engine_id = engine_id or new_engine_id()
        self.epoch = ""
        self.live_engines = 1
        self.sharing: dict[str, int] = {}
        self.calls = 0
        self.failed_calls = 0
        self.fallback_episodes = 0
        self.resets = 0
        self.unleased_spent = 0
        self.in_fallback = False
        self._failures = 0  # failed calls in a row
        self._fallback_since: float | None = None
        self._fallback_total = 0.0
        self._report_usage = False
        # user -> tokens spent since the last call; the spends of the last
        # horizon + lookahead per call, (monotonic ns, {user: tokens}), for
        # the report after a fallback or a reset
        self._recent: dict[str, int] = {}
        self._short: set[str] = set()
        self._demand: dict[str, float] = {}
        self._spends: deque[tuple[int, dict[str, int]]] = deque()
        #: user -> when to ask the store again (ns), for users the store
        #: granted less than asked: the fleet's budget is spent for now.
        #: Replaced whole after each call (the scheduler's thread reads it).
        self.retry_at: dict[str, int] = {}
        self._retry_ns = int(max(settings.tick_s, settings.lookahead_s / 2) * NS_PER_S)
        self._last_ask_ns = 0
        self._latencies: deque[float] = deque(maxlen=4096)
        self._wake = threading.Event()
        self._stop = threading.Event()
        #: shortest time between two calls (a user short of budget wakes
        #: the thread at once, but not more often than this)
        self.min_gap_ns = int(settings.tick_s * NS_PER_S) // 5
        #: how long after its call a grant is taken to be there (the engine
        #: loop looks again then)
        self.round_trip_ns = 2_000_000
        self._thread: threading.Thread | None = None

    # -- scheduler's side (cheap, lock-free reads) ---------------------------

    def wake(self) -> None:
        if not self._wake.is_set():
            self._wake.set()

    def drain_latencies(self) -> list[float]:
        """Call latencies (seconds) since the last drain (one reader)."""
        out, latencies = [], self._latencies
        while latencies:
            out.append(latencies.popleft())
        return out

    def fallback_seconds(self) -> float:
        since = self._fallback_since
        return self._fallback_total + (0.0 if since is None else time.monotonic() - since)

    # -- the thread --------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="output-rate-leases", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.settings.timeout_s + 1)

    @property
    def store(self) -> Any:
        if self._store is None:
            self._store = RedisStore(self.settings)
        return self._store

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
        """One round: read what the scheduler spent, ask the store, post
        the grants (tests call it directly, with the store's time)."""
        limiter = self.limiter
        now_ns = self.clock()
        self._drain(now_ns)
        asks = self._asks(now_ns)
        sent_ns = self.clock()
        t0 = time.perf_counter()
        try:
            reply = self.store.lease(self.engine_id, asks, self.epoch, now_us=now_us)
        except Exception as exc:  # the store is down, slow or refuses
            self.calls += 1
            self.failed_calls += 1
            self._failures += 1
            # One failed call (a blip: a call slower than the timeout on a
            # loaded machine) keeps the leases held; two in a row is an outage.
            if self._failures >= FAILURES_TO_FALLBACK:
                self._enter_fallback(f"{type(exc).__name__}: {exc}")
            return
        self.calls += 1
        self._failures = 0
        self._latencies.append(time.perf_counter() - t0)
        self.live_engines = reply.live_engines
        if reply.reset or (self.epoch and reply.epoch != self.epoch):
            # The store lost its data (or this engine first met it after a
            # fallback): report what was spent, then lease again.
            if self.epoch:
                self.resets += 1
                logger.warning("output-rate shared state: the store at %s lost its data "
                               "(new epoch); reporting recent spends before leasing again",
                               self.settings.redacted_url)
            self.epoch = reply.epoch
            self._report_usage = True
            # The store forgot the slots of the leases held: drop them.
            limiter.grants.clear()
            limiter.clear_requests += 1
            self._wake.set()
            return
        self.epoch = reply.epoch
        deadline = sent_ns + int(self.settings.horizon_s * NS_PER_S)
        retry_at = {u: t for u, t in self.retry_at.items() if t > now_ns}
        retry = now_ns + self._retry_ns
        for ask in asks:
            tokens, sharing = reply.granted[ask.user]
            self.sharing[ask.user] = sharing
            if tokens > 0:
                limiter.grants.append((ask.user, tokens, deadline))
            if tokens < ask.want:
                retry_at[ask.user] = retry
            else:
                retry_at.pop(ask.user, None)
        self.retry_at = retry_at
        if self._report_usage:
            self._report_usage = False
            self._spends.clear()
        if self.in_fallback:
            self._leave_fallback()

    def _drain(self, now_ns: int) -> None:
        limiter = self.limiter
        usage = limiter.usage
        recent = self._recent = {}
        while usage:
            _, taken, unleased = usage.popleft()
            for user, n in taken.items():
                if n > 0:
                    recent[user] = recent.get(user, 0) + n
                    if unleased:
                        self.unleased_spent += n
        short = self._short
        short.clear()
        while limiter.starved:
            short.add(limiter.starved.popleft())
        spends = self._spends
        if recent:
            spends.append((now_ns, recent))
        window_ns = int((self.settings.horizon_s + self.settings.lookahead_s) * NS_PER_S)
        while spends and spends[0][0] < now_ns - window_ns:
            spends.popleft()

    def _asks(self, now_ns: int) -> list[LeaseAsk]:
        """Per user with demand on this engine: what to ask for.

        A user it ran short of: at least its fair share (limit / engines
        sharing the user; the store caps a contended budget at that), more
        if it spent more lately, to last until the next ask (a retry
        interval and two ticks). Any other user: one and a half times what
        it spent lately, for two ticks. What an engine holds stays well
        under the horizon's worth, so leases are spent, not left to expire.
        Never above the limit."""
        limiter = self.limiter
        tick = self.settings.tick_s
        elapsed = max((now_ns - self._last_ask_ns) / NS_PER_S, tick)
        self._last_ask_ns = now_ns
        cover_short = self._retry_ns / NS_PER_S + 2 * tick
        held = limiter.book.balance
        demand = self._demand  # user -> tokens per second wanted lately
        users = set(self._recent) | self._short
        # A user's demand estimate decays over a few ticks without spends.
        for user in list(demand):
            if user not in users:
                demand[user] *= 0.5
                if demand[user] * 2 * tick < 0.5:
                    del demand[user]
        # After a fallback or a reset: everything spent within the window
        # the store must know of (over-charges the leased part the store
        # still knows after a plain fallback: allowed, and brief).
        used: dict[str, int] = {}
        if self._report_usage:
            for _, spent in self._spends:
                for user, n in spent.items():
                    used[user] = used.get(user, 0) + n
        asks = []
        retry_at = self.retry_at
        for user in users | set(demand) | set(used):
            if retry_at.get(user, 0) > now_ns and not used.get(user):
                continue  # the store said no for now: ask again later
            rate = limiter.rate_of(user)
            limit = float(rate)
            spend = self._recent.get(user, 0) / elapsed
            if user in self._short:
                # (Doubling from what it spent or asked last: a user whose
                # limit is far above what one engine serves gets no lease it
                # cannot use, and reaches what it can use in a few asks.)
                fair = limit / max(1, self.sharing.get(user, 1))
                grown = 2 * max(spend, demand.get(user, 0.0)) + 4 / cover_short
                wanted, cover = max(min(fair, grown), spend), cover_short
            else:
                wanted, cover = max(1.5 * spend, demand.get(user, 0.0)), 2 * tick
            wanted = demand[user] = min(wanted, limit)
            want = max(0, math.ceil(wanted * cover) - held.get(user, 0))
            if want or used.get(user):
                asks.append(LeaseAsk(user, rate, want, used.get(user, 0)))
        return asks

    def _enter_fallback(self, why: str) -> None:
        limiter = self.limiter
        if not self.in_fallback:
            self.in_fallback = True
            self.fallback_episodes += 1
            self._fallback_since = time.monotonic()
            logger.warning(
                "output-rate shared state: the store at %s is unreachable (%s); each user "
                "gets its limit divided by the engines last seen sharing it (%d live "
                "engines last seen) until it answers again",
                self.settings.redacted_url, why[:200], self.live_engines)
            limiter.grants.clear()
            self.retry_at = {}
            limiter.fallback_next = _FallbackLimiter(limiter, self.sharing, self.live_engines)
        self._report_usage = True

    def _leave_fallback(self) -> None:
        since = self._fallback_since
        if since is not None:
            self._fallback_total += time.monotonic() - since
        self._fallback_since = None
        self.in_fallback = False
        self.limiter.fallback_next = None
        logger.warning("output-rate shared state: the store at %s answers again; shared "
                       "budgets resumed", self.settings.redacted_url)
