"""Shared-budget mode: the lease book (pure), the option, and the real
store's script against a real ``redis-server`` (Debian's, started here on a
free loopback port): one GCRA with the lookahead as burst, spends reported
after a reset, a contended budget shared, a changed limit's debt in tokens;
the fallback share."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stores import needs_redis, redis_server, store_url  # noqa: F401  (fixtures)
from vllm_output_rate.config import DEFAULT_OPTION, OutputRateConfig, OutputRateConfigError
from vllm_output_rate.fleet_math import fleet_bound
from vllm_output_rate.lease_book import LeaseBook
from vllm_output_rate.lease_store import LeaseAsk, RedisStore
from vllm_output_rate.shared_settings import SharedStateError, parse_shared_state


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


def test_fallback_share_divides_by_the_engines_last_seen():
    from vllm_output_rate.limiter import OutputRateLimiter
    from vllm_output_rate.shared_limiter import _FallbackLimiter

    base = OutputRateLimiter(Fraction(20), {"big": Fraction(90)})
    fb = _FallbackLimiter(base, {"big": 3}, live=4)
    assert fb.rate_of("big") == 30 and fb.rate_of("other") == 5
    assert math.isclose(float(_FallbackLimiter(base, {}, live=0).rate_of("x")), 20)


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
