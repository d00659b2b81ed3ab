"""Long slices (``slice_ms``): a user whose spending on an engine is steady is
leased a slice of ``L`` at a time, released over ``L``; its terms of the
fleet bound are ``H + L`` and ``B + L``. The sizer's steadiness and the
release in parts (pure), and the bound in every window for random fleets on
a fake clock against a real ``redis-server`` (hypothesis, brute-force
oracle), with the entries it saves counted."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.fleet_math import LeaseSizer, fleet_bound
from vllm_output_rate.lease_store import LeaseAsk, RedisStore, next_rounds, round_s
from vllm_output_rate.limiter import NS_PER_S
from vllm_output_rate.shared_limiter import SharedBudgetLimiter
from vllm_output_rate.shared_settings import SharedStateSettings, parse_shared_state
from vllm_output_rate.tools.fleet_sim import T0_NS, Fleet, worst_window_excess
from vllm_output_rate.tools.redis_server import RedisServer, redis_server_binary

from stores import fresh_store

MS = 1_000_000


@pytest.fixture(scope="module")
def redis_server():
    if redis_server_binary() is None:
        pytest.skip("redis-server not installed")
    with RedisServer() as server:
        yield server


def fresh(server: RedisServer) -> str:
    return fresh_store(server)


# -- pure: the sizer and the release in parts ------------------------------------------


def sizer(slice_ms: int = 1000) -> LeaseSizer:
    return LeaseSizer(SharedStateSettings("redis://x:1", slice_s=slice_ms / 1000))


def test_a_user_is_steady_after_two_whole_windows_alike_and_not_when_it_changes():
    s = sizer()
    rate = lambda u: Fraction(20)  # noqa: E731
    t = T0_NS
    asks = []
    for i in range(60):  # 3 s of rounds, 5 tokens a second
        t += 50 * MS
        asks.append(s.asks(t, {"u": 1} if i % 4 == 0 else {}, set(), {}, {}, {"u": 4}, {}, rate))
    assert s.steady_rate("u", t) == pytest.approx(1.25 * 5.0)
    assert sum(a.long for r in asks[-20:] for a in r) == 1  # once a slice (1 s)
    # it spends four times as much for a window: not steady any more
    for i in range(20):
        t += 50 * MS
        s.asks(t, {"u": 1}, set(), {}, {}, {"u": 4}, {}, rate)
    assert s.steady_rate("u", t + 60 * MS) is None  # once that window is whole


def test_a_steady_user_is_asked_a_long_slice_once_a_slice():
    s = sizer()
    rate = lambda u: Fraction(20)  # noqa: E731
    s.meter["u"] = [T0_NS, 0, 5, 5, 0, 0, 0]  # 5 tok/s in each of the last two windows
    long = s.asks(T0_NS + 1, {"u": 1}, set(), {}, {"u": 1}, {"u": 4}, {}, rate)
    # 1.25 x 5 tok/s for the slice (1 s), less what it holds
    assert len(long) == 1 and long[0].long and long[0].want == 7 - 1
    assert s.asks(T0_NS + 2, {"u": 1}, set(), {}, {}, {"u": 4}, {}, rate) == []
    assert s.asks(T0_NS + 999 * MS, {"u": 1}, set(), {}, {}, {"u": 4}, {}, rate) == []
    assert s.asks(T0_NS + 1001 * MS, {"u": 1}, set(), {}, {}, {"u": 4}, {}, rate)[0].long
    # short of leases in both windows (it wants more than it gets): at least
    # its fair share (20 / 2 engines), a quarter more than it spent only if
    # its last slice came whole
    s.meter["v"] = [T0_NS, 0, 5, 6, 0, 3, 2]
    assert s.steady_rate("v", T0_NS, fair=10.0) == 10.0
    assert s.steady_rate("v", T0_NS, fair=4.0) == 1.25 * 6
    s.long_granted("v", 3, 6, T0_NS)
    assert s.steady_rate("v", T0_NS, fair=4.0) == 6
    # off: never long
    plain = sizer(0)
    plain.meter["u"] = [T0_NS, 0, 5, 5, 0, 0, 0]
    assert not any(a.long for a in plain.asks(T0_NS + 1, {"u": 1}, set(), {}, {}, {}, {}, rate))


def test_a_long_slice_is_released_over_the_slice_in_order_of_deadlines():
    settings_ = SharedStateSettings("redis://x:1", slice_s=1.0)
    limiter = SharedBudgetLimiter(Fraction(20), {}, settings_, start_thread=False)
    deadline = T0_NS + 1500 * MS
    limiter.long_grants.append(("u", 20, deadline, T0_NS, 1000 * MS))
    limiter.begin_step(T0_NS)
    assert limiter.book.balance["u"] == 1 and limiter.unreleased["u"] == 19  # 20 parts, a tick apart
    limiter.begin_step(T0_NS + 500 * MS)
    assert limiter.book.balance["u"] == 11
    # a lease granted meanwhile: the rest is released first (deadlines stay in order)
    limiter.grants.append(("u", 2, deadline))
    limiter.begin_step(T0_NS + 510 * MS)
    assert limiter.book.balance["u"] == 22 and "u" not in limiter.unreleased
    limiter.begin_step(deadline)
    assert limiter.book.balance == {} and limiter.book.expired == 22


# -- the piggyback: a store's slices asked on its rounds (pure) ------------------------


def test_rounds_are_a_whole_number_a_slice_at_most_a_heartbeat_apart_on_each_engines_phase():
    assert round_s(SharedStateSettings("redis://x:1", slice_s=1.0)) == 0.5
    assert round_s(SharedStateSettings("redis://x:1", slice_s=1.5)) == 0.5
    assert round_s(SharedStateSettings("redis://x:1", slice_s=0.75)) == 0.375
    assert round_s(SharedStateSettings("redis://x:1", slice_s=0.25)) == 0.125
    nxt: dict = {}
    r = 500 * MS
    assert next_rounds(nxt, ("a", "b"), T0_NS + 7, r, phase_ns=100 * MS) == {
        "a": T0_NS + 100 * MS, "b": T0_NS + 100 * MS}  # (the first at once, ending on the phase)
    assert next_rounds(nxt, ("a", "b"), T0_NS + 99 * MS, r, 100 * MS) == {}
    assert next_rounds(nxt, ("a",), T0_NS + 130 * MS, r, 100 * MS) == {"a": T0_NS + 600 * MS}
    assert next_rounds(nxt, ("a", "b"), T0_NS + 1700 * MS, r, 100 * MS) == {
        "a": T0_NS + 2100 * MS, "b": T0_NS + 2100 * MS}  # (rounds missed: the next one's end)


def test_a_slice_due_before_the_round_ends_is_asked_on_the_round_and_keeps_its_cadence():
    s = sizer()
    rate = lambda u: Fraction(20)  # noqa: E731
    for user in ("a", "b", "c", "d"):
        s.meter[user] = [T0_NS, 0, 5, 5, 0, 0, 0]  # steady, 5 tok/s
    s.next_long.update({"a": T0_NS + 100 * MS, "b": T0_NS + 499 * MS, "c": T0_NS + 500 * MS,
                        "d": T0_NS - 1})
    until = lambda u: T0_NS + 500 * MS  # noqa: E731  (its store's round ends then)
    early = s.early_asks(T0_NS, until, {"d"}, {"a": 2}, {}, {}, rate)
    # a and b fall due before the round ends (c at its end, d asked already)
    assert sorted((a.user, a.want, a.long) for a in early) == [("a", 7 - 2, True), ("b", 7, True)]
    # the next slice a slice after this one was due, not after now
    assert s.next_long["a"] == T0_NS + 1100 * MS and s.next_long["b"] == T0_NS + 1499 * MS
    assert s.next_long["c"] == T0_NS + 500 * MS
    # not on a round of its store (0), told to wait (a retry), or not steady: not early
    s.next_long["c"] = T0_NS + 200 * MS
    assert s.early_asks(T0_NS, lambda u: 0, set(), {}, {}, {}, rate) == []
    assert s.early_asks(T0_NS, until, set(), {}, {}, {"c": T0_NS + 1}, rate) == []
    s.meter["c"] = [T0_NS, 0, 5, 20, 0, 0, 0]
    assert s.early_asks(T0_NS, until, set(), {}, {}, {}, rate) == []


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_each_steady_user_is_asked_once_a_slice_and_its_slices_only_on_rounds(data):
    """Property: a store's users at random dues, calls at random ticks (the
    rounds, and calls of other users' asks between them): each steady user
    is asked a long slice once a slice (never more than a round early), and
    once every due has come to a round, only on rounds."""
    slice_ms = data.draw(st.sampled_from([250, 500, 1000, 1500]))
    s = sizer(slice_ms)
    rate = lambda u: Fraction(20)  # noqa: E731
    tick = 50 * MS
    round_ns = int(round_s(s_settings(slice_ms)) * NS_PER_S)
    users = [f"u{i}" for i in range(data.draw(st.integers(1, 12)))]
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    for user in users:
        s.next_long[user] = T0_NS + rng.randrange(2 * slice_ms) * MS
    nxt: dict = {}
    phase = rng.randrange(round_ns)
    late = data.draw(st.sampled_from([0, 7, 30]))  # (a thread late by up to this, ms)
    others = data.draw(st.sampled_from([0.0, 0.1, 0.5]))  # (other users' asks between rounds)
    asked: dict[str, list[tuple[int, bool]]] = {u: [] for u in users}
    t = T0_NS
    end = T0_NS + 12 * slice_ms * MS
    while t < end:
        t += tick + rng.randrange(late + 1) * MS
        for user in users:
            s.meter[user] = [t, 0, 5, 5, 0, 0, 0]  # (steady throughout)
        plain = s.asks(t, {u: 1 for u in users}, set(), {}, {}, {}, {}, rate)
        rounds = next_rounds(nxt, (None,), t, round_ns, phase)
        if not (plain or rounds or rng.random() < others):
            continue
        ends = rounds.get(None, 0)
        early = s.early_asks(t, lambda u: ends, {a.user for a in plain}, {}, {}, {}, rate)
        for a in plain + early:
            assert a.long
            asked[a.user].append((t, bool(rounds)))
    for user, times in asked.items():
        span = times[-1][0] - times[0][0]
        # once a slice: each ask at most a round before its due, each due a slice after the last
        assert len(times) - 1 <= (span + round_ns) / (slice_ms * MS) + 1e-9, (user, times)
        gaps = [b[0] - a[0] for a, b in zip(times, times[1:])]
        assert all(g >= slice_ms * MS - round_ns - tick - late * MS for g in gaps), (user, gaps)
        settled = [on_round for when, on_round in times if when >= T0_NS + 4 * slice_ms * MS]
        assert all(settled), (user, times)  # only on rounds


def test_marks_within_their_silent_window_need_no_look_at_the_heartbeat_set(redis_server):
    """The script's work per entry: another engine's mark on a user newer
    than that engine's silent window means its heartbeat is as new (the
    same call wrote both): it counts as live without a ``ZSCORE``; an
    older mark is looked up (once a call per engine)."""
    import redis

    url = fresh(redis_server)
    store = RedisStore(parse_shared_state(url + "?slice_ms=1000"))
    client = redis.Redis.from_url(url)
    asks = [LeaseAsk(f"u{i}", Fraction(20), 1) for i in range(5)]
    now = 1e15
    epoch = ""
    for engine in ("e1", "e2", "e3"):
        epoch = store.lease(engine, asks, epoch, now_us=now).epoch

    def zscores() -> int:
        return int(client.info("commandstats").get("cmdstat_zscore", {}).get("calls", 0))

    client.config_resetstat()
    reply = store.lease("e4", asks, epoch, now_us=now + 0.5e6)  # their marks 0.5 s old (window: 1 s)
    assert zscores() == 0 and {g[1] for g in reply.granted.values()} == {4}
    # 1.5 s: looked up, silent and with no alive channel (never made here): dead, their marks go
    reply = store.lease("e4", asks, epoch, now_us=now + 1.5e6)
    assert zscores() == 3 and {g[1] for g in reply.granted.values()} == {1}
    client.close()


def s_settings(slice_ms: int) -> SharedStateSettings:
    return SharedStateSettings("redis://x:1", slice_s=slice_ms / 1000)


# -- the fleet bound with long slices, on a real store ---------------------------------


def check_bound(fleet: Fleet, user: str) -> None:
    s = fleet.settings
    excess, window = worst_window_excess(sorted(fleet.spends.get(user, [])), fleet.rate_of(user),
                                         s.long_horizon_s, s.long_lookahead_s)
    assert excess <= 0, f"{user}: {excess} tokens above the fleet bound in a {window:.3f} s window"


@settings(max_examples=10, deadline=None)
@given(st.data())
def test_fleet_bound_with_long_slices_for_random_demands_joins_and_leaves(redis_server, data):
    """Oracle: every window between two spends, brute force, against
    ``fleet_bound(W, limit, H + L, B + L)``."""
    url = fresh(redis_server)
    limit = data.draw(st.sampled_from([Fraction(5), Fraction(20), Fraction(75)]))
    settings_ = SharedStateSettings(url, tick_s=0.05,
                                    horizon_s=data.draw(st.sampled_from([0.2, 0.5])),
                                    lookahead_s=data.draw(st.sampled_from([0.05, 0.25])),
                                    slice_s=data.draw(st.sampled_from([0.25, 0.5, 1.0])))
    fleet = Fleet(url, limit, settings=settings_, step_s=data.draw(st.sampled_from([0.01, 0.03])),
                  seed=data.draw(st.integers(0, 1000)))
    engines = [fleet.add_engine() for _ in range(data.draw(st.integers(1, 4)))]
    plan = data.draw(st.lists(st.tuples(st.integers(0, 5), st.integers(0, len(engines) - 1),
                                        st.integers(0, 4)), min_size=1, max_size=8))
    fleet.play(engines, plan, 7.0, lambda: data.draw(st.booleans()))
    check_bound(fleet, "u")


def test_users_at_their_limits_spend_them_with_far_fewer_entries(redis_server):
    """Four engines, each user two streams on each (far more than its share):
    the same fleet without and with 1 s slices, on one store. Entries are
    the protocol's (the fake clock): deterministic counts, not timings."""
    out = {}
    for slice_ms in (0, 1000):
        url = fresh(redis_server)  # (both arms start at the fake clock's zero)
        settings_ = parse_shared_state(url + f"?slice_ms={slice_ms}")
        fleet = Fleet(url, Fraction(20), settings=settings_, step_s=0.02, seed=7)
        users = [f"user-{i}" for i in range(6)]
        for _ in range(4):
            fleet.add_engine().streams = {u: 2 for u in users}
        fleet.run(4.0)
        entries0 = fleet.store_ops()[1]
        start = fleet.now_ns
        fleet.run(4.0)
        entries = fleet.store_ops()[1] - entries0
        rates = [fleet.spent(u, start) / 4.0 for u in users]
        for user in users:
            check_bound(fleet, user)
        out[slice_ms] = (entries / 4.0 / len(users), min(rates), max(rates))
    (before, *_), (after, lo, hi) = out[0], out[1000]
    assert after * 4.5 <= before, out  # (5.0x here: one ask a slice per engine and user)
    assert 0.95 * 20 <= lo and hi <= fleet_bound(4.0, 20, 1.5, 1.25) / 4.0, out
