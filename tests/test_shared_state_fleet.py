"""Shared-budget mode: the real lease protocol against a real
``redis-server`` (Debian's, started here on a free loopback port) with
simulated engines on a fake clock: the fleet bound against a brute-force
oracle, engines joining, leaving, dying and stalling, the store stopped and
restarted empty; the lease thread keeping the scheduler off the network."""

from __future__ import annotations

import threading
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stores import needs_redis, redis_server, store_url  # noqa: F401  (fixtures)
from vllm_output_rate.fleet_math import fleet_bound
from vllm_output_rate.lease_store import RedisStore
from vllm_output_rate.limiter import NS_PER_S
from vllm_output_rate.shared_limiter import SharedBudgetLimiter
from vllm_output_rate.shared_settings import SharedStateSettings, parse_shared_state
from vllm_output_rate.tools.fleet_sim import T0_NS, Fleet, worst_window_excess


# -- simulated fleets on a fake clock against the real store ---------------------------


def _check_bound(fleet, user, extra=0):
    s = fleet.settings
    excess, window = worst_window_excess(sorted(fleet.spends.get(user, [])), fleet.rate_of(user),
                                         s.horizon_s, s.lookahead_s, extra)
    assert excess <= 0, f"{user}: {excess} tokens above the fleet bound in a {window:.3f} s window"


@needs_redis
@pytest.mark.parametrize("engines", [1, 2, 4])
def test_a_fleet_spends_the_limit_and_stays_within_the_bound(store_url, engines):
    fleet = Fleet(store_url, Fraction(20), {"fast": Fraction(200)}, seed=engines)
    for i in range(engines):
        engine = fleet.add_engine()
        engine.streams = {"a": 2, "fast": 3}
    fleet.add_engine().streams = {"solo": 1}  # one stream of a user alone
    fleet.run(8.0)
    warm = T0_NS + 2 * NS_PER_S
    for user, limit in (("a", 20), ("fast", 200)):
        rate = fleet.spent(user, warm) / 6.0
        assert 0.97 * limit <= rate <= fleet_bound(6.0, limit, 0.5, 0.25) / 6.0, (user, rate)
        _check_bound(fleet, user)
    # a single stream of 100 steps/s at a 20 tok/s limit also gets its limit
    assert fleet.spent("solo", warm) / 6.0 >= 0.97 * 20
    per_engine = [e.limiter.book.spent for e in fleet.engines[:engines]]
    if engines > 1:
        # the engines' calls are independent: each gets a real share
        assert min(per_engine) > 0.5 * sum(per_engine) / engines, per_engine


@needs_redis
@settings(max_examples=12, deadline=None)
@given(st.data())
def test_fleet_bound_holds_for_random_demands_joins_and_leaves(redis_server, data):
    """Oracle: every window between two spends, brute force."""
    import redis

    if redis_server.proc is None:
        redis_server.start()
    redis.Redis.from_url(redis_server.url).flushdb()
    limit = data.draw(st.sampled_from([Fraction(5), Fraction(20), Fraction(1, 2), Fraction(75)]))
    settings_ = SharedStateSettings(redis_server.url,
                                    tick_s=data.draw(st.sampled_from([0.02, 0.05])),
                                    horizon_s=data.draw(st.sampled_from([0.2, 0.5])),
                                    lookahead_s=data.draw(st.sampled_from([0.05, 0.25])))
    fleet = Fleet(redis_server.url, limit, settings=settings_,
                  step_s=data.draw(st.sampled_from([0.005, 0.01, 0.03])),
                  seed=data.draw(st.integers(0, 1000)))
    engines = [fleet.add_engine() for _ in range(data.draw(st.integers(1, 4)))]
    plan = data.draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, len(engines) - 1),
                                        st.integers(0, 4)), min_size=1, max_size=8))
    fleet.play(engines, plan, 4.0, lambda: data.draw(st.booleans()))
    _check_bound(fleet, "u")


@needs_redis
def test_store_down_and_back_empty_no_stall_fallback_share_and_no_burst(redis_server, caplog):
    import logging

    import redis

    if redis_server.proc is None:
        redis_server.start()
    redis.Redis.from_url(redis_server.url).flushdb()
    settings_ = SharedStateSettings(redis_server.url, timeout_s=0.05)
    fleet = Fleet(redis_server.url, Fraction(20), settings=settings_, seed=3)
    a, b = fleet.add_engine(), fleet.add_engine()
    a.streams = b.streams = {"u": 2}
    s = NS_PER_S
    with caplog.at_level(logging.WARNING, logger="vllm_output_rate"):
        fleet.run(3.0)
        redis_server.stop()
        fleet.run(3.0)
        redis_server.start()  # back, and empty: a store that lost its data
        fleet.run(4.0)
    # serving never stopped: every engine spent in every second
    for second in range(10):
        assert fleet.spent("u", T0_NS + second * s, T0_NS + (second + 1) * s) > 0
    # in fallback each engine gets 20 / 2 (two engines last seen sharing "u")
    fallback_rate = fleet.spent("u", T0_NS + 4 * s, T0_NS + 6 * s) / 2.0
    assert 0.95 * 20 <= fallback_rate <= 1.05 * 20
    for engine in (a, b):
        stats = engine.limiter.stats()
        assert stats["fallback_episodes"] == 1 and stats["fallback"] == 0.0
        assert stats["failed_calls"] >= 1 and stats["unleased"] > 0
        assert stats["resets"] == 1 or stats["fallback_episodes"] == 1
    # shared mode again after the store came back
    assert fleet.spent("u", T0_NS + 7 * s, T0_NS + 10 * s) / 3.0 >= 0.97 * 20
    assert a.limiter.book.spent > 0 and b.limiter.book.spent > 0
    _check_bound(fleet, "u")  # the same bound across the outage and the reset
    unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(unreachable) == 2  # one line per engine per episode
    assert "***" not in unreachable[0].getMessage()


@needs_redis
def test_a_sharer_stalled_before_the_outage_still_divides_the_fallback_share(redis_server):
    """Engine b's process stalls for 2.5 s (no call, no step), longer than
    the store counts an engine as sharing a user (2 s): a's replies say it
    serves "u" alone. The store dies as b wakes: a's fallback divides by the
    most engines seen sharing "u" lately (2), not the last reply's 1, and
    the fleet stays at the limit (30 tok/s, a at the whole 20, without it)."""
    import redis

    if redis_server.proc is None:
        redis_server.start()
    redis.Redis.from_url(redis_server.url).flushdb()
    fleet = Fleet(redis_server.url, Fraction(20),
                  settings=SharedStateSettings(redis_server.url, timeout_s=0.05), seed=11)
    a, b = fleet.add_engine(), fleet.add_engine()
    a.streams = b.streams = {"u": 2}
    s = NS_PER_S
    fleet.run(1.0)
    b.alive = False
    # (its alive channel lost too, say reset by a device on the way: a
    # stalled engine whose subscription stands counts as cut off, sharing)
    b.limiter.thread.store.drop_alive()
    fleet.run(2.5)
    assert a.limiter.thread.sharing["u"] == 1  # the premise: a's last reply
    b.alive = True
    try:
        redis_server.stop()
        fleet.run(3.0)
    finally:
        redis_server.start()
    assert a.limiter.in_fallback and b.limiter.in_fallback
    start = T0_NS + 4 * s
    for engine in (a, b):
        mine = sum(n for t, n in engine.spends["u"] if t >= start)
        assert mine / 2.5 <= 1.05 * 10, (engine.name, mine / 2.5)
    assert fleet.spent("u", start) / 2.5 <= 1.05 * 20


@needs_redis
def test_a_dead_engine_holds_no_budget_past_the_horizon(store_url):
    fleet = Fleet(store_url, Fraction(20), seed=5)
    a, b = fleet.add_engine(), fleet.add_engine()
    a.streams = {"u": 3}
    fleet.run(2.0)
    fleet.kill(a)  # dies holding leases
    b.streams = {"u": 3}
    fleet.run(0.05)
    start = fleet.now_ns
    fleet.run(3.0)
    s = fleet.settings
    ready = start + int((s.horizon_s + s.lookahead_s) * NS_PER_S)
    # after horizon + lookahead the survivor gets the whole limit
    rate = fleet.spent("u", ready) / ((fleet.now_ns - ready) / NS_PER_S)
    assert rate >= 0.97 * 20
    _check_bound(fleet, "u")


@needs_redis
def test_an_engine_that_shuts_down_leaves_the_store_at_once(store_url):
    """An engine core shutting down (an orphan whose API server is gone
    included) leaves the store: at the survivor's next call the store counts
    it as neither live nor sharing the user, where an engine that just
    stops calling counts for ``LIVE_S`` (2 s) more. Both in one fleet."""
    fleet = Fleet(store_url, Fraction(20), seed=7)
    a, b, c = fleet.add_engine(), fleet.add_engine(), fleet.add_engine()
    a.streams = b.streams = c.streams = {"u": 3}
    fleet.run(1.0)
    assert b.limiter.thread.sharing["u"] == 3 and b.limiter.thread.live_engines == 3
    fleet.leave(a)          # shuts down: leaves
    fleet.kill(c)           # dies: its marks lapse
    fleet.run(0.2)          # a few of b's calls
    assert b.limiter.thread.sharing["u"] == 2  # c still counted, a not
    assert b.limiter.thread.live_engines == 2
    fleet.run(2.5)          # past LIVE_S: c lapsed too
    assert b.limiter.thread.sharing["u"] == 1 and b.limiter.thread.live_engines == 1
    assert a.limiter.thread.sharing == {}
    _check_bound(fleet, "u")


@needs_redis
def test_leaving_a_store_that_does_not_answer_changes_nothing(redis_server):
    """The store is down when the engine shuts down: a logged line, no
    exception (the marks lapse after ``LIVE_S``)."""
    import redis

    if redis_server.proc is None:
        redis_server.start()
    redis.Redis.from_url(redis_server.url).flushdb()
    fleet = Fleet(redis_server.url, Fraction(20),
                  settings=SharedStateSettings(redis_server.url, timeout_s=0.05), seed=2)
    a = fleet.add_engine()
    a.streams = {"u": 1}
    fleet.run(0.5)
    redis_server.stop()
    try:
        assert a.limiter.thread.leave() is False
    finally:
        redis_server.start()


@needs_redis
def test_the_lease_thread_keeps_the_scheduler_off_the_network(store_url):
    """Real threads: while a store call hangs (held on an event), the
    scheduler's side (``begin_step`` / ``available`` / ``settle`` /
    ``ready_at_ns``) runs 200 steps beside it; once the store answers,
    grants come through. No wall-clock threshold: the call is provably still
    in progress while the steps run (60 s joins only catch a hang)."""
    settings_ = parse_shared_state(store_url.split("?")[0] + "?timeout_ms=100")
    store = RedisStore(settings_)
    real_lease = store.lease
    in_call, release = threading.Event(), threading.Event()

    def held(*args, **kwargs):
        in_call.set()
        release.wait()
        return real_lease(*args, **kwargs)

    store.lease = held
    limiter = SharedBudgetLimiter(Fraction(50), {}, settings_, store=store)

    def step() -> int:
        now = time.monotonic_ns()
        limiter.begin_step(now)
        n = min(limiter.available("u", now), 4)
        limiter.settle(now, {"u": n} if n else {})
        if n < 4:
            limiter.ready_at_ns("u")
        return n

    try:
        assert in_call.wait(60)  # the lease thread is inside a store call ...
        done: list[int] = []
        side = threading.Thread(target=lambda: done.extend(step() for _ in range(200)),
                                daemon=True)
        side.start()
        side.join(60)
        assert not side.is_alive() and len(done) == 200  # ... and the steps ran beside it
        assert not release.is_set() and limiter.stats()["calls"] == 0
        release.set()
        spent, deadline = 0, time.monotonic() + 60
        while spent < 60 and time.monotonic() < deadline:
            spent += step()
            time.sleep(0.005)
        assert spent >= 60  # grants came through once the store answered
        assert limiter.stats()["calls"] > 1
    finally:
        release.set()
        limiter.close()
    assert not limiter.thread._thread.is_alive()
