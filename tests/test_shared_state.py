"""Shared-budget mode: the lease book (pure), the option, and the real lease
protocol against a real ``redis-server`` (Debian's, started here on a free
loopback port) with simulated engines on a fake clock: the fleet bound
against a brute-force oracle, engines joining and leaving, the store
stopped and restarted empty."""

from __future__ import annotations

import math
import threading
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.config import DEFAULT_OPTION, OutputRateConfig, OutputRateConfigError
from vllm_output_rate.fleet_math import fleet_bound
from vllm_output_rate.lease_book import LeaseBook
from vllm_output_rate.lease_store import LeaseAsk, RedisStore
from vllm_output_rate.limiter import NS_PER_S
from vllm_output_rate.shared_limiter import SharedBudgetLimiter
from vllm_output_rate.shared_settings import SharedStateError, SharedStateSettings, parse_shared_state
from vllm_output_rate.tools.fleet_sim import T0_NS, Fleet, worst_window_excess
from vllm_output_rate.tools.redis_server import RedisServer, redis_server_binary

needs_redis = pytest.mark.skipif(redis_server_binary() is None,
                                 reason="redis-server not installed (make tools installs it)")


@pytest.fixture(scope="module")
def redis_server():
    if redis_server_binary() is None:
        pytest.skip("redis-server not installed")
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture
def store_url(redis_server):
    import redis

    if redis_server.proc is None:
        redis_server.start()
    redis.Redis.from_url(redis_server.url).flushdb()
    # The protocol's tests: a store that answers late is not what they
    # check (the outage tests set their own timeouts), and the version
    # matrix runs them at the lowest CPU priority beside the suite's engines
    # (the server it starts too): 5 s instead of the engines' 250 ms.
    return redis_server.url + "?timeout_ms=5000"


# -- the lease book (pure) ---------------------------------------------------------


def test_lease_book_spends_oldest_first_and_expires_the_rest():
    book = LeaseBook()
    book.add_grant("a", 3, deadline_ns=100)
    book.add_grant("a", 2, deadline_ns=200)
    assert book.balance == {"a": 5}
    assert book.spend("a", 4) == 4  # all of the first lease, one of the second
    book.expire(150)  # the first lease was spent: nothing expires
    assert book.balance == {"a": 1} and book.expired == 0
    book.expire(200)
    assert book.balance == {} and book.expired == 1 and len(book) == 0
    assert (book.granted, book.spent) == (5, 4)


def test_lease_book_never_spends_more_than_it_holds():
    book = LeaseBook()
    assert book.spend("a", 1) == 0
    book.add_grant("a", 2, 10)
    assert book.spend("a", 5) == 2
    assert book.balance == {}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grant", "spend", "expire", "clear"]),
                          st.sampled_from(["a", "b"]), st.integers(0, 6), st.integers(1, 40)),
                max_size=60))
def test_lease_book_against_a_list_of_leases(ops):
    """Oracle: every lease as [deadline, left], spent oldest deadline first."""
    book, oracle = LeaseBook(), {"a": [], "b": []}
    now, expired = 0, 0
    for op, user, n, dt in ops:
        if op == "grant":
            deadline = now + dt
            # grants of a user come with rising deadlines (sent in order)
            if oracle[user] and oracle[user][-1][0] > deadline:
                deadline = oracle[user][-1][0]
            book.add_grant(user, n, deadline)
            if n:
                oracle[user].append([deadline, n])
        elif op == "spend":
            held = sum(left for _, left in oracle[user])
            assert book.spend(user, n) == min(n, held)
            need = min(n, held)
            for lease in oracle[user]:
                take = min(need, lease[1])
                lease[1] -= take
                need -= take
            oracle[user] = [l for l in oracle[user] if l[1] > 0]
        elif op == "expire":
            now += dt
            book.expire(now)
            for u in oracle:
                expired += sum(left for d, left in oracle[u] if d <= now)
                oracle[u] = [l for l in oracle[u] if l[0] > now]
        else:
            book.clear()
            expired += sum(left for u in oracle for _, left in oracle[u])
            oracle = {"a": [], "b": []}
        want = {u: sum(left for _, left in ls) for u, ls in oracle.items()}
        assert book.balance == {u: v for u, v in want.items() if v}
        assert book.expired == expired
        assert book.granted == book.spent + book.expired + sum(book.balance.values())


# -- the option -------------------------------------------------------------------


@pytest.mark.parametrize("value, match", [
    ("", "expected redis://"),
    ("http://127.0.0.1:6379", "redis://"),
    ("redis://127.0.0.1", "host and a port"),
    ("redis://:6379", "host and a port"),
    ("redis://127.0.0.1:notaport", "bad port"),
    ("redis://127.0.0.1:6379/x", "database must be a number"),
    ("redis://127.0.0.1:6379/0?tick=5", "unknown setting 'tick'"),
    ("redis://127.0.0.1:6379/0?tick_ms=0", "tick_ms must be a positive"),
    ("redis://127.0.0.1:6379/0?horizon_ms=nan", "horizon_ms must be a positive"),
    ("redis://127.0.0.1:6379/0?tick_ms=100&horizon_ms=150", "at least two ticks"),
])
def test_bad_shared_state_urls_are_refused_naming_the_option(value, match):
    with pytest.raises(SharedStateError, match=match) as info:
        parse_shared_state(value)
    assert "--output-rate-shared-state" in str(info.value)


def test_a_password_never_shows_in_errors_or_logs():
    with pytest.raises(SharedStateError) as info:
        parse_shared_state("redis://:s3cret@127.0.0.1/0")
    assert "s3cret" not in str(info.value)
    settings_ = parse_shared_state("redis://:s3cret@127.0.0.1:6379/2?tick_ms=20")
    assert settings_.redacted_url == "redis://127.0.0.1:6379/2"
    assert settings_.tick_s == pytest.approx(0.02)


def test_the_option_travels_with_the_limits_and_needs_them():
    config = OutputRateConfig.from_options("20", shared_state="redis://127.0.0.1:6379/0")
    again = OutputRateConfig.from_dict(config.to_dict())
    assert again.shared_state == "redis://127.0.0.1:6379/0"
    assert again.digest == OutputRateConfig.from_options("20").digest  # limits unchanged
    with pytest.raises(OutputRateConfigError, match=f"needs {DEFAULT_OPTION}"):
        OutputRateConfig.from_options(None, shared_state="redis://127.0.0.1:6379/0")
    with pytest.raises(OutputRateConfigError, match="--output-rate-shared-state"):
        OutputRateConfig.from_options("20", shared_state="redis://nowhere")


def test_fleet_bound_is_the_stated_formula():
    assert fleet_bound(0, 20, 0.5, 0.25) == 16  # floor(0.75 * 20) + 1
    assert fleet_bound(10, Fraction(1, 2), 0.5, 0.25) == 6
    assert fleet_bound(1, 100, 0.5, 0.25) == 176


# -- the store's script, on a real Redis ---------------------------------------------


@needs_redis
def test_the_store_grants_one_gcra_with_the_lookahead_as_burst(store_url):
    s = parse_shared_state(store_url)
    store = RedisStore(s)
    now = 1e15
    first = store.lease("e1", [LeaseAsk("a", Fraction(20), 100)], "", now_us=now)
    assert first.granted["a"] == (6, 1)  # slots starting within 250 ms: floor(250/50) + 1
    assert store.lease("e2", [LeaseAsk("a", Fraction(20), 100)], first.epoch,
                       now_us=now).granted["a"] == (0, 2)  # nothing left; two engines share "a"
    later = store.lease("e2", [LeaseAsk("a", Fraction(20), 3)], first.epoch, now_us=now + 100_000)
    assert later.granted["a"] == (2, 2) and later.live_engines == 2  # two slots passed
    assert store.lease("e1", [LeaseAsk("a", Fraction(20), 1)], "another", now_us=now).reset


@needs_redis
def test_spends_reported_after_a_reset_are_charged_before_granting(store_url):
    store = RedisStore(parse_shared_state(store_url))
    now = 1e15
    epoch = store.lease("e1", [], "", now_us=now).epoch
    # 15 tokens spent in the last 0.75 s (the fallback window): TAT = now - 0.75 s + 15 slots
    reply = store.lease("e1", [LeaseAsk("a", Fraction(20), 100, used=15)], epoch, now_us=now)
    assert reply.granted["a"][0] == 6  # TAT at now: the lookahead's worth, no more
    reply = store.lease("e1", [LeaseAsk("b", Fraction(20), 100, used=40)], epoch, now_us=now)
    assert reply.granted["b"][0] == 0  # TAT 1.25 s ahead: nothing before it passes


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


def test_fallback_share_divides_by_the_engines_last_seen():
    from vllm_output_rate.limiter import OutputRateLimiter
    from vllm_output_rate.shared_limiter import _FallbackLimiter

    base = OutputRateLimiter(Fraction(20), {"big": Fraction(90)})
    fb = _FallbackLimiter(base, {"big": 3}, live=4)
    assert fb.rate_of("big") == 30 and fb.rate_of("other") == 5
    assert math.isclose(float(_FallbackLimiter(base, {}, live=0).rate_of("x")), 20)


# -- the real vLLM scheduler in shared-budget mode ------------------------------------

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


@needs_redis
@pytest.mark.parametrize("is_async", MODES)
def test_two_real_schedulers_share_one_users_budget(store_url, is_async, monkeypatch):
    """vLLM's own Scheduler / AsyncScheduler and KV cache manager, two of
    them on one fake clock, sharing user-a's budget through the real store;
    the lease threads' rounds run between steps (their threads off). The two
    are the ranks of ``--data-parallel-size 2`` (each rank's engine core is
    an engine of the fleet, named by its rank; the real engine's case is
    test_e2e_shared_state's data-parallel test, in ``make test-all``)."""
    from harness import Driver, VirtualClock, make_request
    from vllm_output_rate.ledger import OutputRateState
    from vllm_output_rate.tools.common.scheduler_driver import make_vllm_config, scheduler_for_config

    monkeypatch.setattr(OutputRateState, "watch_thread", False)
    clock = VirtualClock()
    limits = {"default_user_output_tokens_per_second": 20,
              "user_output_tokens_per_second": {"user-b": 1000},
              "shared_state": store_url}
    drivers, user_b = [], []
    for rank in range(2):
        vllm_config = make_vllm_config(limits, async_scheduling=is_async)
        vllm_config.parallel_config.data_parallel_size = 2
        vllm_config.parallel_config.data_parallel_index = rank
        sched = scheduler_for_config(vllm_config, clock=clock)
        # the engine's fleet name carries its rank (host:pid:rank:random)
        assert sched.output_rate.limiter.thread.engine_id.split(":")[2] == str(rank)
        drivers.append(Driver(sched, None, is_async=is_async))
        for _ in range(2):
            sched.add_request(make_request("user-a", max_tokens=400))
        user_b.append(make_request("user-b", max_tokens=400))
        sched.add_request(user_b[-1])
    first_step = clock()
    charged: list[tuple[int, int]] = []
    steps = 600  # 6 s at 10 ms
    for i in range(steps):
        now = clock()
        for drv in drivers:
            thread = drv.scheduler.output_rate.limiter.thread
            if i % 5 == 0 or drv.scheduler.output_rate.limiter.starved:
                thread.tick(now_us=now / 1000)
            drv.step()
            n = sum(1 for u in drv.scheduler.output_rate.last_step.charged.values() if u == "user-a")
            if n:
                charged.append((now, n))
        clock.advance_ms(10)
    total = sum(n for _, n in charged)
    warm = [(t, n) for t, n in charged if t >= first_step + 2 * NS_PER_S]
    rate = sum(n for _, n in warm) / 4.0
    assert 0.97 * 20 <= rate <= fleet_bound(4.0, 20, 0.5, 0.25) / 4.0, rate
    excess, window = worst_window_excess(charged, Fraction(20), 0.5, 0.25)
    assert excess <= 0, (excess, window)
    # both schedulers served user-a, and user-b beside it ran at full speed
    for drv, b in zip(drivers, user_b):
        assert drv.scheduler.output_rate.limiter.thread.live_engines == 2
        assert drv.scheduler.output_rate.limiter.book.spent > 0.25 * total
        # one token per step from its first lease on: done within 420 steps
        assert drv.finished.get(b.request_id) is not None
        assert drv.tokens[b.request_id][-1][0] <= 420
        drv.scheduler.shutdown()


@needs_redis
def test_a_contended_budget_is_shared_even_with_an_engine_that_asks_far_more_often(store_url):
    """Engine A asks every 10 ms, B every 125 ms (a backed-off engine): the
    first to ask after each slot accrues would take every slot; under
    contention the store caps each sharing engine at limit / sharing."""
    store = RedisStore(parse_shared_state(store_url))
    now, got = 1e15, {"A": 0, "B": 0}
    epoch = store.lease("A", [], "", now_us=now).epoch
    for i in range(500):  # 5 s
        t = now + i * 10_000
        if i % 12 == 0:
            got["B"] += store.lease("B", [LeaseAsk("u", Fraction(20), 2)], epoch,
                                    now_us=t + 1).granted["u"][0]
        got["A"] += store.lease("A", [LeaseAsk("u", Fraction(20), 2)], epoch,
                                now_us=t).granted["u"][0]
    total = got["A"] + got["B"]
    assert total <= fleet_bound(5.0, 20, 0, 0.25)  # one GCRA for both
    assert got["B"] >= 0.4 * total, got


@needs_redis
def test_a_changed_limit_keeps_the_debt_in_tokens_at_the_store(store_url):
    """A reloaded limit (0.5 -> 1000 tok/s): the store converts its TAT as
    the engines' limiters do, so a user throttled at the old limit is not
    held for the old limit's slot length."""
    store = RedisStore(parse_shared_state(store_url))
    now = 1e15
    epoch = store.lease("e1", [], "", now_us=now).epoch
    # lookahead 250 ms at 0.5 tok/s: one token, the TAT 2 s ahead
    assert store.lease("e1", [LeaseAsk("u", Fraction(1, 2), 5)], epoch,
                       now_us=now).granted["u"][0] == 1
    assert store.lease("e1", [LeaseAsk("u", Fraction(1, 2), 5)], epoch,
                       now_us=now + 1000).granted["u"][0] == 0
    # at 1000 tok/s the one token of debt is 1 ms: the lookahead is open again
    got = store.lease("e1", [LeaseAsk("u", Fraction(1000), 1000)], epoch,
                      now_us=now + 2000).granted["u"][0]
    assert 240 <= got <= 251


@needs_redis
@pytest.mark.parametrize("is_async", MODES)
def test_two_real_schedulers_through_a_store_outage_on_one_clock(redis_server, is_async,
                                                                  monkeypatch):
    """test_e2e_shared_state's outage, on vLLM's own schedulers sharing one
    fake clock: user-a's four streams over two engines, the store stopped
    3 s in and started again empty 5 s later. Serving never stops; during
    the outage each engine runs user-a at its fallback share (20 / 2), the
    fleet at 20; after it they share again at the limit; and the fleet
    bound holds in every window across the outage and the reset. The
    store's time is the fake clock's (the lease rounds run between steps),
    so nothing here depends on how promptly this process runs."""
    from harness import VirtualClock, run_shared, shared_schedulers
    from stores import fresh_store
    from vllm_output_rate.ledger import OutputRateState

    url = fresh_store(redis_server)
    monkeypatch.setattr(OutputRateState, "watch_thread", False)
    clock = VirtualClock()
    # 5 s: a call timing out on a loaded machine would be a second fault
    # (its reply lost, a lease or report counted twice); the stopped store
    # refuses connections at once
    drivers = shared_schedulers([url + "?timeout_ms=5000"] * 2, clock, is_async)
    t0 = clock()
    marks = {}
    s = NS_PER_S

    def outage(i, now):
        if now == t0 + 3 * s:
            marks["down"] = now
            redis_server.stop()
        if now == t0 + 8 * s:
            redis_server.start()  # back, and empty: a store that lost its data
            marks["up"] = now

    spends = run_shared(drivers, clock, 1200, outage)  # 12 s at 10 ms
    fleet = sorted(spends[0] + spends[1])

    def tokens(of, lo, hi):
        return sum(n for t, n in of if lo <= t < hi)

    # serving never stopped: every engine spent in every second
    for k in range(2):
        assert all(tokens(spends[k], t0 + j * s, t0 + (j + 1) * s) > 0 for j in range(12)), k
    # during the outage (from a second after it began): each engine at its
    # fallback share, the fleet at the limit
    lo, hi = marks["down"] + s, marks["up"]
    seconds = (hi - lo) / s
    for k in range(2):
        share = tokens(spends[k], lo, hi) / seconds
        assert abs(share - 10) <= 1 / seconds, (k, share)  # to a token
    # after it (from a second after the restart): shared again, at the limit
    seconds = (clock() - marks["up"] - s) / s
    after = tokens(fleet, marks["up"] + s, clock()) / seconds
    assert abs(after - 20) <= 1 / seconds, after
    # the same bound across the outage and the reset
    excess, window = worst_window_excess(fleet, Fraction(20), 0.5, 0.25)
    assert excess <= 0, (excess, window)
    for drv in drivers:
        stats = drv.scheduler.output_rate.limiter.stats()
        assert stats["fallback_episodes"] == 1 and stats["fallback"] == 0.0, stats
        assert stats["failed_calls"] >= 2 and stats["unleased"] > 0, stats
        assert drv.scheduler.output_rate.limiter.book.spent > 0
        drv.scheduler.shutdown()
