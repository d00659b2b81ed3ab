"""The shared store of shared-budget mode: its Lua script and the one call an engine makes.

Every user's budget lives in the store (Redis, or Valkey) as one GCRA state,
its TAT in the store's own clock; ``LEASE_SCRIPT`` grants an engine slices
of it atomically, all of an engine's users in one call per tick. A user's
ceiling and prompt budget (``KIND_KEYS``) are budgets of the same form,
each a hash of its own, leased in the same call (the script does not tell
them apart: an entry is a key and its arguments). Only the
lease thread (``lease_thread``) calls the store, through ``RedisStore``; it
sends ``LeaseAsk`` entries sized by ``fleet_math`` and reads a
``LeaseReply``. The Redis client is imported only when a store is built.
"""

from __future__ import annotations

import math
import os
import random
import secrets
import socket
from dataclasses import dataclass
from fractions import Fraction
from collections.abc import Mapping
from typing import Any

from vllm_output_rate.alive import NONE, AliveChannel, alive_channel
from vllm_output_rate.shared_settings import SHARED_STATE_OPTION, SharedStateError, SharedStateSettings

#: An engine counts as live (heartbeat) and as sharing a user (lease) for
#: this long after its last call that said so.
LIVE_S = 2.0
#: How long (ms) a user's hash outlives its TAT, and the heartbeat set an
#: engine's call, in the store's own clock. (A simulation on a fake clock
#: slower than the store's sets its stores' ``keep_ms`` far higher.)
KEEP_MS = int(2 * LIVE_S * 1000)
#: Store key prefix.
KEY_PREFIX = "output_rate:"
#: The kinds of budget a user may have in the store, each its own hash (its
#: own GCRA) leased by the same per-tick call: ``RATE`` its (guaranteed)
#: output rate, ``CEILING`` its ceiling (``borrowing``: every output token
#: of the user, guaranteed or borrowed), ``PROMPT`` its prompt budget
#: (``prompt_budget``: prompt tokens computed). Kind -> the hash's key part.
RATE, CEILING, PROMPT = "rate", "ceiling", "prompt"
KIND_KEYS = {RATE: "user:", CEILING: "ceiling:", PROMPT: "prompt:"}
#: With long slices (or over a cluster: per shard), a round with nothing
#: to ask still calls the store this often (s): its heartbeat, its epoch.
HEARTBEAT_S = LIVE_S / 4
#: An engine whose last call is older than its silent window is *silent*
#: to the store: with a subscriber on its alive channel it is cut off,
#: without one dead (``partition``). Twice the longest a live engine goes
#: between calls when it calls once a heartbeat (long slices, a cluster's
#: shards); an engine that calls every tick: ``SILENT_TICKS`` ticks, at
#: least ``SILENT_MIN_S`` (``silent_window_s``).
SILENT_S = 2 * HEARTBEAT_S
SILENT_TICKS = 5
SILENT_MIN_S = 0.25

#: One call per engine per tick (per shard of a cluster: ``cluster_store``).
#: KEYS: the engines' heartbeat set, the epoch key, then (one store) one hash
#: per user (field ``tat``: its TAT in us of the store's clock; ``slot``:
#: 1/limit in us when it was last leased; ``e:<engine>``: when that engine
#: last leased the user; ``s:<engine>``: the TAT of that engine's share;
#: ``w:<engine>``: when the store last gave it less than it asked: while
#: another engine waits, each gets its share). ARGV: engine id, now in us
#: ('' = the store's clock), live window (us), lookahead (us), report window
#: (us), the epoch the engine knows ('' = none), a fresh epoch to set if the
#: store has none, how long (ms, in the store's own clock) the heartbeat set
#: outlives the call and a user's hash its TAT, the silent window (us), the
#: caller's partition window (us), then per user: (a cluster: its key,) slot length 1/limit
#: (us), tokens wanted, tokens spent to report (after a fallback or a reset),
#: the lookahead's extension for a long slice (us; 0: none), and the divisor
#: of the caller's fallback share of the user. Returns
#: {now, epoch, live engines, reset, then per user: granted, engines sharing
#: the user}. On ``reset`` (the engine's epoch is not the store's) nothing is
#: granted: the engine reports what it spent and asks again. Three commands
#: per user (HGETALL, HSET, PEXPIRE). Written once for both forms:
#: ``@USERS@`` is the number of users, ``@KEY@`` a user's key, ``@A@`` the
#: index of its first argument after the key, ``@NUMSUB@`` the subscriber
#: count of a channel (``NUMSUB``; a cluster's sharded ``SHARDNUMSUB``).
#:
#: **Cut off or dead** (``partition``). Each call also writes ``r:<engine>``
#: on each user: the divisor of its fallback share, the end of its
#: partition window (now + P) and its silent window (``silent_window_s``).
#: Another engine with marks on the user whose last call is older than its
#: silent window is looked at once per call: with a
#: subscriber on its alive channel (``<heartbeat key>:alive:<engine>``) and
#: its window not over, it is cut off: its fallback share (1/divisor of the
#: limit) stays reserved (the others are granted from the rest: each slot
#: is ``slot / (1 - reserved)`` long) and it still counts as sharing the
#: user; without one it is dead: its marks go at once.
_LEASE_BODY = """
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
local keep_ms = tonumber(ARGV[8])
redis.call('PEXPIRE', KEYS[1], keep_ms)
local live = redis.call('ZCARD', KEYS[1])
local silent_us = tonumber(ARGV[9])
local partition_us = tonumber(ARGV[10])
local class = {}
local function class_of(engine, silent)
  local c = class[engine]
  if c == nil then
    local hb = redis.call('ZSCORE', KEYS[1], engine)
    if hb and tonumber(hb) >= now - silent then
      c = 1
    else
      local subs = redis.call('PUBSUB', '@NUMSUB@', KEYS[1] .. ':alive:' .. engine)
      if tonumber(subs[2]) > 0 then c = 2 else c = 0 end
    end
    class[engine] = c
  end
  return c
end
local reset = 0
if ARGV[6] ~= '' and ARGV[6] ~= epoch then reset = 1 end
local out = {string.format('%.0f', now), epoch, live, reset}
local me = 'e:' .. ARGV[1]
local my_share = 's:' .. ARGV[1]
local my_wait = 'w:' .. ARGV[1]
local my_reserve = 'r:' .. ARGV[1]
local stamp = string.format('%.0f', now)
local reserve_end = string.format('%.0f %d', now + partition_us, silent_us)
for i = 1, @USERS@ do
  local key = @KEY@
  local a = @A@
  local slot = tonumber(ARGV[a])
  local want = tonumber(ARGV[a + 1])
  local used = tonumber(ARGV[a + 2])
  local ahead = lookahead + tonumber(ARGV[a + 3])
  local fields = redis.call('HGETALL', key)
  local tat = 0
  local old_slot = slot
  local share_tat = 0
  local sharing = 1
  local others_waiting = false
  local stale = {}
  local marks = nil
  local reserves = nil
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
      if tonumber(fields[j + 1]) >= now - ahead then
        others_waiting = true
      end
    elseif kind == 'e:' and f ~= me then
      marks = marks or {}
      marks[string.sub(f, 3)] = tonumber(fields[j + 1])
    elseif kind == 'r:' and f ~= my_reserve then
      reserves = reserves or {}
      reserves[string.sub(f, 3)] = fields[j + 1]
    end
  end
  local reserved = 0
  local cut = 0
  if marks then
    for engine, t in pairs(marks) do
      local r = reserves and reserves[engine]
      local div, untl, silent = nil, nil, silent_us
      if r then
        div, untl, silent = string.match(r, '^(%d+) (%d+) (%d+)$')
        silent = tonumber(silent) or silent_us
      end
      -- (a mark within its engine's silent window: its heartbeat, written
      -- by the same call, is as new: live, no look at the heartbeat set)
      local c = 1
      if t < now - silent then c = class_of(engine, silent) end
      local keep = false
      if c == 1 then
        if t >= now - live_us then
          sharing = sharing + 1
          keep = true
        end
      elseif c == 2 and div and tonumber(untl) >= now then
        reserved = reserved + 1 / tonumber(div)
        cut = cut + 1
        keep = true
      end
      if not keep then
        stale[#stale + 1] = 'e:' .. engine
        stale[#stale + 1] = 's:' .. engine
        stale[#stale + 1] = 'w:' .. engine
        stale[#stale + 1] = 'r:' .. engine
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
    -- (engines cut off keep their fallback shares: the rest is granted)
    local free = 1 - reserved
    if want > 0 and base - now <= ahead and free > 1e-9 then
      local gslot = slot / free
      granted = math.min(want, math.floor((now + ahead - base) / gslot) + 1)
      -- Contended (another engine sharing the user was refused within the
      -- lookahead): each engine gets at most its share, limit / sharing,
      -- kept as a GCRA of its own. Otherwise an engine may take more (its
      -- share's TAT still advances: it pays that back under contention).
      local share_slot = gslot * sharing
      local share_base = math.max(share_tat, now)
      if others_waiting then
        local fair = 0
        if share_base - now <= ahead then
          fair = math.floor((now + ahead - share_base) / share_slot) + 1
        end
        granted = math.min(granted, fair)
      end
      tat = base + granted * gslot
      share_tat = share_base + granted * share_slot
    end
  end
  sharing = sharing + cut
  redis.call('HSET', key, 'tat', string.format('%.3f', tat), 'slot', ARGV[a],
             me, stamp, my_share, string.format('%.3f', share_tat),
             my_reserve, ARGV[a + 4] .. ' ' .. reserve_end)
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

#: Arguments a user sends, after its key, and the call's before the users'.
ARGS_PER_USER = 5
CALL_ARGS = 10
#: One store: the users' keys are declared (KEYS), five arguments a user.
LEASE_SCRIPT = (_LEASE_BODY.replace("@USERS@", "#KEYS - 2").replace("@KEY@", "KEYS[2 + i]")
                .replace("@A@", f"{CALL_ARGS - ARGS_PER_USER + 1} + {ARGS_PER_USER} * i")
                .replace("@NUMSUB@", "NUMSUB"))


#: An engine that stops (its engine core shutting down, an orphan included)
#: leaves the fleet in one call: out of the heartbeat set, and its marks on
#: each user it leased (``e:``, ``s:``, ``w:``, ``r:``) gone, so the other engines
#: stop counting it as sharing those users, and as waiting, at their next
#: call instead of after ``LIVE_S``. The tokens it leased and did not spend
#: are not given back: the store cannot tell which of a user's grants came
#: after them, and the fleet bound counts every grant (they lapse with
#: their lease, within horizon + lookahead). KEYS: the heartbeat set, then
#: one hash per user. ARGV: the engine id. Returns the users it left.
#: (Written once for both forms: ``@USERS@`` the users' keys.)
_LEAVE_BODY = """
redis.call('ZREM', KEYS[1], ARGV[1])
local left = 0
for i = 2, #@USERS@ do
  left = left + redis.call('HDEL', @USERS@[i], 'e:' .. ARGV[1], 's:' .. ARGV[1], 'w:' .. ARGV[1],
                           'r:' .. ARGV[1])
end
return left
"""
LEAVE_SCRIPT = _LEAVE_BODY.replace("@USERS@", "KEYS")


@dataclass(frozen=True)
class LeaseAsk:
    """What an engine asks of the store for one budget of one user in one
    call (``kind``: which of the user's budgets, ``KIND_KEYS``)."""

    user: str
    rate: Fraction
    want: int
    used: int = 0
    #: a long slice (``LeaseSizer``): the store may grant slots up to
    #: ``slice_s`` further ahead, and the lease lives ``slice_s`` longer
    long: bool = False
    kind: str = RATE

    @property
    def budget(self) -> str | tuple[str, str]:
        """The budget's name in a reply: the user for its rate, (kind,
        user) for its other budgets."""
        return self.user if self.kind == RATE else (self.kind, self.user)


def budget_key(user: str, kind: str = RATE) -> str:
    """The key of one of a user's budgets in a single store."""
    return KEY_PREFIX + KIND_KEYS[kind] + user


def ask_args(ask: LeaseAsk, settings: SharedStateSettings,
             divisors: Mapping[Any, int] | None = None) -> tuple[str, int, int, int, int]:
    """A user's arguments to the lease script, after its key (``divisors``:
    the engine's fallback divisor per budget, ``LeaseAsk.budget``; 1 for a
    budget not in it)."""
    return (repr(float(ask.rate.denominator * 1e6 / ask.rate.numerator)), ask.want, ask.used,
            int(settings.slice_s * 1e6) if ask.long else 0,
            1 if divisors is None else divisors.get(ask.budget, 1))


def call_args(engine: str, settings: SharedStateSettings, known_epoch: str,
              now_us: float | None, keep_ms: int = KEEP_MS) -> list[Any]:
    """The lease script's arguments before the users'."""
    return [engine, "" if now_us is None else repr(float(now_us)), int(LIVE_S * 1e6),
            int(settings.lookahead_s * 1e6), int(report_window_s(settings) * 1e6),
            known_epoch, secrets.token_hex(8), keep_ms, int(silent_window_s(settings) * 1e6),
            int(settings.partition_s * 1e6)]


def silent_window_s(settings: SharedStateSettings) -> float:
    """How long after this engine's last call the store takes it to be
    silent (``SILENT_S``): it calls every tick unless it leases long slices
    or calls a cluster's shards (then once a heartbeat, ``HEARTBEAT_S``)."""
    if settings.cluster or settings.slice_s:
        return SILENT_S
    return max(SILENT_MIN_S, SILENT_TICKS * settings.tick_s)


def keep_ms_of(settings: SharedStateSettings) -> int:
    """How long (ms) a store keeps an engine's heartbeat and a user's hash
    past its TAT: the liveness window's twice, a long slice's twice (asked
    once a slice), and the partition window (a cut-off engine's reserve)."""
    return KEEP_MS + int(2000 * settings.slice_s) + int(1000 * settings.partition_s)


def round_s(settings: SharedStateSettings) -> float:
    """With long slices, each store (a cluster's shard) is called on its
    *rounds*, a fixed cadence (each engine its own phase): its heartbeat, at most
    ``HEARTBEAT_S`` apart, two or more a slice and a whole number of them
    (0.5 s at ``slice_ms=1000``). A round's call takes the long slices of
    the store's users due before the next round (``LeaseSizer.early_asks``:
    at most a round, half a slice, early), so a slice asked on a round
    falls due on a round: one call a round carries them."""
    return settings.slice_s / max(2, math.ceil(settings.slice_s / HEARTBEAT_S - 1e-9))


def next_rounds(next_round: dict[Any, int], shards: Any, now_ns: int, round_ns: int,
                phase_ns: int = 0) -> dict[Any, int]:
    """The shards (of ``shards``) whose round has come by ``now_ns`` ->
    that round's end (``round_s``), ``next_round`` (shard -> when its next
    round comes; at once if unknown) set to it. Rounds end on the times
    ``phase_ns`` (mod a round): each engine its own (random) phase, so that
    the engines sharing a user do not all ask for it at the same moment."""
    out = {}
    for shard in shards:
        if now_ns >= next_round.get(shard, now_ns):
            out[shard] = next_round[shard] = now_ns + round_ns - (now_ns - phase_ns) % round_ns
    return out


class Rounds:
    """(Long slices) One engine's rounds of a store's shards (``round_s``;
    one store: the shard ``None``): ``come`` each round of the lease
    thread, ``ends`` the shards on their round this time -> its end."""

    __slots__ = ("round_ns", "phase_ns", "next", "ends")

    def __init__(self, settings: SharedStateSettings) -> None:
        self.round_ns = int(round_s(settings) * 1e9) if settings.slice_s else 0
        #: the engine's phase (random: ``next_rounds``)
        self.phase_ns = random.randrange(self.round_ns) if self.round_ns else 0
        self.next: dict[Any, int] = {}
        self.ends: dict[Any, int] = {}

    def come(self, shards: Any, now_ns: int) -> dict[Any, int]:
        self.ends = next_rounds(self.next, shards, now_ns, self.round_ns, self.phase_ns)
        return self.ends


def report_window_s(settings: SharedStateSettings) -> float:
    """How far back an engine reports its spends after a fallback or a
    reset, and how far back the store may charge them: the longest a lease
    lives plus the farthest ahead a slot is granted."""
    return settings.long_horizon_s + settings.long_lookahead_s


@dataclass(frozen=True)
class LeaseReply:
    """The store's answer to one call."""

    now_us: float
    epoch: str
    live_engines: int
    reset: bool
    #: budget (``LeaseAsk.budget``: a user's rate by its name) -> (tokens
    #: granted, engines sharing the budget)
    granted: dict[Any, tuple[int, int]]


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
        self._leave_script = client.register_script(LEAVE_SCRIPT)
        #: script calls made, and user entries sent in them
        self.calls = 0
        self.entries = 0
        #: (long slices) the store's rounds (``round_s``)
        self.rounds = Rounds(settings)
        #: the engine's subscription on its alive channel (``partition``)
        self.alive: AliveChannel | None = None
        self.keep_ms = keep_ms_of(settings)

    def lease(self, engine: str, asks: list[LeaseAsk], known_epoch: str,
              now_us: float | None = None, divisors: Mapping[str, int] | None = None) -> LeaseReply:
        s = self.settings
        keys = [KEY_PREFIX + "engines", KEY_PREFIX + "epoch"]
        args = call_args(engine, s, known_epoch, now_us, self.keep_ms)
        for ask in asks:
            keys.append(budget_key(ask.user, ask.kind))
            args.extend(ask_args(ask, s, divisors))
        self.calls += 1
        self.entries += len(asks)
        return parse_reply(self._script(keys=keys, args=args), asks)

    def alive_status(self, shard: Any = None) -> str:
        """The engine's alive channel as last polled (``partition``)."""
        return NONE if self.alive is None else self.alive.state

    def drop_alive(self) -> None:
        """Drop the alive channel's subscription (as a process's end would)."""
        if self.alive is not None:
            self.alive.close()

    # -- what the lease thread uses (one store: one shard, ``None``) ----------

    def shard_of(self, user: str) -> None:
        return None

    def plan(self, asks: list[LeaseAsk], now_ns: int) -> dict[Any, list[LeaseAsk]]:
        """The calls of one round: one store, called every tick; with long
        slices (``slice_ms``), a round with nothing to ask only on the
        store's rounds (``round_s``: its heartbeat), as a cluster's shards."""
        if self.rounds.round_ns:
            if not self.rounds.come((None,), now_ns) and not asks:
                return {}
        return {None: asks}

    def lease_shards(self, engine: str, plan: dict[Any, list[LeaseAsk]], epochs: dict[Any, str],
                     now_us: float | None = None,
                     divisors: Mapping[str, int] | None = None) -> dict[Any, LeaseReply | Exception]:
        """Every call of a round; a failed call's entry is its exception.
        The alive channel is polled before, and made after an answer."""
        if not plan:
            return {}
        alive = self.alive
        if alive is None:
            alive = self.alive = AliveChannel(alive_channel(KEY_PREFIX + "engines", engine))
        alive.poll()
        try:
            reply = self.lease(engine, plan[None], epochs.get(None, ""), now_us=now_us,
                               divisors=divisors)
        except Exception as exc:  # the store is down, slow or refuses
            return {None: exc}
        alive.ensure(self.client.connection_pool.make_connection)
        return {None: reply}

    def leave(self, engine: str, users: list[str], kinds: tuple[str, ...] = (RATE,)) -> int:
        """Take ``engine`` out of the fleet (one call): see ``LEAVE_SCRIPT``;
        off the budgets of ``kinds`` of each of ``users``. Returns the marks
        removed."""
        keys = [KEY_PREFIX + "engines", *(budget_key(u, k) for k in kinds for u in users)]
        self.calls += 1
        return int(self._leave_script(keys=keys, args=[engine]))


def parse_reply(out: list[Any], asks: list[LeaseAsk]) -> LeaseReply:
    """The lease script's answer, read."""
    granted = {}
    for i, ask in enumerate(asks):
        granted[ask.budget] = (int(out[4 + 2 * i]), int(out[5 + 2 * i]))
    epoch = out[1].decode() if isinstance(out[1], bytes) else str(out[1])
    return LeaseReply(float(out[0]), epoch, int(out[2]), bool(int(out[3])), granted)


def new_engine_id(rank: int | str = 0) -> str:
    """A fleet-unique name for one engine core: host, process, rank, random."""
    return f"{socket.gethostname()}:{os.getpid()}:{rank}:{secrets.token_hex(3)}"

