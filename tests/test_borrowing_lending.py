"""Borrowing in the real vLLM ``Scheduler`` / ``AsyncScheduler`` on a virtual
clock (see harness): what is lent and to whom, a guaranteed user served at
once beside borrowers, the leftover split by guaranteed rates, borrowers
never displacing a request within its guaranteed rate (a property over
random workloads), and borrowers preempted first under KV pressure.

A limit ``{rate: R, ceiling: C}`` gives a user R for sure and up to C of the
capacity nobody within its guaranteed rate uses; the ceiling is a second
GCRA. These tests read what the scheduler dispatched from its step reports
(``charged``: guaranteed tokens, ``borrowed``: lent ones; borrowing_setup).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from borrowing_setup import MODES, check_bound, limits, rate, setup, tokens
from harness import make_request
from vllm_output_rate.config import UNLIMITED


# -- lending in the scheduler -----------------------------------------------------


@pytest.mark.parametrize("is_async", MODES)
def test_a_user_alone_borrows_what_the_engine_has(is_async):
    """Unlimited ceiling, nobody else: as fast as with the feature off."""
    sched, drv, clock, steps = setup(limits(1000, {"a": 5}, {"a": UNLIMITED}), is_async)
    drv.add(*[make_request("a", max_tokens=200) for _ in range(4)])
    drv.run(150)
    spends = tokens(steps, "a")
    assert rate(spends) == pytest.approx(400, rel=0.01)  # 4 streams, a token each per 10 ms step
    borrowed = sum(n for _, n in tokens(steps, "a", ("borrowed",)))
    assert borrowed > 0.9 * sum(n for _, n in spends)


@pytest.mark.parametrize("is_async", MODES)
def test_a_finite_ceiling_is_a_gcra_of_its_own(is_async):
    sched, drv, clock, steps = setup(limits(1000, {"a": 5}, {"a": 50}), is_async)
    drv.add(*[make_request("a", max_tokens=400) for _ in range(4)])
    drv.run(600)
    spends = tokens(steps, "a")
    check_bound(spends, 50)
    assert rate(spends) >= 0.98 * 50
    # the guaranteed GCRA was charged only for its share: 5 tok/s
    guaranteed = tokens(steps, "a", ("charged",))
    check_bound(guaranteed, 5)


@pytest.mark.parametrize("is_async", MODES)
def test_a_guaranteed_user_arriving_gets_its_rate_at_once(is_async):
    """a borrows every active slot; b (no ceiling) arrives and is served at
    its guaranteed rate from its first step, while a keeps the rest."""
    sched, drv, clock, steps = setup(limits(1000, {"a": 5, "b": 20}, {"a": UNLIMITED}),
                                     is_async, max_num_seqs=32, max_num_active_seqs=4)
    drv.add(*[make_request("a", max_tokens=2000) for _ in range(8)])
    drv.run(100)
    assert rate(tokens(steps, "a")) == pytest.approx(400, rel=0.02)  # 4 active slots
    arrival = clock()
    reqs = [make_request("b", max_tokens=100) for _ in range(4)]
    drv.add(*reqs)
    drv.run(300)
    b = tokens(steps, "b", since=arrival)
    first = b[0][0]
    assert first - arrival <= (2 if is_async else 1) * 10_000_000  # its first step
    check_bound(b, 20)
    assert rate(b) >= 0.99 * 20
    assert not tokens(steps, "b", ("borrowed",))
    # a keeps what b leaves of the 4 active slots
    a_after = tokens(steps, "a", since=first + 10**9)
    assert rate(a_after) >= 0.9 * (400 - 20)


@pytest.mark.parametrize("is_async", MODES)
def test_a_borrowers_streams_take_turns_at_what_it_gets_not_at_its_guaranteed_rate(is_async):
    """Sixteen streams of a user at 20 tok/s guaranteed, unlimited ceiling,
    in 8 active slots: every stream gets a token every other step (the
    user's 800 tok/s split 16 ways), its guaranteed and borrowed tokens in
    one rotation. Before, a borrowed stream was not counted served, so the
    streams just lent a token took the guaranteed ones next, and a stream
    waited up to 11 steps for its turn at the guaranteed rate (the fairness
    benchmark's overload and flood scenarios showed it)."""
    sched, drv, clock, steps = setup(limits(1000, {"a": 20}, {"a": UNLIMITED}), is_async,
                                     max_num_seqs=32, max_num_active_seqs=8)
    reqs = [make_request("a", max_tokens=3000) for _ in range(16)]
    drv.add(*reqs)
    drv.run(300)
    served: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for i, s in enumerate(steps[50:], 50):
        for req_id in (*s.charged, *s.borrowed):
            served[req_id].append(i)
    assert rate(tokens(steps, "a", since=steps[50].now_ns)) == pytest.approx(800, rel=0.02)
    assert sum(1 for s in steps[50:] for _ in s.charged) > 0  # guaranteed tokens among them
    gaps = [b - a for times in served.values() for a, b in zip(times, times[1:])]
    assert max(gaps) <= 3, Counter(gaps)


@pytest.mark.parametrize("is_async", MODES)
def test_a_waiting_borrower_chosen_keeps_its_slot_from_prompts_computed_ahead(is_async):
    """Both users borrow every slot (4 active); f, who borrowed most, has
    prompts waiting ahead of s's new request. s's request comes first in
    lending order: it is admitted and lent its first token in the step it
    arrives at, not after f's prompts, computed ahead without budget, took
    its active slot (the flood's victims at GPU scale waited a step so,
    1.44x their no-flood TTFT p99)."""
    sched, drv, clock, steps = setup(
        limits(1000, {"f": 1, "s": 1}, {"f": UNLIMITED, "s": UNLIMITED}), is_async,
        max_num_seqs=32, max_num_active_seqs=4)
    drv.add(*[make_request("f", max_tokens=3000, prompt_len=32) for _ in range(3)])
    drv.run(50)
    drv.add(make_request("s", max_tokens=3000, prompt_len=32))
    drv.run(50)
    for _ in range(200):  # s has just spent its guaranteed token: its next request borrows
        if "s" in steps[-1].charged.values():
            break
        drv.step()
    drv.add(*[make_request("f", max_tokens=3000, prompt_len=32) for _ in range(6)])
    late = make_request("s", max_tokens=30, prompt_len=32)
    drv.add(late)
    came = clock()
    drv.run(6)
    s_tokens = [t for s in steps if s.now_ns >= came
                for t in [s.now_ns] if late.request_id in (*s.charged, *s.borrowed)]
    assert s_tokens and s_tokens[0] - came <= (1 if is_async else 0) * 10_000_000, s_tokens


@pytest.mark.parametrize("is_async", MODES)
def test_leftover_is_split_in_proportion_to_guaranteed_rates(is_async):
    sched, drv, clock, steps = setup(
        limits(1000, {"a": 10, "c": 30}, {"a": UNLIMITED, "c": UNLIMITED}),
        is_async, max_num_seqs=32, max_num_active_seqs=4)
    drv.add(*[make_request(u, max_tokens=3000) for u in ("a", "c") for _ in range(8)])
    drv.run(500)
    since = steps[100].now_ns
    a, c = rate(tokens(steps, "a", since=since)), rate(tokens(steps, "c", since=since))
    assert a + c == pytest.approx(400, rel=0.02)
    assert c / a == pytest.approx(3, rel=0.05)


@pytest.mark.parametrize("is_async", MODES)
def test_a_step_keeps_a_slot_for_a_waiting_request_with_budget_and_lends_the_rest(is_async):
    """Four active slots, a borrower's four streams in them: a request of a
    user with budget arrives; in that very step it is admitted and charged,
    and the borrower has the three slots left (work conserving)."""
    sched, drv, clock, steps = setup(limits(1000, {"a": 5, "b": 20}, {"a": UNLIMITED}), is_async,
                                     max_num_seqs=16, max_num_active_seqs=4)
    drv.add(*[make_request("a", max_tokens=500) for _ in range(4)])
    drv.run(50)
    assert all(len(s.borrowed) >= 3 for s in steps[-10:])
    b = make_request("b", max_tokens=20, prompt_len=8)
    drv.add(b)
    index = len(steps)
    drv.run(3)
    first = steps[index]
    assert list(first.charged.values()).count("b") == 1 and b.request_id in first.charged
    # the three other slots to a: lent, or charged when its 5 tok/s allow
    assert len(first.borrowed) >= 2 and set(first.borrowed.values()) == {"a"}
    assert len(first.charged) + len(first.borrowed) == 4
    for s in steps[index + 1:]:  # b decodes within its budget (20 tok/s, 10 ms steps)
        assert len(s.charged) + len(s.borrowed) == 4


@pytest.mark.parametrize("is_async", MODES)
def test_no_lending_while_a_user_with_budget_waits_for_a_resident_slot(is_async):
    """A waiting request whose user has budget, and the resident set full
    of a borrower's streams: one of them is preempted and the request runs
    in the step (the next with a step in flight); the step that made room
    lends nothing."""
    sched, drv, clock, steps = setup(limits(1000, {"a": 5}, {"a": UNLIMITED}), is_async,
                                     max_num_seqs=4)
    a = [make_request("a", max_tokens=500) for _ in range(4)]
    drv.add(*a)
    drv.run(50)
    assert any(s.borrowed for s in steps[-5:])  # a borrows the idle engine
    b = make_request("b", max_tokens=20)
    drv.add(b)  # resident slots full: one of a's goes
    before = len(steps)
    first = None
    for k in range(1, 6):
        drv.step()
        if first is None and drv.count(b.request_id):
            first = k
    assert first is not None and first <= (3 if is_async else 2)
    evicted = [r for s in steps[before:] for r in s.preempted_throttled]
    assert len(evicted) == 1 and evicted[0] in {r.request_id for r in a}
    assert not steps[before].borrowed  # (the step that made room lent nothing)
    assert len(sched.running) <= 4


@pytest.mark.parametrize("is_async", MODES)
def test_a_borrower_gets_its_share_of_the_resident_slots(is_async):
    """Two users with the same guaranteed rate, both unlimited above it: a
    heavy one borrows the idle engine with more streams than resident
    slots; a light one arrives with more streams than its budget covers.
    Each is kept resident slots up to its share (half here), the heavy
    user's streams preempted for the light one's, and the borrowed tokens
    are split evenly from then on (within 5%). Without the shares the light user keeps
    the one slot its budget won and borrows a quarter of what it should."""
    sched, drv, clock, steps = setup(limits(1000, {"heavy": 5, "light": 5},
                                            {"heavy": UNLIMITED, "light": UNLIMITED}),
                                     is_async, max_num_seqs=8, max_num_active_seqs=4)
    drv.add(*[make_request("heavy", max_tokens=3000) for _ in range(16)])
    drv.run(50)
    drv.add(*[make_request("light", max_tokens=3000) for _ in range(8)])
    drv.run(50)  # settle
    since = clock()
    drv.run(200)
    lent = Counter(u for s in steps if s.now_ns >= since for u in s.borrowed.values())
    assert lent["light"] >= 0.95 * lent["heavy"] > 0, lent
    # the heavy user down to its share; the light one as many as it borrows with
    resident = Counter(r.output_rate_user for r in sched.running)
    assert resident["heavy"] <= 4 and resident["light"] >= 2, resident


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    users=st.lists(st.tuples(st.sampled_from([2, 5, 20, 50]),
                             st.sampled_from([None, 10, 100, UNLIMITED]),
                             st.integers(1, 6), st.integers(0, 40)),
                   min_size=2, max_size=4),
    active=st.sampled_from([3, 6, 16]),
    is_async=st.booleans(),
    kv=st.sampled_from([None, (10, "fcfs"), (10, "priority"), (20, "priority")]),
    priorities=st.lists(st.integers(0, 1), min_size=4, max_size=4),
)
# cases a clean clone's run found: a slot freed from a user with budget
# while another's without budget were there; a waiting stream's turn
# (``residency``) counted twice against its user's budget while another borrowed
@example(users=[(2, None, 5, 0), (5, None, 6, 18), (5, 10, 6, 28)], active=3, is_async=False,
         kv=None, priorities=[0, 0, 0, 0])
@example(users=[(2, 10, 1, 0), (50, None, 4, 0)], active=3, is_async=False, kv=None,
         priorities=[0, 0, 0, 0])
def test_borrowers_never_displace_a_request_within_its_guaranteed_rate(
        users, active, is_async, kv, priorities):
    """In every step that lends, every user got every guaranteed token it
    had budget and live requests for; under KV pressure (a few blocks, FCFS
    or priority), no request of a user with budget is preempted while a
    request lent tokens in that step keeps its blocks."""
    check_no_displacement(users, active, is_async, kv, priorities)


@pytest.mark.parametrize("is_async", MODES)
def test_the_displacement_check_sees_lending_steps(is_async):
    """The property above is not vacuous: this workload lends in most steps
    (and the same check holds)."""
    users = [(5, UNLIMITED, 6, 0), (20, None, 3, 10), (2, 100, 4, 30)]
    assert check_no_displacement(users, 4, is_async) >= 60


def check_no_displacement(users, active, is_async, kv=None, priorities=(0, 0, 0, 0)) -> int:
    """Run ``users`` (rate, ceiling, requests, first step) for 120 steps;
    the number of steps that lent. ``kv``: (KV blocks of 16 tokens, policy)
    for a cache that runs short, the users' ``priorities`` in order."""
    rates, ceilings = {}, {}
    for i, (r, c, _, _) in enumerate(users):
        rates[f"u{i}"] = r
        if c is not None and (c == UNLIMITED or c >= r):
            ceilings[f"u{i}"] = c
    pressure = {}
    if kv is not None:
        pressure = dict(num_blocks=kv[0], block_size=16, policy=kv[1],
                        max_num_batched_tokens=256)
    sched, drv, clock, steps = setup(limits(1000, rates, ceilings), is_async,
                                     max_num_seqs=16, max_num_active_seqs=active, **pressure)
    budget_at = {}

    def before_step():
        limiter, now = sched.output_rate.limiter, clock()
        budget_at[len(steps)] = {u: min(limiter.available(u, now),
                                        sched.output_rate.lender.available(u, now) if sched.output_rate.lender else 10**9)
                                 for u in rates}

    arrivals = sorted((start, f"u{i}", n) for i, (_, _, n, start) in enumerate(users))
    lent = 0
    for step in range(120):
        for start, user, n in arrivals:
            if start == step:
                priority = priorities[int(user[1:])]
                drv.add(*[make_request(user, max_tokens=60, prompt_len=8, priority=priority,
                                       **({"block_size": 16} if pressure else {}))
                          for _ in range(n)])
        # requests that may get a token in this step (with async scheduling,
        # one whose tokens in flight already reach max_tokens may not)
        live = Counter(r.output_rate_user for r in list(sched.running) + list(sched.waiting)
                       if r.num_output_tokens + getattr(r, "num_output_placeholders", 0)
                       < r.sampling_params.max_tokens)
        before_step()
        index = len(steps)
        out = drv.step()
        report = steps[index]
        lent_kept = set(report.borrowed) & {r.request_id for r in sched.running}
        if lent_kept:
            for req_id in out.preempted_req_ids:
                victim = sched.requests[req_id]
                if victim.output_rate_borrow_step == report.step:
                    continue  # a borrower itself (its user's budget went to another)
                user = victim.output_rate_user
                assert budget_at[index][user] <= 0, (step, req_id, user, lent_kept)
        if not report.borrowed:
            continue
        lent += 1
        got = Counter(report.charged.values())
        for user, n in live.items():
            assert got[user] >= min(budget_at[index][user], n), (step, user, got, live)
    return lent


def test_kv_exhaustion_preempts_borrowers_first():
    """Under KV pressure (FCFS), vLLM preempts the tail of ``running``: the
    borrower goes before a throttled request and a request with budget."""
    sched, drv, clock, steps = setup(limits(1000, {"a": 1, "c": 1}, {"a": UNLIMITED}), False,
                                     num_blocks=10, block_size=16, max_num_batched_tokens=256)
    reqs = {}
    for user in ("a", "c", "b"):
        reqs[user] = make_request(user, prompt_len=31, max_tokens=300, block_size=16)
        drv.add(reqs[user])
        drv.step()
    for _ in range(100):
        out = drv.step()
        if out.preempted_req_ids:
            assert out.preempted_req_ids == {reqs["a"].request_id}
            assert any(s.borrowed for s in steps)  # a was borrowing
            return
    raise AssertionError("no preemption happened")


@pytest.mark.parametrize("priorities", [(0, 0, 0), (0, 1, 1), (1, 0, 0)],
                         ids=["same-priority", "borrower-above-the-others", "borrower-below-the-others"])
def test_priority_policy_preempts_borrowers_first(priorities):
    """With ``--scheduling-policy priority`` vLLM would preempt the lowest
    priority's latest arrival; the borrower goes first whatever its priority,
    before the throttled request and the one with budget."""
    sched, drv, clock, steps = setup(limits(1000, {"a": 1, "c": 1}, {"a": UNLIMITED}), False,
                                     num_blocks=10, block_size=16, max_num_batched_tokens=256,
                                     policy="priority")
    reqs = {}
    for user, priority in zip(("a", "c", "b"), priorities):
        reqs[user] = make_request(user, prompt_len=31, max_tokens=300, block_size=16,
                                  priority=priority)
        drv.add(reqs[user])
        drv.step()
    for _ in range(100):
        out = drv.step()
        if out.preempted_req_ids:
            assert out.preempted_req_ids == {reqs["a"].request_id}, (
                {u for u, r in reqs.items() if r.request_id in out.preempted_req_ids})
            assert any(s.borrowed for s in steps)  # a was borrowing
            assert any(reqs["a"].request_id in s.preempted_throttled for s in steps)
            return
    raise AssertionError("no preemption happened")
