"""An engine cut off from the store told apart from a dead one (``partition``):
the lease script against a real ``redis-server`` and a real three-shard
Redis Cluster (its alive channels, ``NUMSUB`` / ``SHARDNUMSUB`` from the
script), then fleets on a fake clock with one engine cut off by the fault
proxy (``tools.reliability.fault_proxy``: its traffic dropped, its
connections held): the cut-off engine spends only the share the store keeps
for it and stops once the partition window ``P`` has passed, the others get
the rest, and the fleet bound holds in every window, for each kind of
budget (a user's rate, ceiling and prompt budget); vLLM's own schedulers
on one fake clock through the same partition (the rate, and lending within
a ceiling)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from vllm_output_rate.cluster_store import ClusterStore, user_key
from vllm_output_rate.lease_store import LIVE_S, SILENT_S, LeaseAsk, RedisStore, silent_window_s
from vllm_output_rate.limiter import NS_PER_S
from vllm_output_rate.shared_settings import SharedStateError, parse_shared_state
from vllm_output_rate.tools.fleet_sim import T0_NS, Fleet, worst_window_excess
from vllm_output_rate.tools.redis_server import RedisCluster, RedisServer, redis_server_binary
from vllm_output_rate.tools.reliability.fault_proxy import FaultProxy

from stores import fresh_cluster, fresh_store

pytestmark = pytest.mark.skipif(redis_server_binary() is None,
                                reason="redis-server not installed (make tools installs it)")

S = NS_PER_S


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


def proxied_client(proxy: FaultProxy, timeout_s: float):
    """A client through the proxy whose calls give up after ``timeout_s``
    (real time: the fleet's clock is a fake one)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=timeout_s,
                       socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
                       health_check_interval=0)


def test_the_partition_window_is_a_setting_with_a_floor():
    assert parse_shared_state("redis://h:1").partition_s == 30.0
    assert parse_shared_state("redis://h:1?partition_ms=5000").partition_s == 5.0
    with pytest.raises(SharedStateError, match="partition_ms .* must be at least 2000"):
        parse_shared_state("redis://h:1?partition_ms=1500")


# -- the lease script: cut off or dead ---------------------------------------------------


def _lease(store, engine, users, now_us, divisor=2, want=100):
    asks = [LeaseAsk(u, Fraction(20), want) for u in users]
    plan = store.plan(asks, 0)
    replies = store.lease_shards(engine, plan, {}, now_us=now_us,
                                 divisors={u: divisor for u in users})
    return {u: g for r in replies.values() for u, g in r.granted.items()}


@pytest.mark.parametrize("form", ["one store", "cluster"])
def test_a_silent_engine_with_its_subscription_keeps_its_share_one_without_is_dead(
        form, redis_server, request):
    """e1 and e2 lease user "u" (e1 told the store its fallback divisor is
    2); e1 falls silent (no call for longer than its silent window, at
    most SILENT_S). While its alive
    channel stands, e2 is granted the half e1 does not hold (10 tok/s: 0.5 s
    of lookahead at 10 tok/s, from a TAT in the past, is 2 slots + 1) and
    still sees two engines sharing; once e1's subscription is gone (killed:
    its kernel closed the socket) it is dead: e2 gets the whole limit and
    sees one. Past e1's partition window the share is released too."""
    base = fresh_store(redis_server) if form == "one store" else request.getfixturevalue("cluster_url")
    settings = parse_shared_state(base + "?partition_ms=5000&timeout_ms=5000")
    make = (lambda: RedisStore(settings)) if form == "one store" else (lambda: ClusterStore(settings))
    e1, e2, e3 = make(), make(), make()
    t = 1e15
    assert _lease(e1, "e1", ["u", "v"], t)["u"][0] > 0
    _lease(e2, "e2", ["u"], t)
    _lease(e3, "e3", ["v"], t)
    t += (SILENT_S + 0.2) * 1e6  # e1 silent, subscribed
    assert all(a.state == "up" for a in (e1.alive.values() if form == "cluster" else [e1.alive]))
    got, sharing = _lease(e2, "e2", ["u"], t, want=1000)["u"]
    assert sharing == 2
    assert got == 3  # floor(0.25 s / 0.1 s) + 1: slots of 1/10 s, the rest of the limit
    # past the partition window (5 s after e1's last call): released
    got_v, sharing_v = _lease(e3, "e3", ["v"], t + 5.1e6, want=1000)["v"]
    assert sharing_v == 1 and got_v >= 6
    # e1 killed: its subscription is gone, so it is dead now
    e1.drop_alive()
    import time

    time.sleep(0.05)  # (the store reads the closed socket)
    got, sharing = _lease(e2, "e2", ["u"], t + 0.5e6, want=1000)["u"]
    assert sharing == 1 and got >= 3
    for store in (e1, e2, e3):
        store.drop_alive()


@pytest.fixture(scope="module")
def cluster():
    with RedisCluster(shards=3) as c:
        yield c


@pytest.fixture
def cluster_url(cluster):
    return fresh_cluster(cluster)


def test_the_alive_channel_of_a_cluster_is_sharded_on_the_shard_of_its_heartbeat(cluster_url):
    store = ClusterStore(parse_shared_state(cluster_url + "?timeout_ms=5000"))
    users = [f"user-{i}" for i in range(12)]
    _lease(store, "e1", users, 1e15)
    assert len(store.alive) == 3 and all(a.state == "up" and a.sharded for a in store.alive.values())
    import redis

    for shard, alive in store.alive.items():
        host, port = store.masters[shard]
        node = redis.Redis(host=host, port=port)
        assert node.execute_command("PUBSUB", "SHARDNUMSUB", alive.channel)[1] == 1
        assert alive.channel.startswith(f"output_rate:shard:{{{store._tags[shard]}}}:engines:alive:")
        node.close()
    store.close()


# -- a fleet on a fake clock, one engine cut off by the proxy -----------------------------


def spent(spends, lo, hi):
    return sum(n for t, n in spends if lo <= t < hi)


def test_a_cut_off_engine_spends_only_its_reserved_share_and_stops_after_p(redis_server):
    """Two engines serve user "u" (limit 20, three streams each); b's
    connections go through the fault proxy, which drops everything 2 s in
    (b's calls time out; its subscription stands at the store, the proxy
    holding it) and heals at 11 s. P = 6 s.

    Without the change the store gave b's share to a once b was silent for
    the liveness window, while b spent its fallback share: 30 tok/s on a 20
    tok/s limit. Now: b spends nothing unleased until the store must have
    seen it silent, then its fallback share (10) while the store keeps it
    reserved (a gets the other 10), nothing once P has passed since its
    last answered call (a gets all 20), and after the heal they share
    again. The fleet bound holds in every window."""
    url = fresh_store(redis_server)
    settings = parse_shared_state(url + "?partition_ms=6000")
    fleet = Fleet(url, Fraction(20), settings=settings, seed=4)
    with FaultProxy("127.0.0.1", redis_server.port) as proxy:
        a = fleet.add_engine()
        b = fleet.add_engine(client=proxied_client(proxy, 0.03))
        a.streams = b.streams = {"u": 3}
        fleet.run(2.0)
        cut_ns = fleet.now_ns
        held = b.limiter.book.balance.get("u", 0)
        proxy.cut()
        fleet.run(9.0)
        b_stats_cut = b.limiter.stats()
        proxy.heal()
        fleet.run(4.0)
    A, B = a.spends["u"], b.spends["u"]
    c = cut_ns
    # b: its leases, then nothing until the store must have seen it silent
    start = c + int((settings.timeout_s + silent_window_s(settings)) * S)
    assert spent(B, c, start) <= held
    first = min(t for t, _ in B if t >= start)
    print(f"\ncut off: b's first unleased token {(first - c) / S:.2f} s after the cut; "
          f"b {spent(B, c + S, c + int(5.8 * S)) / 4.8:.2f} tok/s, "
          f"a {spent(A, c + S, c + int(5.8 * S)) / 4.8:.2f} until P; then b "
          f"{spent(B, c + int(6.1 * S), c + 9 * S) / 2.9:.2f}, a {spent(A, c + int(6.1 * S), c + 9 * S) / 2.9:.2f}")
    # then its fallback share, 20 / 2, until P after its last answered call
    lo, hi = c + S, c + int(5.8 * S)
    secs = (hi - lo) / S
    assert abs(spent(B, lo, hi) / secs - 10) <= 2 / secs, spent(B, lo, hi) / secs
    assert spent(A, lo, hi) / secs <= 10 + 2 / secs  # the rest, not b's share
    assert spent(A + B, lo, hi) / secs <= 20 + 3 / secs
    # P over: b spends nothing, a the whole limit
    lo, hi = c + int(6.1 * S), c + int(9.0 * S)
    secs = (hi - lo) / S
    assert spent(B, lo, hi) == 0
    assert spent(A, lo, hi) / secs >= 20 - 2 / secs
    # healed: shared again at the limit
    lo, hi = c + int(10.0 * S), fleet.now_ns
    secs = (hi - lo) / S
    assert spent(B, lo, hi) > 0 and 0.95 * 20 <= spent(A + B, lo, hi) / secs <= 20 + 2 / secs
    excess, window = worst_window_excess(sorted(A + B), Fraction(20), settings.horizon_s,
                                         settings.lookahead_s)
    assert excess <= 0, (excess, window)
    assert b_stats_cut["fallback"] == 1.0 and b_stats_cut["partitions"] == 1
    assert b.limiter.stats()["partitioned"] == 0.0 and b.limiter.stats()["fallback"] == 0.0
    assert a.limiter.stats()["partitions"] == 0 and a.limiter.stats()["fallback_episodes"] == 0


def test_a_cut_off_engine_stops_every_kind_of_budget_after_p(redis_server):
    """As above, with user "u"'s ceiling (60: each engine lends what its
    streams want beyond the rate) and its prompt budget (1,000 tok/s) leased
    beside its rate, each a lane of the lease thread: b spends no fallback
    share of any kind before the store must have seen it silent, then half
    of each (the divisor each lane told the store), and nothing of any
    kind once P has passed since its last answered ask (before: only its
    rate stopped; it kept lending within its ceiling and computing prompts
    at its fallback shares while a was granted the whole of each). The
    fleet bound of each kind holds in every window."""
    from vllm_output_rate.lease_store import CEILING, PROMPT

    url = fresh_store(redis_server)
    settings = parse_shared_state(url + "?partition_ms=6000")
    fleet = Fleet(url, Fraction(20), settings=settings, seed=5,
                  budgets={CEILING: (Fraction(60), {}), PROMPT: (Fraction(1000), {})})
    with FaultProxy("127.0.0.1", redis_server.port) as proxy:
        a = fleet.add_engine()
        b = fleet.add_engine(client=proxied_client(proxy, 0.03))
        for engine in (a, b):
            engine.streams, engine.prompts = {"u": 3}, {"u": 40}
        fleet.run(2.0)
        cut_ns = fleet.now_ns
        held = {kind: o.book.balance.get("u", 0) + o.unreleased.get("u", 0)
                for kind, o in b.others.items()}
        proxy.cut()
        fleet.run(9.0)
        cut_off = {kind: o.in_fallback and o._fallback.terms is not None
                   for kind, o in b.others.items()}
        proxy.heal()
        fleet.run(4.0)
    c = cut_ns
    start = c + int((settings.timeout_s + silent_window_s(settings)) * S)
    during, after = (c + S, c + int(5.8 * S)), (c + int(6.1 * S), c + int(9.0 * S))

    def per_s(spends, span):
        return spent(spends, *span) / ((span[1] - span[0]) / S)

    print("\ncut off, b per kind until P, then after P (a): " + "; ".join(
        f"{kind} {per_s(b.kind_spends[kind]['u'], during):.1f}, then "
        f"{per_s(b.kind_spends[kind]['u'], after):.1f} ({per_s(a.kind_spends[kind]['u'], after):.1f})"
        for kind in (CEILING, PROMPT)))
    for kind, limit in ((CEILING, 60), (PROMPT, 1000)):
        both = fleet.kind_spends[kind]["u"]
        A, B = a.kind_spends[kind]["u"], b.kind_spends[kind]["u"]
        # P over: nothing of any kind from b, a the whole budget
        assert spent(B, *after) == 0, kind
        assert per_s(A, after) >= 0.95 * limit, kind
        # before: its leases alone until the store must have seen it silent
        assert spent(B, c, start) <= held[kind], kind
        # then half of each (the divisor it told the store), a the rest
        assert abs(per_s(B, during) - limit / 2) <= 0.05 * limit, (kind, per_s(B, during))
        assert per_s(A + B, during) <= limit * 1.02 + 3 / 4.8, kind
        assert spent(B, c + int(10.0 * S), fleet.now_ns) > 0, kind  # healed
        excess, window = worst_window_excess(sorted(both), Fraction(limit), settings.horizon_s,
                                             settings.lookahead_s)
        assert excess <= 0, (kind, excess, window)
    assert cut_off == {CEILING: True, PROMPT: True}
    assert spent(b.spends["u"], c + int(6.1 * S), c + 9 * S) == 0


def test_a_dead_engine_gives_its_share_back_within_the_silent_window_a_cut_off_one_keeps_it(
        redis_server):
    """Three engines share "u": c is cut off by the proxy, b killed whole
    (its alive channel closed, as its kernel would). Within its silent
    window (0.25 s: it calls every tick) and a
    tick the store counts b out (a sees two engines sharing: itself and the
    cut-off c), well within the liveness window plus a tick."""
    url = fresh_store(redis_server)
    settings = parse_shared_state(url + "?partition_ms=10000")
    fleet = Fleet(url, Fraction(30), settings=settings, seed=8)
    with FaultProxy("127.0.0.1", redis_server.port) as proxy:
        a, b = fleet.add_engine(), fleet.add_engine()
        c = fleet.add_engine(client=proxied_client(proxy, 0.03))
        a.streams = b.streams = c.streams = {"u": 3}
        fleet.run(1.0)
        assert a.limiter.thread.sharing["u"] == 3
        proxy.cut()
        fleet.kill(b)
        silent = silent_window_s(settings)
        fleet.run(silent + 2 * settings.tick_s + 0.05)
        assert a.limiter.thread.sharing["u"] == 2  # b out, c still counted
        assert silent + 2 * settings.tick_s < LIVE_S + settings.tick_s
        fleet.run(3.0)
        assert a.limiter.thread.sharing["u"] == 2
        # a: 2/3 of the limit (c keeps its 1/3: the divisor it told the store)
        t = fleet.now_ns
        assert abs(spent(a.spends["u"], t - 2 * S, t) / 2 - 20) <= 1.5
        proxy.heal()


# -- vLLM's own schedulers on one fake clock ---------------------------------------------

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


@pytest.mark.parametrize("is_async", MODES)
def test_two_real_schedulers_through_a_partition_on_one_clock(redis_server, is_async, monkeypatch):
    """vLLM's Scheduler / AsyncScheduler and KV cache manager, two of them
    on one fake clock, user-a (20 tok/s) with two streams on each; engine
    1 reaches the store through the fault proxy, which drops its traffic 2 s
    in and heals 7 s later (P = 4 s). Engine 1 spends its fallback share
    (10) while the store keeps it, nothing once P has passed; engine 0 the
    rest, then the whole limit; the fleet bound holds in every window, and
    the counters say which engine was cut off."""
    from harness import VirtualClock, run_shared, shared_schedulers
    from vllm_output_rate.ledger import OutputRateState

    url = fresh_store(redis_server)
    monkeypatch.setattr(OutputRateState, "watch_thread", False)
    clock = VirtualClock()
    with FaultProxy("127.0.0.1", redis_server.port) as proxy:
        drivers = shared_schedulers(
            [url + "?timeout_ms=5000&partition_ms=4000",
             # (its calls through the cut give up after 100 ms, real time)
             proxy.redis_url() + "?timeout_ms=100&partition_ms=4000"], clock, is_async)
        t0 = clock()
        cut_stats = {}

        def partition(i, now):
            if now == t0 + 2 * S:
                proxy.cut()
            if now == t0 + 9 * S:
                cut_stats.update(drivers[1].scheduler.output_rate.limiter.stats())
                proxy.heal()

        spends = run_shared(drivers, clock, 1200, partition)  # 12 s at 10 ms
        c = t0 + 2 * S
        lo, hi = c + int(1.5 * S), c + int(3.8 * S)
        secs = (hi - lo) / S
        assert abs(spent(spends[1], lo, hi) / secs - 10) <= 2 / secs, spent(spends[1], lo, hi) / secs
        assert spent(spends[0], lo, hi) / secs <= 10 + 2 / secs
        lo, hi = c + int(4.1 * S), c + 7 * S
        secs = (hi - lo) / S
        assert spent(spends[1], lo, hi) == 0
        assert spent(spends[0], lo, hi) / secs >= 20 - 2 / secs
        lo, hi = c + 8 * S, clock()
        secs = (hi - lo) / S
        assert spent(spends[1], lo, hi) > 0
        assert 0.95 * 20 <= spent(spends[0] + spends[1], lo, hi) / secs <= 20 + 2 / secs
        excess, window = worst_window_excess(sorted(spends[0] + spends[1]), Fraction(20), 0.5, 0.25)
        assert excess <= 0, (excess, window)
        assert cut_stats["partitioned"] == 1.0 and cut_stats["partitions"] == 1
        assert drivers[0].scheduler.output_rate.limiter.stats()["fallback_episodes"] == 0
        for drv in drivers:
            drv.scheduler.output_rate.limiter.thread.store.drop_alive()
            drv.scheduler.shutdown()


@pytest.mark.parametrize("is_async", MODES)
def test_two_real_schedulers_lend_nothing_past_p_when_cut_off(redis_server, is_async, monkeypatch,
                                                              tmp_path):
    """As above with user-a in a tier ``{rate: 20, ceiling: 60}`` and
    nothing else to run: each engine lends its idle capacity within the
    ceiling's leases (the ceiling's lane of the lease thread). Engine 1 cut
    off 2 s in (P = 4 s): it serves half the ceiling (its guaranteed and
    lent tokens together) while the store keeps that reserved, and nothing
    once P has passed (before, it kept lending at its fallback share of the
    ceiling); engine 0 the whole ceiling then; the ceiling's bound holds in
    every window."""
    from harness import Driver, VirtualClock, make_request, make_scheduler
    from vllm_output_rate.config import load_limits_file
    from vllm_output_rate.ledger import OutputRateState

    url = fresh_store(redis_server)
    monkeypatch.setattr(OutputRateState, "watch_thread", False)
    clock = VirtualClock()
    path = tmp_path / "limits.yaml"
    path.write_text("default: 1000\ntiers: {gold: {rate: 20, ceiling: 60}}\nusers: {user-a: gold}\n")
    limits = load_limits_file(str(path)).to_dict()
    with FaultProxy("127.0.0.1", redis_server.port) as proxy:
        drivers = []
        for at in (url + "?timeout_ms=5000&partition_ms=4000",
                   proxy.redis_url() + "?timeout_ms=100&partition_ms=4000"):
            sched = make_scheduler({**limits, "shared_state": at}, clock=clock,
                                   async_scheduling=is_async)
            drivers.append(Driver(sched, None, is_async=is_async))
            for _ in range(2):
                sched.add_request(make_request("user-a", max_tokens=5000))
        t0 = clock()
        spends: list[list[tuple[int, int]]] = [[], []]
        for i in range(1000):  # 10 s at 10 ms
            now = clock()
            if now == t0 + 2 * S:
                proxy.cut()
            for k, drv in enumerate(drivers):
                limiter = drv.scheduler.output_rate.limiter
                if i % 5 == 0 or limiter.starved or any(o.starved for o in limiter.others.values()):
                    limiter.thread.tick(now_us=now / 1000)
                drv.step()
                last = drv.scheduler.output_rate.last_step
                n = sum(1 for u in (*last.charged.values(), *last.borrowed.values()) if u == "user-a")
                if n:
                    spends[k].append((now, n))
            clock.advance_ms(10)
        c = t0 + 2 * S
        lo, hi = c + int(1.5 * S), c + int(3.8 * S)
        secs = (hi - lo) / S
        print(f"\ncut off, ceiling 60: engine 1 {spent(spends[1], lo, hi) / secs:.1f} tok/s until P, "
              f"then {spent(spends[1], c + int(4.1 * S), c + 8 * S)} tokens; engine 0 "
              f"{spent(spends[0], c + int(4.1 * S), c + 8 * S) / 3.9:.1f} tok/s")
        assert abs(spent(spends[1], lo, hi) / secs - 30) <= 3 + 2 / secs, spent(spends[1], lo, hi) / secs
        lo, hi = c + int(4.1 * S), c + 8 * S
        assert spent(spends[1], lo, hi) == 0
        assert spent(spends[0], lo, hi) / ((hi - lo) / S) >= 0.9 * 60
        excess, window = worst_window_excess(sorted(spends[0] + spends[1]), Fraction(60), 0.5, 0.25)
        assert excess <= 0, (excess, window)
        proxy.heal()
        for drv in drivers:
            drv.scheduler.output_rate.limiter.thread.store.drop_alive()
            drv.scheduler.shutdown()
