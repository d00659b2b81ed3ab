"""The shared store over a Redis Cluster (or a Valkey cluster): one script call per shard per tick.

``--output-rate-shared-state redis-cluster://HOST:PORT[,HOST:PORT...]``.
Each user's budget is one hash, ``output_rate:user:{USER}`` (its ceiling's
and prompt budget's ``output_rate:ceiling:{USER}``, ``output_rate:prompt:{USER}``):
the braces are a hash tag, so everything of one user is on one slot. A shard (a master and
the slots it serves) has its own heartbeat set and epoch key, on a slot of
its own (``output_rate:shard:{TAG}:engines`` / ``:epoch``, ``TAG`` chosen to
hash to the shard's first slot). An engine's round groups its users by
shard and makes one call of the lease script per shard, sent to every
shard before any reply is read (one round trip for all of them), with the
users' keys among the arguments (the script is flagged
``allow-cross-slot-keys``: Redis 7 lets it touch keys of several slots on
the node it runs on; the declared keys route the call). A shard is also
called, with no users, at least every ``HEARTBEAT_S`` (the heartbeat); with
long slices on its rounds (``lease_store.round_s``), which carry its users'
long slices.

A shard is an independent store to the lease thread (``lease_thread``):
its own epoch, failures and fallback. A shard whose master changed (a
failover: a replica promoted, perhaps without the last writes) is treated
as a store that lost its data: the next call names no epoch the shard can
have, so the script grants nothing and the engine reports its spends before
leasing again, as after an empty restart. The slot map is read with
``CLUSTER SLOTS`` from any node that answers, at the first call and after
any call that failed (a node down, ``MOVED``, ``CLUSTERDOWN``). Pure
client side: the Redis client is imported only when a store is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_output_rate.alive import NONE, AliveChannel, alive_channel
from vllm_output_rate.lease_store import (_LEASE_BODY, _LEAVE_BODY, ARGS_PER_USER, CALL_ARGS, HEARTBEAT_S, KEY_PREFIX,
                                          KIND_KEYS, RATE, LeaseAsk, LeaseReply, ask_args, call_args, keep_ms_of,
                                          Rounds, parse_reply)
from vllm_output_rate.shared_settings import SHARED_STATE_OPTION, SharedStateError, SharedStateSettings

#: Slots of a Redis Cluster.
SLOTS = 16384
#: An epoch no shard has: sent after a shard's master changed, so that the
#: engine handles the shard as one that lost its data.
MOVED_EPOCH = "master-changed"

#: The lease script over a cluster: KEYS are the shard's heartbeat set and
#: epoch key; each user's key is its first argument (``lease_store``).
CLUSTER_LEASE_SCRIPT = "#!lua flags=allow-cross-slot-keys\n" + (
    _LEASE_BODY.replace("@USERS@", f"(#ARGV - {CALL_ARGS}) / {ARGS_PER_USER + 1}")
    .replace("@KEY@", f"ARGV[{CALL_ARGS - ARGS_PER_USER} + {ARGS_PER_USER + 1} * i]")
    .replace("@A@", f"{CALL_ARGS - ARGS_PER_USER + 1} + {ARGS_PER_USER + 1} * i")
    .replace("@NUMSUB@", "SHARDNUMSUB"))

#: ``lease_store.LEAVE_SCRIPT`` over a cluster: KEYS: the shard's heartbeat
#: set; ARGV: the engine id, then the keys of its users on the shard.
CLUSTER_LEAVE_SCRIPT = "#!lua flags=allow-cross-slot-keys\n" + _LEAVE_BODY.replace("@USERS@", "ARGV")


def user_key(user: str, kind: str = RATE) -> str:
    """A user's hash in a cluster (its id the hash tag: every budget of a
    user, ``KIND_KEYS``, on the same slot). An id that is empty or starts
    with ``}`` would make an empty tag (Redis then hashes the whole key, a
    slot per kind): such ids are tagged ``~`` (one slot for all of them)."""
    tag = user if user[:1] not in ("", "}") else "~" + user
    return KEY_PREFIX + KIND_KEYS[kind] + "{" + tag + "}"


class ClusterStore:
    """The shared store over a cluster: one call per shard per round."""

    def __init__(self, settings: SharedStateSettings,
                 clients: dict[tuple[str, int], Any] | None = None) -> None:
        try:
            import redis
            from redis.crc import key_slot
        except ImportError:
            raise SharedStateError(
                f"{SHARED_STATE_OPTION} needs the 'redis' Python client: "
                f"pip install 'vllm-output-rate[shared]'") from None
        self._redis = redis
        self._key_slot = key_slot
        self.settings = settings
        self._password = _password(settings.url)
        self._tls = settings.url.split(":", 1)[0] in ("rediss-cluster", "valkeys-cluster")
        #: (host, port) -> client (a simulation's engines may share them)
        self._clients: dict[tuple[str, int], Any] = {} if clients is None else clients
        #: slot -> shard (its first slot); shard -> its master, its key tag
        self._slot_shard: list[int] | None = None
        self.masters: dict[int, tuple[str, int]] = {}
        self._tags: dict[int, str] = {}
        #: shards whose master changed since their last call
        self._moved: set[int] = set()
        self._stale_map = True
        #: nodes whose last call failed; when the slot map was last read (ns)
        self._failing: set[tuple[str, int]] = set()
        self._refreshed_ns: int | None = None
        #: user -> slot (a user's slot never changes)
        self._user_slot: dict[str, int] = {}
        self._last_call_ns: dict[int, int] = {}
        #: (long slices) the shards' rounds (``lease_store.round_s``)
        self.rounds = Rounds(settings)
        #: shard -> the engine's subscription on its alive channel there
        self.alive: dict[int, AliveChannel] = {}
        self._lease_sha = self._leave_sha = ""
        self.keep_ms = keep_ms_of(settings)
        #: script calls made, and user entries sent in them
        self.calls = 0
        self.entries = 0
        #: shard -> user entries sent to it
        self.shard_entries: dict[int, int] = {}

    # -- the slot map -----------------------------------------------------------

    def _client(self, address: tuple[str, int]) -> Any:
        client = self._clients.get(address)
        if client is None:
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            # No retries inside the client: the lease thread asks again next tick.
            client = self._clients[address] = self._redis.Redis(
                host=address[0], port=address[1], password=self._password, ssl=self._tls,
                socket_timeout=self.settings.timeout_s,
                socket_connect_timeout=self.settings.timeout_s, retry=Retry(NoBackoff(), 0),
                health_check_interval=0)
        return client

    def refresh(self) -> None:
        """Read the slot map from the first node that answers (the nodes of
        the URL, then the masters known); raises when none does."""
        error: Exception | None = None
        candidates = dict.fromkeys([*self.masters.values(), *self.settings.nodes])
        # (the nodes whose calls failed last: at the end, a partitioned node
        # costs its timeout only when no other answers)
        for address in sorted(candidates, key=lambda a: a in self._failing):
            try:
                ranges = self._client(address).execute_command("CLUSTER SLOTS")
            except Exception as exc:  # this node is down: the next one
                error = exc
                continue
            self._set_map(ranges, address)
            return
        raise ConnectionError(f"no node of the cluster answers ({error})")

    def _set_map(self, ranges: list[Any], via: tuple[str, int]) -> None:
        by_master: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for entry in ranges:
            host = entry[2][0].decode() if isinstance(entry[2][0], bytes) else str(entry[2][0])
            address = (host or via[0], int(entry[2][1]))
            by_master.setdefault(address, []).append((int(entry[0]), int(entry[1])))
        slot_shard = [-1] * SLOTS
        masters: dict[int, tuple[str, int]] = {}
        for address, spans in by_master.items():
            shard = min(start for start, _ in spans)
            masters[shard] = address
            for start, end in spans:
                slot_shard[start:end + 1] = [shard] * (end - start + 1)
            if shard not in self._tags:
                self._tags[shard] = self._tag_for(shard)
        for shard, address in masters.items():
            if shard in self.masters and self.masters[shard] != address:
                self._moved.add(shard)
        self.masters = masters
        self._slot_shard = slot_shard
        self._stale_map = False

    def _tag_for(self, slot: int) -> str:
        """A hash tag on ``slot`` (a search over short strings: 16384 slots,
        a few tens of thousands of tries at most)."""
        i = 0
        while self._key_slot(f"s{i}".encode()) != slot:
            i += 1
        return f"s{i}"

    def shard_of(self, user: str) -> int | None:
        """The shard of ``user`` (its first slot), None while the slot map
        is unknown or the slot is not served. Read by the scheduler's thread
        too (plain dict and list reads)."""
        slot = self._user_slot.get(user)
        if slot is None:
            if len(self._user_slot) > 1_000_000:
                self._user_slot = {}
            slot = self._user_slot[user] = self._key_slot(user_key(user).encode())
        slot_shard = self._slot_shard
        if slot_shard is None or slot_shard[slot] < 0:
            return None
        return slot_shard[slot]

    # -- the rounds ---------------------------------------------------------------

    def plan(self, asks: list[LeaseAsk], now_ns: int) -> dict[Any, list[LeaseAsk]]:
        """The calls of one round: per shard, its users' asks; a shard with
        none only when its heartbeat is due (long slices: on its rounds,
        ``rounds.ends``). Raises when no node answers
        (the slot map unknown: every user is in the dark). The map is read
        again after a failed call, at most every ``HEARTBEAT_S`` while a
        shard keeps failing."""
        if self._slot_shard is None or (self._stale_map and (
                self._refreshed_ns is None or now_ns - self._refreshed_ns >= HEARTBEAT_S * 1e9)):
            self._refreshed_ns = now_ns
            self.refresh()
        plan: dict[Any, list[LeaseAsk]] = {}
        for ask in asks:
            shard = self.shard_of(ask.user)
            if shard is not None:
                plan.setdefault(shard, []).append(ask)
        if self.rounds.round_ns:
            # (long slices) every shard on its rounds (its heartbeat)
            for shard in self.rounds.come(self.masters, now_ns):
                plan.setdefault(shard, [])
            return plan
        heartbeat_ns = int(HEARTBEAT_S * 1e9)
        for shard in self.masters:
            if shard not in plan and now_ns - self._last_call_ns.get(shard, -heartbeat_ns) >= heartbeat_ns:
                plan[shard] = []
        return plan

    def lease_shards(self, engine: str, plan: dict[Any, list[LeaseAsk]], epochs: dict[Any, str],
                     now_us: float | None = None, now_ns: int = 0,
                     divisors: Mapping[str, int] | None = None) -> dict[Any, LeaseReply | Exception]:
        """One call per shard of ``plan``, all sent before any reply is read
        (each shard's alive channel polled before, made after an answer)."""
        s = self.settings
        sent: list[tuple[int, Any, Any, list[Any]]] = []
        out: dict[Any, LeaseReply | Exception] = {}
        for shard, asks in plan.items():
            tag = self._tags[shard]
            keys = [f"{KEY_PREFIX}shard:{{{tag}}}:engines", f"{KEY_PREFIX}shard:{{{tag}}}:epoch"]
            alive = self.alive.get(shard)
            if alive is None:
                alive = self.alive[shard] = AliveChannel(alive_channel(keys[0], engine), sharded=True)
            elif shard in self._moved:
                alive.close()  # (subscribed on the old master)
            alive.poll()
            epoch = MOVED_EPOCH if shard in self._moved else epochs.get(shard, "")
            args = call_args(engine, s, epoch, now_us, self.keep_ms)
            for ask in asks:
                args.append(user_key(ask.user, ask.kind))
                args.extend(ask_args(ask, s, divisors))
            self.calls += 1
            self.entries += len(asks)
            self.shard_entries[shard] = self.shard_entries.get(shard, 0) + len(asks)
            self._last_call_ns[shard] = now_ns
            command = ["EVALSHA", self._lease_sha or "0", 2, *keys, *args]
            try:
                pool = self._client(self.masters[shard]).connection_pool
                conn = pool.get_connection()
            except Exception as exc:
                self._failing.add(self.masters[shard])
                out[shard] = exc
                continue
            try:
                conn.send_command(*command)
            except Exception as exc:
                self._release(pool, conn, broken=True)
                self._failing.add(self.masters[shard])
                out[shard] = exc
                continue
            sent.append((shard, pool, conn, command))
        for shard, pool, conn, command in sent:
            try:
                try:
                    reply = conn.read_response()
                except self._redis.exceptions.NoScriptError:
                    # first call, or a shard restarted: load it, send again
                    self._lease_sha = conn_load(conn, CLUSTER_LEASE_SCRIPT)
                    command[1] = self._lease_sha
                    conn.send_command(*command)
                    reply = conn.read_response()
                out[shard] = parse_reply(reply, plan[shard])
                self._moved.discard(shard)
                self._failing.discard(self.masters[shard])
                self._release(pool, conn)
                self.alive[shard].ensure(pool.make_connection)
            except Exception as exc:  # down, slow, MOVED, CLUSTERDOWN
                self._release(pool, conn, broken=True)
                self._failing.add(self.masters[shard])
                out[shard] = exc
        if any(isinstance(r, Exception) for r in out.values()):
            self._stale_map = True  # read the slot map again next round
        return out

    def _release(self, pool: Any, conn: Any, broken: bool = False) -> None:
        if broken:
            conn.disconnect()
        pool.release(conn)

    def leave(self, engine: str, users: list[str], kinds: tuple[str, ...] = (RATE,)) -> int:
        """Take ``engine`` out of the fleet: one call per shard (see
        ``lease_store.LEAVE_SCRIPT``), off the budgets of ``kinds`` of each
        of ``users``. Returns the marks removed."""
        if self._stale_map or self._slot_shard is None:
            self.refresh()
        by_shard: dict[int, list[str]] = {shard: [] for shard in self.masters}
        for user in users:
            shard = self.shard_of(user)
            if shard is not None:
                by_shard[shard].extend(user_key(user, kind) for kind in kinds)
        left = 0
        for shard, keys in by_shard.items():
            client = self._client(self.masters[shard])
            self.calls += 1
            left += int(client.eval(CLUSTER_LEAVE_SCRIPT, 1,
                                    f"{KEY_PREFIX}shard:{{{self._tags[shard]}}}:engines",
                                    engine, *keys))
        return left

    def alive_status(self, shard: Any) -> str:
        """A shard's alive channel as last polled (``partition``)."""
        alive = self.alive.get(shard)
        return NONE if alive is None else alive.state

    def drop_alive(self) -> None:
        """Drop the alive channels' subscriptions (as a process's end would)."""
        for alive in self.alive.values():
            alive.close()

    def close(self) -> None:
        self.drop_alive()
        for client in self._clients.values():
            client.close()


def conn_load(conn: Any, script: str) -> str:
    """``SCRIPT LOAD`` on one connection; returns the script's SHA1."""
    conn.send_command("SCRIPT", "LOAD", script)
    sha = conn.read_response()
    return sha.decode() if isinstance(sha, bytes) else str(sha)


def _password(url: str) -> str | None:
    netloc = url.split("://", 1)[-1].split("/", 1)[0].split("?", 1)[0]
    if "@" not in netloc:
        return None
    userinfo = netloc.rsplit("@", 1)[0]
    from urllib.parse import unquote

    return unquote(userinfo.split(":", 1)[1]) if ":" in userinfo else unquote(userinfo)
