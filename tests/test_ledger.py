"""The output-rate state's pure parts (``ledger``, ``ordering.beyond_resident``):
the waiting requests within their users' budgets beyond their resident
streams, and the one KV-room check."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.ledger import OutputRateState
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
