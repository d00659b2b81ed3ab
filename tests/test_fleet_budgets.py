"""A user's ceiling and prompt budget across a fleet (shared budgets): each a
fleet-wide budget of its own, leased beside the user's rate in the same call
(a budget kind in the lease protocol, ``lease_store.KIND_KEYS``; a lane of
the lease thread, ``lease_lane``). The pure parts (the keys of a user's
budgets on one slot, the prompt budgets' grants settled once a step), the
store's script with three kinds in one call, random fleets on a fake clock
against a real ``redis-server`` (the bound of each kind in every window,
brute force), the store and a cluster shard restarted empty (no burst), and
vLLM's own schedulers sharing a real store: lending within a fleet-wide
ceiling (tiers, a live change, a Redis Cluster) and a fleet-wide prompt
budget (unlisted users sharing one, prefix-cache hits free)."""

from __future__ import annotations

import os
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.cluster_store import user_key
from vllm_output_rate.config import OutputRateConfig
from vllm_output_rate.fleet_math import LeaseSizer, fleet_bound
from vllm_output_rate.lease_store import CEILING, KIND_KEYS, PROMPT, RATE, LeaseAsk, RedisStore, budget_key
from vllm_output_rate.limiter import NS_PER_S, OutputRateLimiter
from vllm_output_rate.prompt_budget import PromptBudgets
from vllm_output_rate.shared_settings import SharedStateSettings, parse_shared_state
from vllm_output_rate.tools.fleet_sim import T0_NS, Fleet, worst_window_excess
from vllm_output_rate.tools.redis_server import redis_server_binary

# (the fixtures and helpers of the modules beside: one Redis, one cluster)
from test_cluster_store import cluster, url  # noqa: F401
from test_long_slices import fresh, redis_server  # noqa: F401

needs_redis = pytest.mark.skipif(redis_server_binary() is None,
                                 reason="redis-server not installed (make tools installs it)")
MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


def cluster_url(request: pytest.FixtureRequest) -> str:
    """A fresh three-shard cluster's URL (``test_cluster_store``'s fixtures:
    one cluster for this module, its nodes back and empty)."""
    return request.getfixturevalue("url").split("?", 1)[0]


# -- pure -----------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=12))
def test_a_users_budgets_are_keys_of_their_own_on_its_slot(user):
    """Every budget of a user is on the slot of its rate (one script call per
    shard touches them all), each a key of its own; an id that would make
    an empty hash tag (empty, or starting with ``}``) included."""
    from redis.crc import key_slot

    keys = [user_key(user, kind) for kind in KIND_KEYS]
    assert len({key_slot(k.encode()) for k in keys}) == 1, keys
    assert len(set(keys)) == len(KIND_KEYS)
    assert len({budget_key(user, kind) for kind in KIND_KEYS}) == len(KIND_KEYS)
    assert user_key(user) == user_key(user, RATE)  # a rate's key as before


def test_a_lane_asks_under_its_kind_and_a_reply_names_the_budget():
    sizer = LeaseSizer(SharedStateSettings("redis://x:1"), CEILING)
    asks = sizer.asks(T0_NS, {"u": 3}, {"u"}, {}, {}, {}, {}, lambda u: Fraction(60))
    assert [(a.user, a.kind, a.budget) for a in asks] == [("u", CEILING, (CEILING, "u"))]
    assert LeaseAsk("u", Fraction(5), 1).budget == "u"  # a rate: the user, as before


def test_a_user_out_of_its_fleet_wide_ceiling_waits_for_it_and_says_so():
    """A token needs the ceiling's lease too: the engine loop's wake time for
    a refused user is the later of its rate's and its ceiling's (the
    ceiling's a round trip away once the lease thread hears it ran short);
    an unlimited ceiling, and an engine's own ceilings, add nothing. A
    prompt budget out of leases says so too; each lane leaves the thread
    when its budgets stop (reloaded limits)."""
    from vllm_output_rate.borrowing import NO_CEILING, Lender
    from vllm_output_rate.config import UNLIMITED
    from vllm_output_rate.shared_limiter import SharedBudgetLimiter

    now = [T0_NS]
    rates = SharedBudgetLimiter(Fraction(20), {}, SharedStateSettings("redis://x:1"),
                                clock=lambda: now[0], start_thread=False)
    config = OutputRateConfig(Fraction(20), {"free": Fraction(5)}, ceilings={"free": UNLIMITED},
                              default_ceiling=Fraction(60))
    lender = Lender(config, lambda d, r: rates.second_budget(CEILING, d, r))
    rates.begin_step(now[0])
    assert lender.available("a", now[0]) == 0  # no lease of its ceiling yet ...
    assert list(lender.ceilings.starved) == ["a"]  # ... and the lease thread is told
    assert lender.ready_at_ns("a") > now[0]
    assert lender.available("free", now[0]) == NO_CEILING and lender.ready_at_ns("free") == 0
    assert Lender(config).ready_at_ns("a") == 0
    prompts = PromptBudgets(OutputRateConfig(Fraction(20), default_prompt_rate=Fraction(500)),
                            make=lambda d, r: rates.second_budget(PROMPT, d, r))
    assert prompts.grant("a", now[0], 300) == 0  # no lease of its prompt budget yet
    assert list(rates.others[PROMPT].starved) == ["a"]
    rates.thread._take_lane_changes()
    assert rates.thread.lanes.keys() == {RATE, CEILING, PROMPT}
    lender.close()  # borrowing stops: the lane leaves at the thread's next round
    prompts.close()  # and prompt budgets
    rates.thread._take_lane_changes()
    assert rates.thread.lanes.keys() == {RATE} and not rates.others


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from(["grant", "whole", "refund"]),
                                   st.sampled_from(["a", "b"]), st.integers(0, 900)),
                         max_size=6),
                min_size=1, max_size=12),
       st.lists(st.integers(0, 400), min_size=12, max_size=12))
def test_prompt_grants_settled_once_a_step_are_charging_each_at_once(steps, gaps_ms):
    """Oracle: the plain limiter charged and refunded at each grant (the
    prompt budgets before they settled once a step, which a fleet-wide
    budget needs: its leases are spent once, net)."""
    config = OutputRateConfig(Fraction(20), default_prompt_rate=Fraction(500))
    budgets, oracle = PromptBudgets(config), OutputRateLimiter(Fraction(500))
    now = T0_NS
    for ops, gap in zip(steps, gaps_ms):
        now += gap * 1_000_000
        granted: dict[str, int] = {}
        for op, user, n in ops:
            if op == "grant":
                want = min(n, oracle.available(user, now))
                assert budgets.grant(user, now, n) == want
                oracle.take(user, now, want)
                granted[user] = granted.get(user, 0) + want
            elif op == "whole":
                ok = n <= 0 or oracle.available(user, now) >= 1  # (nothing: granted)
                assert budgets.grant_whole(user, now, n) is ok
                if ok and n > 0:
                    oracle.take(user, now, n)
                    granted[user] = granted.get(user, 0) + n
            elif granted.get(user):
                back = min(n, granted[user])
                budgets.refund(user, back)
                oracle.refund(user, back)
                granted[user] -= back
            assert budgets.available(user, now) == oracle.available(user, now)
        budgets.settle(now)
        for user in ("a", "b"):  # (a user without state is ready: 0)
            assert max(budgets.ready_at_ns(user), now) == max(oracle.ready_at_ns(user), now)


def test_prompt_budgets_with_shared_budgets_and_no_chunked_prefill_are_refused_at_start_up():
    """Before the engine core loads a model (the plugin's checks), naming the
    options; with chunked prefill (vLLM's default) they are taken."""
    from harness import make_vllm_config
    from vllm_output_rate.config import OutputRateConfigError
    from vllm_output_rate.plugin import configure_output_rate

    limits = {"default_user_output_tokens_per_second": 20, "default_prompt_rate": "500",
              "shared_state": "redis://127.0.0.1:1/0"}
    with pytest.raises(OutputRateConfigError,
                       match="--output-rate-shared-state: prompt budgets .* need chunked prefill"):
        make_vllm_config(limits, enable_chunked_prefill=False)
    configure_output_rate(make_vllm_config(limits))


# -- the store: three kinds in one call ------------------------------------------------


@needs_redis
def test_one_call_leases_a_users_rate_ceiling_and_prompt_budget_as_three_gcras(redis_server):
    import redis

    store = RedisStore(parse_shared_state(fresh(redis_server)))
    now = 1e15
    asks = [LeaseAsk("a", Fraction(20), 100), LeaseAsk("a", Fraction(60), 100, kind=CEILING),
            LeaseAsk("a", Fraction(1000), 10_000, kind=PROMPT)]
    reply = store.lease("e1", asks, "", now_us=now)
    assert store.calls == 1
    # slots starting within the 250 ms lookahead, each at its own rate (the
    # ceiling's 16th slot starts at 250 ms exactly: 15 slots of 16666.67 us
    # in floating point end just short of it, so it comes in the next call)
    assert reply.granted == {"a": (6, 1), (CEILING, "a"): (15, 1), (PROMPT, "a"): (251, 1)}
    client = redis.Redis.from_url(redis_server.url)
    assert {k.decode() for k in client.keys("output_rate:*:a")} == {
        "output_rate:user:a", "output_rate:ceiling:a", "output_rate:prompt:a"}
    # a second engine: each budget spent for now (its lookahead's worth
    # granted over both calls: floor(250 ms / slot) + 1), each shared by two
    again = store.lease("e2", asks, reply.epoch, now_us=now)
    assert again.granted == {"a": (0, 2), (CEILING, "a"): (1, 2), (PROMPT, "a"): (0, 2)}
    assert store.leave("e2", ["a"], tuple(KIND_KEYS)) == 3 * 4  # e:, s:, w:, r: of each kind
    client.close()


# -- random fleets on a fake clock -------------------------------------------------------


def budgets_fleet(at: str, settings_: SharedStateSettings | None = None, seed: int = 0,
                  rate: Fraction = Fraction(20), ceiling: Fraction = Fraction(60),
                  prompt: Fraction = Fraction(1000), step_s: float = 0.01) -> Fleet:
    return Fleet(at, rate, settings=settings_, seed=seed, step_s=step_s,
                 budgets={CEILING: (ceiling, {}), PROMPT: (prompt, {})})


def check_kinds(fleet: Fleet, user: str, window_from_ns: int = 0) -> None:
    """The fleet bound of each of ``user``'s budgets, every window (brute force)."""
    s = fleet.settings
    for kind, spends, rate in ((RATE, fleet.spends.get(user, []), fleet.rate_of(user)),
                               *((k, fleet.kind_spends[k].get(user, []), fleet.budgets[k][0])
                                 for k in fleet.budgets)):
        excess, window = worst_window_excess(sorted(spends), rate, s.horizon_s, s.lookahead_s)
        assert excess <= 0, f"{user} {kind}: {excess} above the fleet bound in a {window:.3f} s window"


@needs_redis
@settings(max_examples=10, deadline=None)
@given(st.data())
def test_each_budget_keeps_its_fleet_bound_for_random_demands_joins_and_leaves(redis_server, data):
    at = fresh(redis_server)
    settings_ = SharedStateSettings(at, tick_s=data.draw(st.sampled_from([0.02, 0.05])),
                                    horizon_s=data.draw(st.sampled_from([0.2, 0.5])),
                                    lookahead_s=data.draw(st.sampled_from([0.05, 0.25])))
    fleet = budgets_fleet(at, settings_, seed=data.draw(st.integers(0, 1000)),
                          ceiling=data.draw(st.sampled_from([Fraction(20), Fraction(45)])),
                          prompt=data.draw(st.sampled_from([Fraction(300), Fraction(2000)])),
                          step_s=data.draw(st.sampled_from([0.005, 0.01, 0.03])))
    engines = [fleet.add_engine() for _ in range(data.draw(st.integers(1, 3)))]
    plan = data.draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, len(engines) - 1),
                                        st.integers(0, 4)), min_size=1, max_size=6))
    t = 0
    for second, i, streams in sorted(plan):
        fleet.run(second - t)
        t = second
        engine = engines[i]
        if streams == 0 and data.draw(st.booleans()):
            if data.draw(st.booleans()):
                fleet.kill(engine)  # dies holding leases of every kind
            else:
                fleet.leave(engine)  # shuts down: off every budget it leased
        else:
            engine.alive = True
            engine.streams = {"u": streams}
            engine.prompts = {"u": 150 * streams}
    fleet.run(4 - t)
    check_kinds(fleet, "u")


@needs_redis
def test_the_store_restarted_empty_no_burst_of_any_kind(redis_server):
    """Three engines lending user "u" (rate 20, ceiling 60) and computing
    its prompts (1,000 a second) through a store stopped 2 s in and started
    again empty 2 s later: serving never stops (fallback shares of each
    budget), every budget back at its rate after it, and the bound of each
    kind holds across the outage and the reset."""
    at = fresh(redis_server)
    fleet = budgets_fleet(at, SharedStateSettings(at, timeout_s=1.0), seed=4)
    for _ in range(3):
        engine = fleet.add_engine()
        engine.streams, engine.prompts = {"u": 2}, {"u": 300}
    s = NS_PER_S
    fleet.run(2.0)
    redis_server.stop()
    try:
        fleet.run(2.0)
    finally:
        redis_server.start()  # back, and empty
    fleet.run(4.0)
    ceiled, prompts = fleet.kind_spends[CEILING]["u"], fleet.kind_spends[PROMPT]["u"]
    for second in range(8):
        lo, hi = T0_NS + second * s, T0_NS + (second + 1) * s
        assert sum(n for t, n in ceiled if lo <= t < hi) > 0, second
        assert sum(n for t, n in prompts if lo <= t < hi) > 0, second
    after = T0_NS + 5 * s
    assert sum(n for t, n in ceiled if t >= after) / 3.0 >= 0.95 * 60
    assert sum(n for t, n in prompts if t >= after) / 3.0 >= 0.95 * 1000
    for engine in fleet.engines:
        stats = engine.limiter.stats()
        assert stats["fallback_episodes"] == 1 and stats["fallback"] == 0.0
        assert all(o.book.spent > 0 and not o.in_fallback for o in engine.others.values())
    check_kinds(fleet, "u")


@needs_redis
def test_a_budget_that_starts_during_an_outage_starts_in_fallback(redis_server):
    """Reloaded limits give users ceilings while the store is down: the new
    lane starts in fallback (its users' ceilings divided by the engines last
    seen), and the rates' fallback goes on as it was (no fresh burst)."""
    at = fresh(redis_server)
    fleet = Fleet(at, Fraction(20), settings=SharedStateSettings(at, timeout_s=1.0), seed=8)
    a, b = fleet.add_engine(), fleet.add_engine()
    a.streams = b.streams = {"u": 2}
    fleet.run(1.0)
    redis_server.stop()
    try:
        fleet.run(1.0)
        assert a.limiter.in_fallback
        before = a.limiter._fallback
        ceiling = a.limiter.second_budget(CEILING, Fraction(60), {})
        fleet.run(0.2)
        assert ceiling.in_fallback and a.limiter._fallback is before
        assert ceiling.rate_of("u") == 60 and ceiling._fallback.rate_of("u") == 30
    finally:
        redis_server.start()
    fleet.run(2.0)
    assert not ceiling.in_fallback and not a.limiter.in_fallback


@needs_redis
def test_a_cluster_shard_restarted_empty_resets_every_budget_of_its_users(request, cluster):
    """Over a three-shard cluster: the shard of "u" killed and restarted
    empty; every budget of "u" (its keys on that shard's slot) falls back,
    resets and reports together; the bound of each kind holds across."""
    at = cluster_url(request)
    settings_ = SharedStateSettings(at, timeout_s=1.0, nodes=parse_shared_state(at).nodes)
    fleet = budgets_fleet(at, settings_, seed=6)
    for _ in range(2):
        engine = fleet.add_engine()
        engine.streams, engine.prompts = {"u": 2}, {"u": 300}
    fleet.run(1.0)
    store = fleet.engines[0].limiter.thread.store
    shard = store.shard_of("u")
    node = [n.port for n in cluster.nodes].index(store.masters[shard][1])
    cluster.kill(node)
    try:
        fleet.run(2.0)
        for engine in fleet.engines:
            assert engine.limiter.in_fallback
            assert all(o.in_fallback for o in engine.others.values())
    finally:
        cluster.restart_empty(node)
    fleet.run(3.0)
    for engine in fleet.engines:
        assert engine.limiter.stats()["resets"] == 1
        assert not any(o.in_fallback for o in engine.others.values())
    check_kinds(fleet, "u")
    ceiled = fleet.kind_spends[CEILING]["u"]
    assert sum(n for t, n in ceiled if t >= T0_NS + 4 * NS_PER_S) / 2.0 >= 0.95 * 60


# -- vLLM's own schedulers sharing a real store ----------------------------------------


def tick_due(limiter, i: int) -> bool:
    """A lease round is due: every 5 steps, or a budget of any kind ran short."""
    return i % 5 == 0 or bool(limiter.starved) or any(o.starved for o in limiter.others.values())


def write(path, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


@needs_redis
@pytest.mark.parametrize("store", ["redis", "cluster"])
@pytest.mark.parametrize("is_async", MODES)
def test_real_schedulers_lend_within_a_fleet_wide_ceiling(request, redis_server, tmp_path,
                                                         monkeypatch, store, is_async):
    """Two of vLLM's own schedulers on one fake clock, each with two
    streams of user-a (tier gold: rate 20, ceiling 60) and nothing else to
    run: each lends its idle capacity, within the ceiling's tokens it holds.
    The fleet serves user-a at its ceiling, not twice it, and the ceiling's
    bound holds in every window; then the limits file changes live: user-a
    plain at 20 (borrowing stops, the lane leaves), then gold at a ceiling
    of 40 (a new lane)."""
    from harness import Driver, VirtualClock, make_request, make_scheduler
    from vllm_output_rate.config import load_limits_file
    from vllm_output_rate.ledger import OutputRateState

    monkeypatch.setattr(OutputRateState, "watch_thread", False)
    at = fresh(redis_server) if store == "redis" else cluster_url(request)
    path = tmp_path / "limits.yaml"
    gold = "default: 1000\ntiers: {gold: {rate: 20, ceiling: %d}}\nusers: {user-a: gold}\n"
    write(path, gold % 60)
    limits = {**load_limits_file(str(path)).to_dict(), "shared_state": at + "?timeout_ms=5000"}
    clock = VirtualClock()
    drivers = []
    for _ in range(2):
        sched = make_scheduler(limits, clock=clock, async_scheduling=is_async)
        drivers.append(Driver(sched, None, is_async=is_async))
        for _ in range(2):
            sched.add_request(make_request("user-a", max_tokens=5000))
    spends: list[tuple[int, int]] = []
    lent = [0, 0]
    i = 0

    def run(steps: int) -> tuple[int, int]:
        nonlocal i
        start = clock()
        for _ in range(steps):
            now = clock()
            for k, drv in enumerate(drivers):
                limiter = drv.scheduler.output_rate.limiter
                if tick_due(limiter, i):
                    limiter.thread.tick(now_us=now / 1000)
                drv.step()
                last = drv.scheduler.output_rate.last_step
                borrowed = sum(1 for u in last.borrowed.values() if u == "user-a")
                lent[k] += borrowed
                n = borrowed + sum(1 for u in last.charged.values() if u == "user-a")
                if n:
                    spends.append((now, n))
            clock.advance_ms(10)
            i += 1
        return start, clock()

    def rate_in(lo: int, hi: int) -> float:
        return sum(n for t, n in spends if lo <= t < hi) / ((hi - lo) / NS_PER_S)

    def reload(text: str) -> None:
        write(path, text)
        for drv in drivers:
            assert drv.scheduler.output_rate.watcher.check() == "loaded"

    s = parse_shared_state(at)
    start, end = run(600)  # 6 s
    assert 0.95 * 60 <= rate_in(start + 2 * NS_PER_S, end) <= 60 * 1.05, rate_in(start + 2 * NS_PER_S, end)
    excess, window = worst_window_excess(spends, Fraction(60), s.horizon_s, s.lookahead_s)
    assert excess <= 0, (excess, window)
    assert min(lent) > 0  # both engines lent their own idle capacity
    for drv in drivers:
        limiter = drv.scheduler.output_rate.limiter
        assert limiter.others[CEILING].book.spent > 0 and limiter.thread.lanes.keys() == {RATE, CEILING}
    reload("default: 1000\nusers: {user-a: 20}\n")
    start, end = run(400)
    plain = [(t, n) for t, n in spends if t >= start]
    assert 0.95 * 20 <= rate_in(start + 2 * NS_PER_S, end) <= 21
    excess, _ = worst_window_excess(plain, Fraction(20), s.horizon_s, s.lookahead_s,
                                    extra=fleet_bound(0, 60, s.horizon_s, s.lookahead_s))
    assert excess <= 0
    for drv in drivers:
        limiter = drv.scheduler.output_rate.limiter
        assert drv.scheduler.output_rate.lender is None and not limiter.others
        assert limiter.thread.lanes.keys() == {RATE}  # the ceiling's lane left
    reload(gold % 40)
    start, end = run(500)
    assert 0.95 * 40 <= rate_in(start + 2 * NS_PER_S, end) <= 42
    late = [(t, n) for t, n in spends if t >= start + 2 * NS_PER_S]
    excess, window = worst_window_excess(late, Fraction(40), s.horizon_s, s.lookahead_s)
    assert excess <= 0, (excess, window)
    for drv in drivers:
        drv.scheduler.shutdown()


@needs_redis
@pytest.mark.parametrize("is_async", MODES)
def test_real_schedulers_keep_a_fleet_wide_prompt_budget(redis_server, monkeypatch, is_async):
    """Two of vLLM's own schedulers (chunked prefill, prefix caching) on
    one fake clock; unlisted users sharing one budget (``unlisted_users:
    shared``, default prompt_rate 2,000): requests of four unlisted ids,
    400-token prompts whose first 256 tokens are one shared prefix. The
    fleet computes their prompts at the budget and within its bound in
    every window; prefix-cache hits are free (the leases spent are the
    tokens computed, fewer than the prompts' tokens)."""
    from harness import Driver, VirtualClock, make_request, make_scheduler
    from vllm_output_rate.ledger import OutputRateState

    monkeypatch.setattr(OutputRateState, "watch_thread", False)
    at = fresh(redis_server)
    limits = {"default_user_output_tokens_per_second": 1000, "unlisted_users": "shared",
              "default_prompt_rate": "2000",
              "shared_state": at + "?timeout_ms=5000"}
    clock = VirtualClock()
    prefix = [(7 * j) % 900 + 20 for j in range(256)]
    drivers, prompt_tokens = [], 0
    for k in range(2):
        sched = make_scheduler(limits, clock=clock, async_scheduling=is_async)
        drivers.append(Driver(sched, None, is_async=is_async))
        for r in range(40):
            tail = [(r * 13 + k * 7 + j) % 900 + 20 for j in range(144)]
            sched.add_request(make_request(f"x-{r % 4}", prompt=prefix + tail, max_tokens=2))
            prompt_tokens += 400
    computed: list[tuple[int, int]] = []
    per_request: dict[str, list[int]] = {}  # req_id -> [tokens computed, prefill done]
    for i in range(600):  # 6 s
        now = clock()
        for drv in drivers:
            limiter = drv.scheduler.output_rate.limiter
            if tick_due(limiter, i):
                limiter.thread.tick(now_us=now / 1000)
            drv.step()
            chunks = drv.scheduler.output_rate.last_step.prompt_chunks
            n = sum(work for user, work, _ in chunks.values() if user == "__unlisted__")
            for req_id, (_, work, done) in chunks.items():
                seen = per_request.setdefault(req_id, [0, 0])
                seen[0] += work
                seen[1] |= done
            if n:
                computed.append((now, n))
        clock.advance_ms(10)
    s = parse_shared_state(at)
    excess, window = worst_window_excess(computed, Fraction(2000), s.horizon_s, s.lookahead_s)
    assert excess <= 0, (excess, window)
    warm = clock() - 4 * NS_PER_S
    assert sum(n for t, n in computed if t >= warm) / 4.0 >= 0.95 * 2000
    total = sum(n for _, n in computed)
    spent = sum(drv.scheduler.output_rate.limiter.others[PROMPT].book.spent for drv in drivers)
    assert spent == total < prompt_tokens  # the leases pay for computed tokens only
    # prefix-cache hits were had and not charged: a prompt whose shared
    # 256 tokens were cached computed its own 144
    done = [work for work, finished in per_request.values() if finished]
    assert len(done) > 20 and max(done) <= 400 and done.count(144) >= len(done) - 2, done
    for drv in drivers:
        assert drv.scheduler.output_rate.limiter.others[PROMPT].book.spent > 0
        drv.scheduler.shutdown()
