"""Many engines' shared-budget limiters against a real Redis (or Redis Cluster), on a fake clock.

Each simulated engine is the engine core's own ``SharedBudgetLimiter`` and
``LeaseThread`` (the real lease protocol and server-side script), driven the
way the scheduler drives them: per step ``begin_step``, one ``available``
per user with demand, ``settle`` of what it spends, ``ready_at_ns`` for a
user it refused; per tick one ``LeaseThread.tick`` with the store's time
given (the script takes the fake clock instead of Redis' own, so a run is
repeatable). What the fleet spends per user is recorded for the fleet bound.
A fleet may also lease each user's ceiling and prompt budget (``budgets``:
the limiters of ``SharedBudgetLimiter.second_budget``, lanes of the same
lease thread): an engine then takes a token of the ceiling for every
output token, lends each user what its streams want beyond its rate (an
engine with idle capacity) up to the ceiling's tokens it holds, and
computes each user's prompt tokens per step (``SimEngine.prompts``) within
its prompt budget; what the fleet spends of each is recorded per kind.

Used by the tests (small fleets, brute-force bound) and by
``python -m vllm_output_rate.tools.fleet_sim`` (64+ engines, 10,000 users:
Redis operations per second and the bound observed; ``BENCHMARKS.md``):
``--shards N`` starts a Redis Cluster of N masters, ``--slice-ms 0,1000``
runs the same fleet without and with long slices, one after the other.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import time
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

from vllm_output_rate.cluster_store import ClusterStore
from vllm_output_rate.fleet_math import fleet_bound
from vllm_output_rate.lease_store import CEILING, PROMPT, RedisStore
from vllm_output_rate.limiter import NS_PER_S
from vllm_output_rate.shared_limiter import SharedBudgetLimiter
from vllm_output_rate.shared_settings import SharedStateSettings, parse_shared_state

#: The fake clock starts here (ns): far from 0, like a real monotonic clock.
T0_NS = 1_000_000 * NS_PER_S


@dataclass
class SimEngine:
    name: str
    limiter: SharedBudgetLimiter
    #: first tick of this engine (ticks of engines are staggered)
    offset_ns: int
    #: user -> streams wanting one token per step (its demand)
    streams: dict[str, int] = field(default_factory=dict)
    alive: bool = True
    #: user -> [(ns, tokens)] this engine spent
    spends: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    next_tick_ns: int = 0
    last_call_ns: int = 0
    #: kind -> the limiter of the users' ceilings or prompt budgets
    others: dict[str, SharedBudgetLimiter] = field(default_factory=dict)
    #: user -> prompt tokens it wants computed per step (prompt budgets)
    prompts: dict[str, int] = field(default_factory=dict)
    #: kind -> user -> [(ns, tokens)] this engine spent of that budget
    kind_spends: dict[str, dict[str, list[tuple[int, int]]]] = field(default_factory=dict)


class Fleet:
    """Engines on one fake clock, one store."""

    def __init__(self, url: str, default_rate: Fraction, user_rates: dict[str, Fraction] | None = None,
                 settings: SharedStateSettings | None = None, step_s: float = 0.01,
                 seed: int = 0,
                 budgets: dict[str, tuple[Fraction, dict[str, Fraction]]] | None = None) -> None:
        # (the URL's query, if any: timeout_ms=..., as the engine reads it)
        self.settings = settings or parse_shared_state(url)
        self.default_rate = Fraction(default_rate)
        self.user_rates = dict(user_rates or {})
        self.now_ns = T0_NS
        self.step_ns = int(step_s * NS_PER_S)
        self.rng = random.Random(seed)
        self.engines: list[SimEngine] = []
        #: user -> [(ns, tokens)] spent by the whole fleet
        self.spends: dict[str, list[tuple[int, int]]] = {}
        #: a cluster's node clients, shared by the engines' stores
        self.cluster_clients: dict = {}
        #: (large runs) the users whose spends are kept (None: all), and
        #: every user's tokens counted from ``count_from_ns`` on
        self.keep: set[str] | None = None
        self.count_from_ns: int | None = None
        self.totals: dict[str, int] = {}
        #: kind (``CEILING``, ``PROMPT``) -> (default, user -> rate) of the
        #: users' other budgets, and what the fleet spent of each:
        #: kind -> user -> [(ns, tokens)]
        self.budgets = dict(budgets or {})
        self.kind_spends: dict[str, dict[str, list[tuple[int, int]]]] = {k: {} for k in self.budgets}

    def clock(self) -> int:
        return self.now_ns

    def add_engine(self, name: str | None = None, client=None) -> SimEngine:
        """An engine; its store a ``RedisStore`` (on ``client``, if given),
        or over a cluster a ``ClusterStore`` (its node clients shared by the
        fleet's engines)."""
        # (unique: a store keeps the alive channels of another fleet's
        # engines that were not closed)
        name = name or f"engine-{len(self.engines)}-{secrets.token_hex(3)}"
        if self.settings.cluster:
            store = ClusterStore(self.settings, clients=self.cluster_clients)
        else:
            store = RedisStore(self.settings, client=client)
        # The store expires keys in its own clock, which runs far ahead of
        # this fake one in a large run: keep them an hour of the store's time.
        store.keep_ms = 3_600_000
        if store.rounds.round_ns:  # (its rounds' phase from the fleet's seed: a repeatable run)
            store.rounds.phase_ns = self.rng.randrange(store.rounds.round_ns)
        limiter = SharedBudgetLimiter(self.default_rate, self.user_rates, self.settings,
                                      store=store, clock=self.clock, engine_id=name,
                                      start_thread=False)
        tick_ns = int(self.settings.tick_s * NS_PER_S)
        engine = SimEngine(name, limiter, self.rng.randrange(tick_ns))
        for kind, (default, rates) in self.budgets.items():
            engine.others[kind] = limiter.second_budget(kind, default, rates)
        engine.next_tick_ns = self.now_ns + engine.offset_ns
        self.engines.append(engine)
        return engine

    def step(self) -> None:
        """One engine step everywhere, then the ticks that fall due."""
        now = self.now_ns
        tick_ns = int(self.settings.tick_s * NS_PER_S)
        # Real engines' calls are independent: no engine always asks first.
        order = self.engines[:]
        self.rng.shuffle(order)
        for engine in order:
            if not engine.alive:
                continue
            limiter = engine.limiter
            thread = limiter.thread
            # Its tick, or at once (not within min_gap of the last call)
            # when a user ran short of leases, as the lease thread does.
            if now >= engine.next_tick_ns or (
                    limiter.starved and now >= engine.last_call_ns + thread.min_gap_ns):
                engine.next_tick_ns = now + tick_ns
                engine.last_call_ns = now
                thread.tick(now_us=now / 1000)
            limiter.begin_step(now)
            taken: dict[str, int] = {}
            ceiling = engine.others.get(CEILING)
            ceiled: dict[str, int] = {}
            for user, streams in engine.streams.items():
                if streams <= 0:
                    continue
                n = min(limiter.available(user, now), streams)
                if ceiling is not None:
                    # every token within the ceiling's leases; what its
                    # streams want beyond its rate lent up to them
                    c = ceiling.available(user, now)
                    n = min(n, c)
                    if c > n and streams > n:
                        ceiled[user] = min(streams, c)
                    elif n:
                        ceiled[user] = n
                    if c < streams:  # refused at its ceiling (the scheduler asks when)
                        ceiling.ready_at_ns(user)
                if n > 0:
                    taken[user] = n
                if n < streams:
                    limiter.ready_at_ns(user)
            limiter.settle(now, taken)
            if ceiling is not None:
                ceiling.settle(now, ceiled)
                self._record(CEILING, engine, now, ceiled)
            prompt = engine.others.get(PROMPT)
            if prompt is not None:
                computed = {}
                for user, want in engine.prompts.items():
                    n = min(want, prompt.available(user, now))
                    if n > 0:
                        computed[user] = n
                    if n < want:  # a chunk cut (the scheduler asks when)
                        prompt.ready_at_ns(user)
                prompt.settle(now, computed)
                self._record(PROMPT, engine, now, computed)
            for user, n in taken.items():
                if self.keep is None or user in self.keep:
                    self.spends.setdefault(user, []).append((now, n))
                    engine.spends.setdefault(user, []).append((now, n))
                if self.count_from_ns is not None and now >= self.count_from_ns:
                    self.totals[user] = self.totals.get(user, 0) + n
        self.now_ns += self.step_ns

    def _record(self, kind: str, engine: SimEngine, now: int, taken: dict[str, int]) -> None:
        spends = self.kind_spends[kind]
        mine = engine.kind_spends.setdefault(kind, {})
        for user, n in taken.items():
            if self.keep is None or user in self.keep:
                spends.setdefault(user, []).append((now, n))
                mine.setdefault(user, []).append((now, n))

    def run(self, seconds: float, each_step: Callable[[Fleet], None] | None = None) -> None:
        end = self.now_ns + int(seconds * NS_PER_S)
        while self.now_ns < end:
            if each_step is not None:
                each_step(self)
            self.step()

    def kill(self, engine: SimEngine) -> None:
        """The engine dies whole: it stops, and its kernel closes its
        sockets (the store sees its alive channel go: ``partition``); its
        leases simply lapse."""
        engine.alive = False
        engine.limiter.thread.store.drop_alive()

    def leave(self, engine: SimEngine) -> None:
        """The engine shuts down as an engine core does: it stops, then
        leaves the store (``SharedBudgetLimiter.close``)."""
        engine.alive = False
        engine.limiter.close()

    def play(self, engines: list[SimEngine], plan: list[tuple[int, int, int]], until_s: float,
             coin: Callable[[], bool], user: str = "u") -> None:
        """Random joins, leaves and deaths (the property tests): at each
        ``(second, engine, streams)`` of ``plan`` the engine serves ``user``
        with that many streams, or, for 0 streams and a ``coin`` saying so,
        dies holding its leases or shuts down and leaves the store (a
        second ``coin``); then the fleet runs until ``until_s``."""
        t = 0.0
        for phase_s, i, streams in sorted(plan):
            if phase_s > t:
                self.run(phase_s - t)
                t = phase_s
            engine = engines[i]
            if streams == 0 and coin():
                if coin():
                    self.kill(engine)  # an engine that dies (its leases simply lapse)
                else:
                    self.leave(engine)  # one that shuts down and leaves the store
            else:
                engine.alive = True
                engine.streams = {user: streams}
        self.run(until_s - t)

    def rate_of(self, user: str) -> Fraction:
        return self.user_rates.get(user, self.default_rate)

    def spent(self, user: str, start_ns: int | None = None, end_ns: int | None = None) -> int:
        return sum(n for t, n in self.spends.get(user, ())
                   if (start_ns is None or t >= start_ns) and (end_ns is None or t < end_ns))

    def store_ops(self) -> tuple[int, int]:
        """Script calls and user entries sent, over every engine."""
        calls = sum(e.limiter.thread.store.calls for e in self.engines)
        entries = sum(e.limiter.thread.store.entries for e in self.engines)
        return calls, entries


def worst_window_excess(spends: list[tuple[int, int]], rate: Fraction, horizon_s: float,
                        lookahead_s: float, extra: int = 0,
                        min_window_s: float = 0.0) -> tuple[int, float]:
    """Brute force over every window that starts and ends at a spend:
    the largest ``tokens - fleet_bound(window) - extra`` (<= 0: the bound
    holds) and the window where it is. ``spends`` sorted by time."""
    times = [t for t, _ in spends]
    prefix = [0]
    for _, n in spends:
        prefix.append(prefix[-1] + n)
    worst, where = -10**9, 0.0
    for i, start in enumerate(times):
        for j in range(i, len(times)):
            w = (times[j] - start) / NS_PER_S
            if w < min_window_s:
                continue
            tokens = prefix[j + 1] - prefix[i]
            excess = tokens - fleet_bound(w, rate, horizon_s, lookahead_s) - extra
            if excess > worst:
                worst, where = excess, w
    return worst, where


def worst_window_ratio(spends: list[tuple[int, int]], rate: Fraction, horizon_s: float,
                       lookahead_s: float, windows_s: tuple[float, ...] = (1.0, 5.0)) -> dict[str, float]:
    """For long runs (too many spends to pair): per window length, the most
    tokens in any window of that length (sliding over spend times), as a
    share of ``fleet_bound``."""
    times = [t for t, _ in spends]
    prefix = [0]
    for _, n in spends:
        prefix.append(prefix[-1] + n)
    out = {}
    for w in windows_s:
        span = int(w * NS_PER_S)
        best = 0
        for i, start in enumerate(times):
            j = bisect_right(times, start + span)
            best = max(best, prefix[j] - prefix[i])
        out[f"{w:g}s"] = best / fleet_bound(w, rate, horizon_s, lookahead_s)
    return out


# -- the large simulation (BENCHMARKS.md) -------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--engines-per-user", type=int, default=4,
                        help="each user's streams land on this many engines (random)")
    parser.add_argument("--rate", type=float, default=20.0, help="every user's limit (tok/s)")
    parser.add_argument("--seconds", type=float, default=10.0, help="simulated time measured")
    parser.add_argument("--warmup", type=float, default=2.0,
                        help="simulated time before the measured part (long slices start "
                        "after two whole slices of steady spending)")
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--tick-ms", type=float, default=50.0)
    parser.add_argument("--horizon-ms", type=float, default=500.0)
    parser.add_argument("--lookahead-ms", type=float, default=250.0)
    parser.add_argument("--slice-ms", default="0",
                        help="long slices (0: off); several, comma-separated: one arm each, "
                        "run in turn on the same store (before/after in one run)")
    parser.add_argument("--repeat", type=int, default=1, help="run the arms this many times, alternating")
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="added to every store call (a store across a network)")
    parser.add_argument("--ceiling", default="0",
                        help="every user's ceiling (tok/s; 0: none): a fleet-wide budget leased "
                        "beside the rate, each engine lending what its streams want beyond it; "
                        "several, comma-separated: one arm each, paired with --prompt-rate's")
    parser.add_argument("--prompt-rate", default="0",
                        help="every user's prompt budget (prompt tokens/s; 0: none), leased "
                        "beside the rate; several: one arm each (as --ceiling)")
    parser.add_argument("--prompt-per-step", type=int, default=200,
                        help="prompt tokens each engine wants computed per user per step")
    parser.add_argument("--shards", type=int, default=0,
                        help="start a Redis Cluster of this many masters (0: one plain redis-server)")
    parser.add_argument("--url", default=None, help="a Redis (or redis-cluster://) to use (default: start one)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from vllm_output_rate.tools.redis_server import RedisCluster, RedisServer

    server = None
    if not args.url:
        server = RedisCluster(args.shards).start() if args.shards else RedisServer().start()
    url = args.url or server.url
    results = []
    try:
        slices = [float(x) for x in args.slice_ms.split(",")]
        ceilings = [float(x) for x in args.ceiling.split(",")]
        prompts = [float(x) for x in args.prompt_rate.split(",")]
        n = max(len(ceilings), len(prompts))
        if len(ceilings) not in (1, n) or len(prompts) not in (1, n):
            parser.error("--ceiling and --prompt-rate: one value, or as many as each other")
        arms = list(zip(ceilings * (n // len(ceilings)), prompts * (n // len(prompts))))
        for _ in range(args.repeat):
            for slice_ms in slices:
                for ceiling, prompt_rate in arms:
                    result = run_large(url, args, slice_ms, ceiling, prompt_rate)
                    print(json.dumps(result), flush=True)
                    results.append(result)
    finally:
        if server is not None:
            server.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _store_nodes(url: str, settings: SharedStateSettings) -> list:
    """A client per store node (a cluster: per master)."""
    import redis

    if not settings.cluster:
        return [redis.Redis.from_url(url.split("?", 1)[0])]
    probe = ClusterStore(settings)
    probe.refresh()
    return [redis.Redis(host=probe.masters[k][0], port=probe.masters[k][1]) for k in sorted(probe.masters)]


def _node_counters(client) -> tuple[float, int, float]:
    """Script seconds and calls (INFO commandstats), CPU seconds (INFO cpu)."""
    stats, cpu = client.info("commandstats"), client.info("cpu")
    script_s, calls = 0.0, 0
    for key in ("cmdstat_evalsha", "cmdstat_eval"):
        if key in stats:
            script_s += stats[key]["usec"] / 1e6
            calls += stats[key]["calls"]
    return script_s, calls, float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


def _shard_entries(fleet: Fleet, settings: SharedStateSettings, shards: int) -> list[int]:
    """User entries sent to each shard so far, over every engine."""
    out = [0] * shards
    if settings.cluster:
        masters = sorted(fleet.engines[0].limiter.thread.store.masters)
        for e in fleet.engines:
            for shard, n in e.limiter.thread.store.shard_entries.items():
                out[masters.index(shard)] += n
    return out


def run_large(url: str, args: argparse.Namespace, slice_ms: float = 0.0, ceiling: float = 0.0,
              prompt_rate: float = 0.0) -> dict:
    settings = SharedStateSettings(url, tick_s=args.tick_ms / 1000, horizon_s=args.horizon_ms / 1000,
                                   lookahead_s=args.lookahead_ms / 1000, slice_s=slice_ms / 1000)
    if url.split(":", 1)[0].endswith("-cluster"):
        settings = SharedStateSettings(url, tick_s=settings.tick_s, horizon_s=settings.horizon_s,
                                       lookahead_s=settings.lookahead_s, slice_s=settings.slice_s,
                                       nodes=parse_shared_state(url).nodes)
    rate = Fraction(args.rate).limit_denominator(1000)
    second = {kind: (Fraction(v).limit_denominator(1000), {})
              for kind, v in ((CEILING, ceiling), (PROMPT, prompt_rate)) if v > 0}
    fleet = Fleet(url, rate, settings=settings, step_s=args.step_ms / 1000, seed=1, budgets=second)
    nodes = _store_nodes(url, settings)
    for node in nodes:
        node.flushdb()
    client = None if settings.cluster else nodes[0]
    for _ in range(args.engines):
        fleet.add_engine(client=client)
    sample = [f"user-{u}" for u in range(0, args.users, max(1, args.users // 200))]
    fleet.keep = set(sample)
    rng = random.Random(2)
    for u in range(args.users):
        user = f"user-{u}"
        for engine in rng.sample(fleet.engines, min(args.engines_per_user, args.engines)):
            engine.streams[user] = engine.streams.get(user, 0) + 2
            if PROMPT in second:
                engine.prompts[user] = args.prompt_per_step
    if args.latency_ms > 0:
        delay = args.latency_ms / 1000
        for engine in fleet.engines:
            store = engine.limiter.thread.store
            lease = store.lease_shards

            def slow(*a, __lease=lease, **k):
                time.sleep(delay)
                return __lease(*a, **k)

            store.lease_shards = slow
    fleet.run(args.warmup)
    start_ns = fleet.count_from_ns = fleet.now_ns
    calls0, entries0 = fleet.store_ops()
    shard0 = _shard_entries(fleet, settings, len(nodes))
    before = [_node_counters(n) for n in nodes]
    wall0 = time.perf_counter()
    fleet.run(args.seconds)
    wall = time.perf_counter() - wall0
    after = [_node_counters(n) for n in nodes]
    calls, entries = (a - b for a, b in zip(fleet.store_ops(), (calls0, entries0)))
    script_s = sum(a[0] - b[0] for a, b in zip(after, before))
    cpu_s = [a[2] - b[2] for a, b in zip(after, before)]
    shard_calls = [a[1] - b[1] for a, b in zip(after, before)]
    span = (fleet.now_ns - start_ns) / NS_PER_S
    rates = sorted(fleet.totals.get(f"user-{u}", 0) / span for u in range(args.users))
    ratios: dict[str, float] = {}
    for user in sample:
        for k, v in worst_window_ratio(sorted(fleet.spends.get(user, [])), rate, settings.long_horizon_s,
                                       settings.long_lookahead_s).items():
            ratios[k] = max(ratios.get(k, 0.0), v)
    kinds: dict[str, dict] = {}
    for kind, (limit, _) in second.items():
        worst: dict[str, float] = {}
        rates_k = []
        for user in sample:
            spends = sorted(fleet.kind_spends[kind].get(user, []))
            rates_k.append(sum(n for t, n in spends if t >= start_ns) / span / float(limit))
            for k, v in worst_window_ratio(spends, limit, settings.long_horizon_s,
                                           settings.long_lookahead_s).items():
                worst[k] = max(worst.get(k, 0.0), v)
        rates_k.sort()
        kinds[kind] = {"limit": float(limit),
                       "fleet_rate_over_limit": {"min": round(rates_k[0], 4),
                                                 "median": round(rates_k[len(rates_k) // 2], 4),
                                                 "max": round(rates_k[-1], 4)},
                       "worst_window_over_bound": {k: round(v, 4) for k, v in worst.items()}}
    shard_entries = [a - b for a, b in zip(_shard_entries(fleet, settings, len(nodes)), shard0)]
    for node in nodes:
        node.close()
    return {
        "engines": args.engines, "users": args.users, "engines_per_user": args.engines_per_user,
        "shards": len(nodes) if settings.cluster else 0,
        "rate": float(rate), "measured_s": span, "wall_s": round(wall, 2),
        "tick_ms": args.tick_ms, "horizon_ms": args.horizon_ms, "lookahead_ms": args.lookahead_ms,
        "slice_ms": slice_ms, "ceiling": ceiling, "prompt_rate": prompt_rate, "latency_ms": args.latency_ms,
        "store_calls_per_s_per_engine": round(calls / span / args.engines, 2),
        "store_calls_per_s": round(calls / span, 1),
        "user_entries_per_s": round(entries / span, 1),
        "user_entries_per_s_per_user": round(entries / span / args.users, 3),
        "store_script_us_per_user_entry": round(script_s * 1e6 / max(entries, 1), 2),
        "store_cpu_us_per_user_entry": round(sum(cpu_s) * 1e6 / max(entries, 1), 2),
        "store_cpu_share_per_node_at_simulated_speed": [round(c / span, 3) for c in cpu_s],
        "script_calls_per_s_per_node": [round(c / span, 1) for c in shard_calls],
        "user_entries_per_s_per_shard": [round(n / span, 1) for n in shard_entries] if settings.cluster else [],
        "failed_calls": sum(e.limiter.stats()["failed_calls"] for e in fleet.engines),
        "fallback_episodes": sum(e.limiter.stats()["fallback_episodes"] for e in fleet.engines),
        "resets": sum(e.limiter.stats()["resets"] for e in fleet.engines),
        "fleet_rate_over_limit": {"min": round(rates[0] / float(rate), 4),
                                  "median": round(rates[len(rates) // 2] / float(rate), 4),
                                  "max": round(rates[-1] / float(rate), 4)},
        "worst_window_over_bound": {k: round(v, 4) for k, v in ratios.items()},
        # (with --ceiling / --prompt-rate, over the sampled users)
        "budgets": kinds,
    }


if __name__ == "__main__":
    raise SystemExit(main())
