"""The real vLLM Scheduler / AsyncScheduler with output-rate limits in a full
engine: throttled requests keep their KV cache and give their active slots
away, and a request whose user has budget gets a resident slot at once
(examples and a property over random workloads), without preempting streams
that only pace.

Real KV cache manager, controlled model outputs, a fake clock (see harness);
every test on the four charge paths (scheduler_setup.charge_path).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from harness import make_request, observe_steps
from scheduler_setup import charge_path  # noqa: F401  (autouse: every test on the four charge paths)
from scheduler_setup import MODES, ahead, exhaust, limits, setup


# -- throttled requests give their place away ---------------------------------


@pytest.mark.parametrize("is_async", MODES)
def test_throttled_requests_keep_kv_and_free_active_slots(is_async):
    sched, drv, _ = setup(ahead(limits(1, b=1000)), is_async, max_num_seqs=8, max_num_active_seqs=4)
    a = [make_request("a", max_tokens=20) for _ in range(4)]
    drv.add(*a)
    drv.step()
    drv.step()
    b = [make_request("b", max_tokens=20) for _ in range(6)]
    drv.add(*b)
    for _ in range(3):
        out = drv.step()
    # a's four streams are throttled but resident, with their blocks
    assert all(r in sched.running for r in a)
    assert all(sched.kv_cache_manager.get_block_ids(r.request_id)[0] for r in a)
    # their active slots went to b; resident requests stay <= max_num_seqs
    assert len(sched.running) == 8
    active = [r for r in sched.running if r.request_id in out.num_scheduled_tokens]
    assert len(active) == 4
    assert all(r.output_rate_user == "b" for r in active)


@pytest.mark.parametrize("is_async", MODES)
def test_active_cap_goes_to_longest_waiting_user(is_async):
    sched, drv, clock = setup(limits(1000), is_async, max_num_seqs=8, max_num_active_seqs=2)
    # fill running with 8 resident requests: no throttling, so only 2 run per step
    users = ["u0", "u1", "u2", "u3"]
    reqs = [make_request(u, max_tokens=200) for u in users for _ in range(2)]
    sched.max_num_active_reqs = 8
    drv.add(*reqs)
    drv.step()
    sched.max_num_active_reqs = 2
    served = {u: 0 for u in users}
    for _ in range(40):
        out = drv.step()
        for rid in out.num_scheduled_tokens:
            served[sched.requests[rid].output_rate_user] += 1
    # every user got its turn: 80 slots over 4 users
    assert all(18 <= n <= 22 for n in served.values()), served


# -- resident slots --------------------------------------------------------------


@pytest.mark.parametrize("is_async", MODES)
def test_a_user_within_budget_is_not_kept_out_by_throttled_residents(is_async):
    """A heavy user's throttled streams fill every resident slot; a light
    user with budget arrives: its request runs at once, in place of one of
    the heavy user's (preempted: its KV freed, back in ``waiting``), and the
    light user keeps its rate while the heavy one still asks for more than
    its own. Upstream keeps the light user waiting until a slot frees."""
    sched, drv, clock = setup(ahead(limits(20)), is_async, max_num_seqs=8, max_num_active_seqs=2)
    heavy = [make_request("heavy", max_tokens=2000) for _ in range(12)]
    drv.add(*heavy)
    drv.run(100)  # 1 s: eight resident, four waiting, all of them throttled
    assert sum(r.output_rate_user == "heavy" for r in sched.running) == 8
    light = [make_request("light", max_tokens=40) for _ in range(2)]
    drv.add(*light)
    evicted = []
    observe_steps(sched, lambda rec: evicted.extend(rec.preempted_throttled))
    heavy_before = sum(drv.count(r.request_id) for r in heavy)
    steps_to_first = {}
    for k in range(1, 301):  # 3 s
        drv.step()
        for r in light:
            if drv.count(r.request_id) and r.request_id not in steps_to_first:
                steps_to_first[r.request_id] = k
    # one step to be scheduled (two with a step in flight)
    assert max(steps_to_first.values()) <= (3 if is_async else 2), steps_to_first
    assert sum(drv.count(r.request_id) for r in light) >= 0.99 * 20 * 2.8
    # a slot each, taken from the heavy user once (no back and forth), and
    # the heavy user still at its rate
    assert len(evicted) == len(light) and {sched.requests[r].output_rate_user
                                           for r in evicted if r in sched.requests} == {"heavy"}
    heavy_tokens = sum(drv.count(r.request_id) for r in heavy) - heavy_before
    assert 0.97 * 20 * 3 <= heavy_tokens <= (3 + 0.1) * 20 + 1
    assert len(sched.running) <= 8


@pytest.mark.parametrize("ceiling", [None, 300, "unlimited"])
@pytest.mark.parametrize("is_async", MODES)
def test_a_users_second_stream_takes_turns_with_its_first_in_a_full_engine(is_async, ceiling):
    """A heavy user's throttled streams (or, with a ceiling, borrowing
    streams) fill every resident slot; a light user's first stream comes
    and runs, taking its whole budget, then its second comes: it gets a
    resident slot (one of the heavy user's preempted) at the light user's
    next token and the two take turns. Before, the second waited for the
    first to end: 2.9 s at 20 tok/s for 60 tokens (the real engine showed
    it with a borrower in the slots)."""
    lim = ahead(limits(5, light=20))
    if ceiling is not None:
        lim["ceilings"] = {"heavy": ceiling}
    sched, drv, clock = setup(lim, is_async, step_ms=5.0, max_num_seqs=16,
                              max_num_active_seqs=8)
    heavy = [make_request("heavy", prompt_len=20, max_tokens=900) for _ in range(16)]
    drv.add(*heavy)
    drv.run(400)  # 2 s: sixteen resident, throttled at 5 tok/s
    assert sum(r.output_rate_user == "heavy" for r in sched.running) == 16
    first, second = (make_request("light", prompt_len=20, max_tokens=60) for _ in range(2))
    drv.add(first)
    drv.run(5)
    assert drv.count(first.request_id) >= 1
    drv.add(second)
    came = clock()
    t_first = None
    for _ in range(200):  # 1 s
        drv.step()
        if t_first is None and drv.count(second.request_id):
            t_first = clock() - came
    # at the light user's next token or the one after: 20 tok/s is a token per 50 ms
    assert t_first is not None and t_first <= 110_000_000, t_first
    # the two share the light user's 20 tok/s from then on
    assert abs(drv.count(first.request_id) - 5 - drv.count(second.request_id)) <= 3
    assert len(sched.running) <= 16


@pytest.mark.parametrize("is_async", MODES)
def test_a_flood_of_prompts_computed_ahead_does_not_hold_back_a_user_with_budget(is_async):
    """A user out of budget queues 12 prompts of 64 tokens (their prefills
    computed ahead, one position short, beside the step's others), then a
    user with budget queues one: its prompt is computed and its first
    token sampled in the first step, as without the flood. Before, the
    flood's prompts, first in the queue, took the 256-token budget of the
    first three steps and the user with budget waited behind them."""
    sched, drv, _ = setup(ahead(limits(1, b=1000)), is_async, max_num_seqs=32,
                          max_num_active_seqs=8, max_num_batched_tokens=256)
    exhaust(sched, drv)
    flood = [make_request("a", prompt_len=64, max_tokens=50) for _ in range(12)]
    b = make_request("b", prompt_len=64, max_tokens=5)
    drv.add(*flood, b)
    out = drv.step()
    assert out.num_scheduled_tokens[b.request_id] == 64
    assert sched.output_rate.last_step.charged == {b.request_id: "b"}
    # the token budget's rest to the flood's prompts, one position short
    assert sum(out.num_scheduled_tokens.values()) == 256
    assert all(n <= 63 for r, n in out.num_scheduled_tokens.items() if r != b.request_id)
    drv.step()
    drv.flush()
    assert drv.count(b.request_id) >= 1  # its first token, from the first step
    # the queue's own order kept within each part: the flood's in arrival order
    waiting = [r for r in sched.waiting if r.output_rate_user == "a"]
    assert waiting == sorted(waiting, key=lambda r: r.arrival_time)


@pytest.mark.parametrize("is_async", MODES)
def test_streams_pacing_below_a_streams_speed_are_not_preempted_for_slots(is_async):
    """Every user limited below what one stream gets (20 tok/s, a stream
    100 tok/s at a 10 ms step): each resident stream is throttled most
    steps between its tokens, which is pacing, not piling up. New users
    with budget arriving do not preempt them (each preempted stream would
    be recomputed and preempt another in its turn: before, 8 resident
    streams and 8 newcomers preempted each other every step, and served
    about half the tokens); a user's streams beyond what its rate keeps
    busy still give way (the test above)."""
    sched, drv, clock = setup(limits(20), is_async, max_num_seqs=8, max_num_active_seqs=8)
    first = [make_request(f"old{i}", max_tokens=60) for i in range(8)]
    drv.add(*first)
    drv.run(50)
    assert len(sched.running) == 8
    evicted = []
    observe_steps(sched, lambda rec: evicted.extend(rec.preempted_throttled))
    later = [make_request(f"new{i}", max_tokens=60) for i in range(8)]
    drv.add(*later)
    for _ in range(600):  # 6 s: the first eight end (60 tokens at 20 tok/s), the later ones run
        drv.step()
    assert evicted == []
    assert all(drv.count(r.request_id) == 60 for r in first)
    assert all(drv.count(r.request_id) >= 0.97 * 20 * 2.5 for r in later)
    assert len(sched.running) <= 8


@hsettings(max_examples=20, deadline=None,
           suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seqs=st.integers(6, 12), spare=st.integers(0, 4), flood=st.integers(1, 3),
       heavy_rate=st.sampled_from([2, 5, 10]), arrivals=st.lists(
           st.tuples(st.integers(0, 2), st.integers(5, 60)), min_size=1, max_size=6),
       is_async=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]))
def test_a_request_with_budget_gets_a_resident_slot_at_once(seqs, spare, flood, heavy_rate,
                                                            arrivals, is_async, policy):
    """Random workloads: a heavy user opens one to three times as many
    streams as there are resident slots, at a rate that throttles them;
    light users send one request at a time (gaps of a few steps to half a
    second), each with budget when it arrives and active slots to spare.
    Every light request gets its first token in the step after it arrives
    (one more with a step in flight), whatever the heavy user holds."""
    active = min(seqs, 5 + spare)
    sched, drv, clock = setup(limits(heavy_rate, l0=100, l1=100, l2=100), is_async,
                              max_num_seqs=seqs, max_num_active_seqs=active, policy=policy)
    drv.add(*[make_request("heavy", max_tokens=5000) for _ in range(flood * seqs)])
    drv.run(30)
    waits = []
    for user, gap in arrivals:
        drv.run(gap)
        request = make_request(f"l{user}", max_tokens=3)
        drv.add(request)
        for k in range(1, 6):
            drv.step()
            if drv.count(request.request_id):
                break
        waits.append(k)
        for _ in range(100):  # one at a time (3 tokens at 100 tok/s: a few steps)
            if request.request_id not in sched.requests:
                break
            drv.step()
    assert max(waits) <= (2 if is_async else 1), waits
    assert len(sched.running) <= seqs
