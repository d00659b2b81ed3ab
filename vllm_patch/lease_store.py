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

import os
import secrets
import socket
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

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
#: outlives the call and a user's hash its TAT, then per user: (a cluster: its key,) slot length 1/limit
#: (us), tokens wanted, tokens spent to report (after a fallback or a reset),
#: and the lookahead's extension for a long slice (us; 0: none). Returns
#: {now, epoch, live engines, reset, then per user: granted, engines sharing
#: the user}. On ``reset`` (the engine's epoch is not the store's) nothing is
#: granted: the engine reports what it spent and asks again. Three commands
#: per user (HGETALL, HSET, PEXPIRE). Written once for both forms:
#: ``@USERS@`` is the number of users, ``@KEY@`` a user's key, ``@A@`` the
#: index of its first argument after the key.
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
local reset = 0
if ARGV[6] ~= '' and ARGV[6] ~= epoch then reset = 1 end
local out = {string.format('%.0f', now), epoch, live, reset}
local me = 'e:' .. ARGV[1]
local my_share = 's:' .. ARGV[1]
local my_wait = 'w:' .. ARGV[1]
local stamp = string.format('%.0f', now)
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
    if want > 0 and base - now <= ahead then
      granted = math.min(want, math.floor((now + ahead - base) / slot) + 1)
      -- Contended (another engine sharing the user was refused within the
      -- lookahead): each engine gets at most its share, limit / sharing,
      -- kept as a GCRA of its own. Otherwise an engine may take more (its
      -- share's TAT still advances: it pays that back under contention).
      local share_slot = slot * sharing
      local share_base = math.max(share_tat, now)
      if others_waiting then
        local fair = 0
        if share_base - now <= ahead then
          fair = math.floor((now + ahead - share_base) / share_slot) + 1
        end
        granted = math.min(granted, fair)
      end
      tat = base + granted * slot
      share_tat = share_base + granted * share_slot
    end
  end
  redis.call('HSET', key, 'tat', string.format('%.3f', tat), 'slot', ARGV[a],
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

#: One store: the users' keys are declared (KEYS), four arguments a user.
LEASE_SCRIPT = (_LEASE_BODY.replace("@USERS@", "#KEYS - 2").replace("@KEY@", "KEYS[2 + i]")
                .replace("@A@", "5 + 4 * i"))
#: Arguments a user sends, after its key.
ARGS_PER_USER = 4


#: An engine that stops (its engine core shutting down, an orphan included)
#: leaves the fleet in one call: out of the heartbeat set, and its marks on
#: each user it leased (``e:``, ``s:``, ``w:``) gone, so the other engines
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
  left = left + redis.call('HDEL', @USERS@[i], 'e:' .. ARGV[1], 's:' .. ARGV[1], 'w:' .. ARGV[1])
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


def ask_args(ask: LeaseAsk, settings: SharedStateSettings) -> tuple[str, int, int, int]:
    """A user's arguments to the lease script, after its key."""
    return (repr(float(ask.rate.denominator * 1e6 / ask.rate.numerator)), ask.want, ask.used,
            int(settings.slice_s * 1e6) if ask.long else 0)


def call_args(engine: str, settings: SharedStateSettings, known_epoch: str,
              now_us: float | None, keep_ms: int = KEEP_MS) -> list[Any]:
    """The lease script's arguments before the users'."""
    return [engine, "" if now_us is None else repr(float(now_us)), int(LIVE_S * 1e6),
            int(settings.lookahead_s * 1e6), int(report_window_s(settings) * 1e6),
            known_epoch, secrets.token_hex(8), keep_ms]


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
        self._last_call_ns = -(10**18)
        self.keep_ms = KEEP_MS + int(2000 * settings.slice_s)  # (a slice asked once a slice)

    def lease(self, engine: str, asks: list[LeaseAsk], known_epoch: str,
              now_us: float | None = None) -> LeaseReply:
        s = self.settings
        keys = [KEY_PREFIX + "engines", KEY_PREFIX + "epoch"]
        args = call_args(engine, s, known_epoch, now_us, self.keep_ms)
        for ask in asks:
            keys.append(budget_key(ask.user, ask.kind))
            args.extend(ask_args(ask, s))
        self.calls += 1
        self.entries += len(asks)
        return parse_reply(self._script(keys=keys, args=args), asks)

    # -- what the lease thread uses (one store: one shard, ``None``) ----------

    def shard_of(self, user: str) -> None:
        return None

    def plan(self, asks: list[LeaseAsk], now_ns: int) -> dict[Any, list[LeaseAsk]]:
        """The calls of one round: one store, called every tick; with long
        slices (``slice_ms``), a round with nothing to ask only when the
        heartbeat is due (``HEARTBEAT_S``), as a cluster's shards are."""
        if not asks and self.settings.slice_s and now_ns - self._last_call_ns < HEARTBEAT_S * 1e9:
            return {}
        self._last_call_ns = now_ns
        return {None: asks}

    def lease_shards(self, engine: str, plan: dict[Any, list[LeaseAsk]], epochs: dict[Any, str],
                     now_us: float | None = None) -> dict[Any, LeaseReply | Exception]:
        """Every call of a round; a failed call's entry is its exception."""
        if not plan:
            return {}
        try:
            return {None: self.lease(engine, plan[None], epochs.get(None, ""), now_us=now_us)}
        except Exception as exc:  # the store is down, slow or refuses
            return {None: exc}

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

