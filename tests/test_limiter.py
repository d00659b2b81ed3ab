"""GCRA limiter: unit tests with a fake clock, property tests against an oracle."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import limit_integral
from vllm_output_rate.limiter import BURST_NS, NS_PER_S, OutputRateLimiter

T0 = 5 * NS_PER_S


def limiter(rate, users=None) -> OutputRateLimiter:
    return OutputRateLimiter(Fraction(rate), users)


# -- unit ---------------------------------------------------------------------


def test_new_user_gets_burst_then_even_spacing():
    lim = limiter(10)  # one token per 100 ms, burst 100 ms -> 2 at once
    assert lim.try_take("a", T0)
    assert lim.try_take("a", T0)
    assert not lim.try_take("a", T0)
    assert lim.ready_at_ns("a") == T0 + 100_000_000
    assert not lim.try_take("a", T0 + 99_999_999)
    assert lim.try_take("a", T0 + 100_000_000)


def test_users_are_independent_and_overrides_apply():
    lim = limiter(1, {"fast": Fraction(1000)})
    assert lim.try_take("slow", T0)
    assert not lim.try_take("slow", T0)
    assert sum(lim.try_take("fast", T0) for _ in range(500)) == 101  # 0.1 s * 1000 + 1
    assert lim.rate_of("fast") == 1000 and lim.rate_of("other") == 1


def test_fractional_rate_is_exact():
    lim = limiter(Fraction(1, 2))  # 0.5 tok/s: one token every 2 s
    t = T0
    for _ in range(1000):
        assert lim.try_take("a", t)
        assert not lim.try_take("a", t)
        assert lim.ready_at_ns("a") == t + 2 * NS_PER_S - BURST_NS
        t += 2 * NS_PER_S
    # after 1000 tokens at exactly 2 s spacing, no drift at all
    assert lim.tat_ns("a") == t


def test_third_of_a_token_rounds_ready_at_up():
    lim = limiter(3)
    assert lim.try_take("a", T0)
    # TAT = T0 + 1/3 s, ready = TAT - 0.1 s, not an integer number of ns
    ready = lim.ready_at_ns("a")
    assert ready == math.ceil(T0 + NS_PER_S / 3 - BURST_NS)
    assert not lim.try_take("a", ready - 1)
    assert lim.try_take("a", ready)


def test_refund_gives_back_exactly_one():
    lim = limiter(10)
    lim.try_take("a", T0)
    lim.try_take("a", T0)
    before = lim.tat_ns("a")
    assert not lim.try_take("a", T0)
    lim.refund("a")
    assert lim.tat_ns("a") == before - 100_000_000
    assert lim.try_take("a", T0)
    assert not lim.try_take("a", T0)


def test_available_counts_consecutive_takes():
    lim = limiter(50)  # 20 ms each, burst 100 ms -> 6 at once
    assert lim.available("a", T0) == 6
    for expected in range(5, -1, -1):
        assert lim.try_take("a", T0)
        assert lim.available("a", T0) == expected
    assert lim.available("a", T0) == 0 and not lim.try_take("a", T0)


def test_cleanup_drops_only_idle_users():
    lim = limiter(10)
    lim.try_take("idle", T0)
    lim.try_take("busy", T0 + 10**9)
    dropped = lim.cleanup_idle_users(T0 + 10**9)
    assert dropped == ["idle"]
    assert "busy" in lim and "idle" not in lim


def test_bad_construction_is_refused():
    with pytest.raises(ValueError, match="positive"):
        OutputRateLimiter(Fraction(0))


# -- properties against a brute-force oracle ---------------------------------


class Oracle:
    """GCRA in exact rational seconds, straight from the definition."""

    def __init__(self, rate: Fraction, burst: Fraction = Fraction(1, 10)):
        self.rate, self.burst = rate, burst
        self.tat: dict[str, Fraction] = {}

    def take(self, user: str, now: Fraction) -> bool:
        tat = self.tat.get(user, now)
        if tat - now > self.burst:
            return False
        self.tat[user] = max(tat, now) + 1 / self.rate
        return True

    def refund(self, user: str) -> None:
        if user in self.tat:
            self.tat[user] -= 1 / self.rate


rates = st.one_of(
    st.integers(1, 2000).map(Fraction),
    st.fractions(min_value=Fraction(1, 100), max_value=Fraction(500), max_denominator=1000),
).filter(lambda r: r > 0)
# gaps between calls, in ns; zero gaps are common (several streams per step)
gaps = st.lists(st.one_of(st.just(0), st.integers(0, 300_000_000)), min_size=1, max_size=300)


@settings(max_examples=200, deadline=None)
@given(rate=rates, gaps=gaps, refunds=st.lists(st.booleans(), max_size=300))
def test_decisions_match_oracle(rate, gaps, refunds):
    lim, oracle = OutputRateLimiter(rate), Oracle(rate)
    t = T0
    for i, gap in enumerate(gaps):
        t += gap
        got = lim.try_take("u", t)
        assert got == oracle.take("u", Fraction(t, NS_PER_S))
        if got and i < len(refunds) and refunds[i]:
            lim.refund("u")
            oracle.refund("u")


@settings(max_examples=200, deadline=None)
@given(rate=rates, gaps=gaps)
def test_every_window_respects_the_bound(rate, gaps):
    """In every window W: tokens <= floor((W + 0.1) * rate) + 1."""
    lim = OutputRateLimiter(rate)
    t, times = T0, []
    for gap in gaps:
        t += gap
        while lim.try_take("u", t):  # greedy: take all that is allowed
            times.append(t)
    for i in range(len(times)):
        for j in range(i, len(times)):
            window = Fraction(times[j] - times[i], NS_PER_S)
            assert j - i + 1 <= math.floor((window + Fraction(1, 10)) * rate) + 1


@settings(max_examples=200, deadline=None)
@given(rate=rates, gaps=gaps)
def test_refused_call_changes_nothing(rate, gaps):
    lim = OutputRateLimiter(rate)
    t = T0
    for gap in gaps:
        t += gap
        before = (lim.tat_ns("u"), lim.ready_at_ns("u"), lim.available("u", t))
        if not lim.try_take("u", t):
            assert (lim.tat_ns("u"), lim.ready_at_ns("u"), lim.available("u", t)) == before


@settings(max_examples=200, deadline=None)
@given(rate=rates, gaps=gaps, extra=st.integers(0, 10**9))
def test_idle_user_gets_full_burst_back(rate, gaps, extra):
    lim = OutputRateLimiter(rate)
    t = T0
    for gap in gaps:
        t += gap
        lim.try_take("u", t)
    # TAT is at most burst + 1/rate ahead of the last call
    idle = BURST_NS + math.ceil(NS_PER_S / rate) + extra
    t += idle
    assert lim.available("u", t) == lim.available("never-seen", t)


@settings(max_examples=200, deadline=None)
@given(rate=rates, gaps=gaps, cleanup_at=st.sets(st.integers(0, 300)))
def test_cleanup_changes_nothing_observable(rate, gaps, cleanup_at):
    plain, cleaned = OutputRateLimiter(rate), OutputRateLimiter(rate)
    t = T0
    for i, gap in enumerate(gaps):
        t += gap
        if i in cleanup_at:
            cleaned.cleanup_idle_users(t)
        user = "ab"[i % 2]
        assert plain.available(user, t) == cleaned.available(user, t)
        assert plain.try_take(user, t) == cleaned.try_take(user, t)


@settings(max_examples=200, deadline=None)
@given(rate=rates, gaps=gaps)
def test_refund_restores_exactly_one_token(rate, gaps):
    lim = OutputRateLimiter(rate)
    t = T0
    for gap in gaps:
        t += gap
        before = lim.available("u", t)
        if lim.try_take("u", t):
            assert lim.available("u", t) == before - 1
            lim.refund("u")
            assert lim.available("u", t) == before
            assert lim.try_take("u", t)


@settings(max_examples=200, deadline=None)
@given(rate=rates, gaps=gaps, data=st.data())
def test_take_n_equals_n_single_takes(rate, gaps, data):
    """A step's net charge settled at once equals one try_take per token."""
    bulk, single = OutputRateLimiter(rate), OutputRateLimiter(rate)
    t = T0
    for gap in gaps:
        t += gap
        avail = bulk.available("u", t)
        assert avail == single.available("u", t)
        n = data.draw(st.integers(0, min(avail, 50)))
        bulk.take("u", t, n)
        for _ in range(n):
            assert single.try_take("u", t)
        assert bulk.available("u", t) == single.available("u", t)
        assert bulk.ready_at_ns("u") == single.ready_at_ns("u") or n == 0


@settings(max_examples=100, deadline=None)
@given(
    rate_list=st.lists(rates, min_size=1, max_size=4),
    gaps=gaps,
    data=st.data(),
)
def test_settle_equals_single_takes_per_user(rate_list, gaps, data):
    """settle() of a step's start/left budgets == try_take per token per user."""
    users = [f"u{i}" for i in range(len(rate_list))]
    per_user = dict(zip(users, rate_list))
    bulk = OutputRateLimiter(Fraction(1), per_user)
    single = OutputRateLimiter(Fraction(1), per_user)
    t = T0
    for gap in gaps:
        t += gap
        asked = data.draw(st.lists(st.sampled_from(users), unique=True))
        start = {u: bulk.available(u, t) for u in asked}
        left = {u: start[u] - data.draw(st.integers(0, min(start[u], 20))) for u in asked}
        bulk.settle(t, {u: start[u] - left[u] for u in asked})
        for u in asked:
            for _ in range(start[u] - left[u]):
                assert single.try_take(u, t)
        for u in users:
            assert bulk.available(u, t) == single.available(u, t)
            assert bulk.ready_at_ns(u) == single.ready_at_ns(u)


# -- live limit changes (set_limits) ---------------------------------------------


class ChangingOracle:
    """GCRA with limit changes, in exact rational tokens: a user's debt
    ``(TAT - now) * rate`` is kept in tokens across a change."""

    def __init__(self, rate: Fraction, burst: Fraction = Fraction(1, 10)):
        self.rate, self.burst = rate, burst
        self.tat: Fraction | None = None

    def margin(self, now: Fraction) -> Fraction:
        """Seconds left before the next take would be refused (< 0: refused)."""
        tat = now if self.tat is None else self.tat
        return self.burst - (tat - now)

    def take(self, now: Fraction) -> bool:
        if self.margin(now) < 0:
            return False
        tat = now if self.tat is None else max(self.tat, now)
        self.tat = tat + 1 / self.rate
        return True

    def change(self, rate: Fraction, now: Fraction) -> None:
        if self.tat is not None and self.tat > now:
            self.tat = now + (self.tat - now) * self.rate / rate
        self.rate = rate


# each event: (gap in ns, new limit or None)
change_events = st.lists(
    st.tuples(st.one_of(st.just(0), st.integers(0, 200_000_000)),
              st.one_of(st.none(), st.none(), rates)),
    min_size=1, max_size=200)


@settings(max_examples=300, deadline=None)
@given(rate=rates, events=change_events)
def test_limit_changes_match_the_oracle(rate, events):
    """Each change rounds the converted debt up by less than one ns, so the
    limiter may refuse where the oracle, within (changes so far) ns of its
    boundary, allows; it never allows what the oracle refuses."""
    lim, oracle = OutputRateLimiter(rate), ChangingOracle(rate)
    t, changes = T0, 0
    for gap, new_rate in events:
        t += gap
        if new_rate is not None:
            assert lim.set_limits(new_rate, None, t) == (
                ["u"] if "u" in lim and new_rate != oracle.rate else [])
            oracle.change(new_rate, Fraction(t, NS_PER_S))
            changes += 1
            assert lim.rate_of("u") == new_rate
            continue
        margin_ns = oracle.margin(Fraction(t, NS_PER_S)) * NS_PER_S
        got = lim.try_take("u", t)
        if got:
            assert margin_ns >= 0  # never beyond the exact bound
        if abs(margin_ns) > changes:
            assert got == (margin_ns >= 0)
        if got != (margin_ns >= 0):
            return  # the two diverged by a rounding, legitimately: stop here
        oracle.take(Fraction(t, NS_PER_S))


@settings(max_examples=300, deadline=None)
@given(rate=rates, events=change_events)
def test_bound_holds_piecewise_across_changes(rate, events):
    """Greedy taker; in every window [a, b]: tokens <= the integral of the
    limit over [a, b] + burst at the limit in force at the last token + 1
    (the old limit up to a change, the new one after it)."""
    lim = OutputRateLimiter(rate)
    t, times, in_force, schedule = T0, [], [], [(T0, rate)]  # (from ns, limit)
    for gap, new_rate in events:
        t += gap
        if new_rate is not None:
            lim.set_limits(new_rate, None, t)
            schedule.append((t, new_rate))
        while lim.try_take("u", t):
            times.append(t)
            in_force.append(schedule[-1][1])


    for i in range(len(times)):
        for j in range(i, min(len(times), i + 60)):
            a, b = times[i], times[j]
            bound = limit_integral(schedule, a, b) + in_force[j] * Fraction(BURST_NS, NS_PER_S) + 1
            assert j - i + 1 <= math.floor(bound), (a, b, schedule)


def test_raising_a_limit_mid_stream_speeds_up_at_once():
    lim = OutputRateLimiter(Fraction(10))
    t = T0
    while lim.try_take("u", t):  # burst spent: debt of 2 tokens (100 ms + 1 at 10/s)
        pass
    assert lim.ready_at_ns("u") == t + NS_PER_S // 10
    assert lim.set_limits(Fraction(40), None, t) == ["u"]
    # the same debt (2 tokens) at 40 tok/s, where the 100 ms burst is 4
    # tokens: 3 more at once (at 10 tok/s it was none for 100 ms)
    assert lim.available("u", t) == 3
    assert lim.ready_at_ns("u") == t + NS_PER_S // 20 - BURST_NS
    assert lim.set_limits(Fraction(40), {"v": Fraction(1)}, t) == []


def test_a_user_without_state_takes_the_new_limit():
    lim = OutputRateLimiter(Fraction(10), {"a": Fraction(5)})
    lim.set_limits(Fraction(20), {"b": Fraction(3)}, T0)
    assert lim.rate_of("a") == 20 and lim.rate_of("b") == 3
    assert lim.available("b", T0) == 1  # 100 ms at 3 tok/s: no extra token
    with pytest.raises(ValueError):
        lim.set_limits(Fraction(0), None, T0)
