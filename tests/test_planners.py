"""A step's planners (``planners``) as pure functions over plain requests,
a ledger and a state: the running order, the waiting requests with budget
first, the streams a rate keeps busy, and which resident requests residency
preempts for a slot. (Their effect on vLLM's scheduler: test_scheduler_slots.py,
test_borrowing_lending.py.)"""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

from vllm_output_rate.charges import choose
from vllm_output_rate.ledger import OutputRateState, StepLedger
from vllm_output_rate.limiter import OutputRateLimiter
from vllm_output_rate.observers import StepReport
from vllm_output_rate.planners import (
    budgeted_first,
    evictions,
    plan_running_order,
    sustained,
)

MS = 1_000_000


def request(user, n, served=0, arrival=0.0, prefill=False, priority=0):
    return SimpleNamespace(output_rate_user=user, request_id=f"{user}{n}", output_rate_served_ns=served,
                           arrival_time=arrival, is_prefill_chunk=prefill, priority=priority,
                           output_rate_state=None)


def state_and_step(rates, now=10**12, base_active=8):
    """A state over a plain limiter (``rates``: user -> tok/s, default 1000)
    and its step at ``now``."""
    st = OutputRateState(base_active=base_active, max_running=16, token_budget=64)
    choose(st, OutputRateLimiter(Fraction(1000), {u: Fraction(r) for u, r in rates.items()}), None)
    step = st.step = StepLedger(1, now, StepReport(1, now))
    step.charges = st.charges(st, step)
    return st, step


def test_the_running_order_is_left_alone_when_nobody_is_short():
    st, step = state_and_step({})
    running = [request("a", i) for i in range(3)]
    assert plan_running_order(running, st, step) is None


def test_the_running_order_rotates_and_puts_the_throttled_last():
    # a: 10 tok/s, 2 tokens in the burst at the step's start; three streams,
    # the one served longest ago first; b without a limit to speak of
    st, step = state_and_step({"a": 10})
    a0, a1, a2 = request("a", 0, served=30), request("a", 1, served=10), request("a", 2, served=20)
    b0 = request("b", 0)
    order = plan_running_order([a0, a1, b0, a2], st, step)
    assert order.short
    assert order.ready == [a1, a2, b0] and order.throttled == [a0]
    assert order.budget["a"] == 0
    # a waiting request's turn takes one of a's tokens
    st, step = state_and_step({"a": 10})
    step.turns = {"a"}
    order = plan_running_order([a0, a1, b0, a2], st, step)
    assert order.ready == [a1, b0] and order.throttled == [a2, a0]


def test_the_waiting_requests_with_budget_go_first_in_queue_order():
    st, step = state_and_step({"a": 10})
    # a has 2 tokens and one resident stream: its first waiting request is
    # within budget, its second is not; b has budget
    waiting = [request("a", 1), request("a", 2), request("b", 1)]
    got = budgeted_first(waiting, step.charges.left, {"a": 1})
    assert got == [waiting[0], waiting[2], waiting[1]]
    # already in that order: nothing to change
    assert budgeted_first([waiting[0], waiting[2], waiting[1]], step.charges.left, {"a": 1}) is None


def test_a_rate_keeps_busy_its_rate_times_the_step_period():
    assert sustained(Fraction(20), None) == 1
    assert sustained(Fraction(20), 25 * MS) == 1  # 0.5 rounded up
    assert sustained(Fraction(100), 25 * MS) == 3  # 2.5 rounded up
    assert sustained(Fraction(1, 10), 25 * MS) == 1


def test_evictions_take_the_latest_of_the_user_most_over_budget():
    st, step = state_and_step({"a": 10, "b": 10})
    st.period_ns = 25 * MS  # a rate of 10 tok/s keeps one stream busy
    a = [request("a", i, arrival=float(i)) for i in range(5)]
    b = [request("b", i, arrival=float(i)) for i in range(3)]
    running = a + b
    resident = {"a": 5, "b": 3}
    budgets = {"a": 0, "b": 0}
    waiting = [request("c", i) for i in range(4)]
    victims = evictions(waiting, running, resident, budgets, st, st.limiter.rate_of,
                        lambda r: True)
    # a: 5 streams, 1 kept busy (excess 4); b: 3 (excess 2): a's latest first
    # while its excess is the larger, never a stream its rate keeps busy
    assert victims == [a[4], a[3], a[2], b[2]]
    # not one whose blocks cannot be freed, nor one of the waiting request's own user
    victims = evictions([request("a", 9)], running, resident, budgets, st, st.limiter.rate_of,
                        lambda r: r is not b[2])
    assert victims == [b[1]]
    # a user with budget for its streams keeps them
    assert evictions(waiting, running, resident, {"a": 5, "b": 3}, st, st.limiter.rate_of,
                     lambda r: True) == []
