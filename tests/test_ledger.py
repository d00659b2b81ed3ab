"""The output-rate state's pure parts (``ledger``, ``charges``,
``ordering.beyond_resident``): the waiting requests within their users'
budgets beyond their resident streams, the one KV-room check, and the three
kinds of charges (direct, settled, with ceilings)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.borrowing import Lender
from vllm_output_rate.charges import CeilingCharges, DirectCharges, SettledCharges, choose
from vllm_output_rate.config import OutputRateConfig
from vllm_output_rate.ledger import LendingBook, OutputRateState, StepLedger
from vllm_output_rate.limiter import OutputRateLimiter
from vllm_output_rate.observers import StepReport
from vllm_output_rate.ordering import beyond_resident

USERS = st.sampled_from("abcd")


def waiting_of(users: list[str]) -> list[SimpleNamespace]:
    return [SimpleNamespace(output_rate_user=u, request_id=str(i)) for i, u in enumerate(users)]


@settings(deadline=None)  # (a loaded machine: no wall-clock deadline)
@given(st.lists(USERS, max_size=30), st.dictionaries(USERS, st.integers(-3, 6)),
       st.dictionaries(USERS, st.integers(0, 4)))
def test_beyond_resident_counts_each_users_budget_down_in_queue_order(users, budgets, resident):
    waiting = waiting_of(users)
    asked = []

    def left(user):
        asked.append(user)
        return budgets.get(user, 0)

    got = list(beyond_resident(waiting, left, resident))
    assert [r for r, _, _ in got] == waiting
    for position, (request, n, first) in enumerate(got):
        user = request.output_rate_user
        before = users[:position].count(user)
        # the budget less the resident streams, less one a request before it
        assert n == budgets.get(user, 0) - resident.get(user, 0) - before
        assert first == (before == 0)
    # each user asked once, when its first request is reached
    assert asked == list(dict.fromkeys(users))


def test_beyond_resident_asks_no_user_the_loop_does_not_reach():
    asked = []
    gen = beyond_resident(waiting_of(["a", "a", "b"]), lambda u: asked.append(u) or 1, {})
    assert next(gen)[1:] == (1, True)
    assert next(gen)[1:] == (0, False)
    assert asked == ["a"]


def state(free: int, groups: int = 1, block_size: int = 16, step_tokens: int = 64):
    st_ = OutputRateState(groups=groups, block_size=block_size, free_blocks=lambda: free)
    st_.step_blocks = st_.blocks_for(step_tokens)
    return st_


def test_blocks_for_is_one_more_than_the_tokens_fill_per_group():
    assert state(0).blocks_for(1) == 2
    assert state(0).blocks_for(16) == 2
    assert state(0).blocks_for(17) == 3
    assert state(0, groups=2).blocks_for(17) == 6


def test_kv_fits_counts_requests_tokens_and_kept_blocks():
    # 3 resident requests (a block each) + a step's prefill (64 tokens: 5 blocks)
    assert state(8).kv_fits(3)
    assert not state(7).kv_fits(3)
    # 20 tokens (3 blocks) beside 4 kept blocks
    assert state(7).kv_fits(0, 20, 4)
    assert not state(6).kv_fits(0, 20, 4)
    # two groups: everything twice
    assert state(16, groups=2).kv_fits(3)
    assert not state(15, groups=2).kv_fits(3)


# -- the charges --------------------------------------------------------------------


class SettledLimiter(OutputRateLimiter):
    """The plain limiter's arithmetic, charged the settled way."""


RATES = {"a": 20, "b": 55}
MS = 1_000_000


def charging(limiter, lender=None, free_blocks=10**6):
    st_ = OutputRateState(base_active=8, token_budget=64, free_blocks=lambda: free_blocks)
    choose(st_, limiter, lender)
    return st_


def begin(st_, now):
    st_.step_no += 1
    step = st_.step = StepLedger(st_.step_no, now, StepReport(st_.step_no, now))
    step.charges = st_.charges(st_, step)
    if st_.lender is not None:  # (the step's room, as ``lending.plan_lending`` makes it)
        step.lending = LendingBook(st_.base_active, st_.token_budget, st_.kv_fits)
    return step


def test_the_charges_are_chosen_by_the_limiter_and_the_lender():
    config = OutputRateConfig.from_dict({"default_user_output_tokens_per_second": 5,
                                         "user_output_tokens_per_second": {"a": 5},
                                         "ceilings": {"a": 50}})
    assert charging(OutputRateLimiter(5)).charges is DirectCharges
    assert charging(SettledLimiter(5)).charges is SettledCharges
    assert charging(OutputRateLimiter(5), Lender(config)).charges is CeilingCharges
    assert charging(SettledLimiter(5), Lender(config)).charges is CeilingCharges


#: a step's charge-point calls: take (request index) or refund (request index)
OPS = st.lists(st.tuples(st.sampled_from(["take", "refund"]), st.integers(0, 5)), max_size=40)


@settings(deadline=None)  # (a loaded machine: no wall-clock deadline)
@given(st.lists(OPS, min_size=1, max_size=6), st.lists(st.integers(0, 120), min_size=6, max_size=6))
def test_settled_charges_are_the_direct_ones_settled_once(steps, gaps):
    """Taken and given back in a step, then settled once, a user's budget is
    where token-by-token charging leaves it: the same answers, the same
    limiter afterwards."""
    direct, settled = OutputRateLimiter(10, RATES), SettledLimiter(10, RATES)
    d_state, s_state = charging(direct), charging(settled)
    requests = [[SimpleNamespace(output_rate_state=None) for _ in range(6)] for _ in range(2)]
    users = ["a", "b", "c", "a", "b", "a"]
    now = 0
    for ops, gap in zip(steps, gaps):
        now += gap * MS
        d, s = begin(d_state, now).charges, begin(s_state, now).charges
        taken: list[int] = []
        for op, i in ops:
            user = users[i]
            if op == "take":
                got = d.take(requests[0][i], user)
                assert s.take(requests[1][i], user) == got
                if got:
                    taken.append(i)
            elif i in taken:
                taken.remove(i)
                d.refund(user)
                s.refund(user)
            assert d.left(user) == s.left(user)
        report = StepReport(0, now)
        d.settle(report, {})
        s.settle(report, {})
        assert report.charged_by_user == {u: n for u in RATES.keys() | {"c"}
                                          if (n := sum(users[i] == u for i in taken))}
        for user in "abc":  # (a state made and given back is a new user's)
            for later in (0, 10 * MS, 50 * MS, 200 * MS):
                assert direct.available(user, now + later) == settled.available(user, now + later)


def test_ceiling_charges_take_lend_set_aside_and_settle():
    config = OutputRateConfig.from_dict({"default_user_output_tokens_per_second": 10,
                                         "user_output_tokens_per_second": {"a": 10},
                                         "ceilings": {"a": 40}})
    lender = Lender(config)
    limiter = OutputRateLimiter(10)
    st_ = charging(limiter, lender)
    step = begin(st_, 0)
    charges = step.charges
    # a's budget (2 tokens in the burst at 10 tok/s) under its ceiling (5 at 40 tok/s)
    assert charges.left("a") == min(limiter.available("a", 0), lender.available("a", 0)) == 2
    request = SimpleNamespace(request_id="r1", output_rate_borrow_step=-1)
    assert charges.take(request, "a") and charges.take(request, "a")
    assert not charges.take(request, "a")
    assert charges.ceiling_left("a") == 3
    # lent only to a request chosen in this step, within the room
    assert not charges.lend(request, "a", 1)
    request.output_rate_borrow_step = step.no
    assert charges.lend(request, "a", 1)
    charges.give(request, 1)
    assert charges.ceiling_left("a") == 2 and charges.lent == {"a": 1}
    assert not charges.lend(request, "a", 65)  # (beyond the step's token budget)
    # a turn's token set aside from both, and put back when the loop reaches it
    charges.refund("a")  # one guaranteed token given back
    assert charges.left("a") == 1 and charges.ceiling_left("a") == 3
    charges.set_aside("w1", "a")
    assert charges.left("a") == 0 and step.turn_ids == {"w1": "a"}
    charges.put_back("w1")
    assert charges.left("a") == 1 and not step.turn_ids
    charges.set_aside("w2", "a")  # never reached: back, uncharged, when the step ends
    report = step.report
    report.borrowed["r1"] = "a"
    charges.settle(report, {"r1": 1})
    assert not step.turn_ids
    # one guaranteed token and one lent on a's ceiling; one guaranteed on its budget
    assert report.charged_by_user == {"a": 1}
    assert lender.available("a", 0) == 5 - 2 and limiter.available("a", 0) == 2 - 1
    assert lender.served["a"] == 1 / 10
    # a lent token not dispatched is given back
    step = begin(st_, 0)
    charges = step.charges
    request.output_rate_borrow_step = step.no
    assert charges.take(request, "a") and not charges.take(request, "a")
    assert charges.lend(request, "a", 1)
    step.report.borrowed["r1"] = "a"
    charges.settle(step.report, {})
    assert not step.report.borrowed and lender.available("a", 0) == 3 - 1
