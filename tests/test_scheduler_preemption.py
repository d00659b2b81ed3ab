"""The real vLLM Scheduler / AsyncScheduler with output-rate limits under KV
pressure and aborts: throttled requests preempted first, refunds of what was
charged and not run, async scheduling's look-ahead, an abort mid-throttle.

Real KV cache manager, controlled model outputs, a fake clock (see harness);
every test on the four charge paths (scheduler_setup.charge_path).
"""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from harness import make_request, observe_steps
from scheduler_setup import charge_path  # noqa: F401  (autouse: every test on the four charge paths)
from scheduler_setup import MODES, limits, setup


# -- preemption --------------------------------------------------------------


def _kv_pressure(lim, policy, priorities=(0, 0, 0)):
    sched, drv, clock = setup(lim, False, num_blocks=8, block_size=16, policy=policy,
                              max_num_batched_tokens=256)
    a1 = make_request("a", prompt_len=31, max_tokens=200, priority=priorities[0], block_size=16)
    b1 = make_request("b", prompt_len=31, max_tokens=200, priority=priorities[1], block_size=16)
    b2 = make_request("b", prompt_len=31, max_tokens=200, priority=priorities[2], block_size=16)
    drv.add(a1)
    drv.step()
    drv.add(b1)
    drv.step()
    drv.add(b2)
    for _ in range(60):
        out = drv.step()
        if out.preempted_req_ids:
            return sched, out.preempted_req_ids, (a1, b1, b2)
    raise AssertionError("no preemption happened")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_kv_exhaustion_preempts_throttled_first(policy):
    sched, preempted, (a1, b1, b2) = _kv_pressure(limits(1, b=1000), policy)
    assert preempted == {a1.request_id}
    # upstream would have preempted the latest arrival of b
    _, preempted_up, (_, _, b2_up) = _kv_pressure(None, policy)
    assert preempted_up == {b2_up.request_id}


def test_priority_preference_stays_within_a_priority():
    # b2 has a lower priority (higher value): vLLM's choice stands.
    sched, preempted, (a1, b1, b2) = _kv_pressure(limits(1, b=1000), "priority", (0, 0, 1))
    assert preempted == {b2.request_id}


# -- refunds ---------------------------------------------------------------------


def test_failed_kv_allocation_is_refunded():
    sched, drv, clock = setup(limits(10, b=1000), False, num_blocks=5, block_size=16,
                              max_num_batched_tokens=256)
    b = make_request("b", prompt_len=60, max_tokens=100, block_size=16)  # 4 blocks
    drv.add(b)
    drv.step()
    a = make_request("a", prompt_len=20, max_tokens=5, block_size=16)
    drv.add(a)
    avail_before = sched.output_rate.limiter.available("a", clock())
    out = drv.step()
    assert a.request_id not in out.num_scheduled_tokens
    refunded = sched.output_rate.last_step.refunded
    assert (a.request_id, "a", "not_scheduled") in refunded
    assert sched.output_rate.limiter.available("a", clock()) == avail_before


@pytest.mark.parametrize("is_async", [False, True])
def test_charged_by_user_is_the_net_of_charges_and_refunds(is_async):
    """The per-user net charge the step settles (and telemetry counts) is,
    in every step, the users of the requests charged and kept in that step:
    with throttled users, a capped active set and KV pressure (refunds)."""
    from collections import Counter

    sched, drv, _ = setup(limits(1000, slow=30), is_async, num_blocks=12, block_size=16,
                          max_num_seqs=8, max_num_active_seqs=4, max_num_batched_tokens=256)
    steps = []
    observe_steps(sched, lambda rec: steps.append(
        (dict(rec.charged_by_user), Counter(rec.charged.values()), len(rec.refunded))))
    for i in range(10):
        drv.add(make_request(["slow", "fast", "other"][i % 3], prompt_len=20 + i, max_tokens=30,
                             block_size=16))
    drv.run_until_done()
    assert steps and all(by_user == dict(counted) for by_user, counted, _ in steps)
    assert any(refunds for *_, refunds in steps)  # KV pressure did refund


def test_self_preempted_request_is_refunded():
    sched, drv, clock = setup(limits(1000), False, num_blocks=3, block_size=16)
    a = make_request("a", prompt_len=31, max_tokens=100, block_size=16)
    drv.add(a)
    refunds = []
    observe_steps(sched, lambda rec: refunds.extend(rec.refunded))
    for _ in range(40):
        out = drv.step()
        if out.preempted_req_ids:
            break
    assert (a.request_id, "a", "preempted") in refunds


# -- async look-ahead and aborts ------------------------------------------------


def test_async_lookahead_overcharges_at_most_one_per_request():
    sched, drv, _ = setup(limits(1000), True)
    charged: dict[str, int] = {}

    def observe(rec):
        for rid in rec.charged:
            charged[rid] = charged.get(rid, 0) + 1

    observe_steps(sched, observe)
    reqs = [make_request("a", max_tokens=50, ignore_eos=False) for _ in range(5)]
    drv.add(*reqs)
    # the model emits EOS for request i after 10 + i tokens
    stop_at = {r.request_id: 10 + i for i, r in enumerate(reqs)}
    real = drv._apply

    def apply(out, mro):
        for i, rid in enumerate(mro.req_ids):
            if mro.sampled_token_ids[i] and len(drv.tokens[rid]) + 1 >= stop_at[rid]:
                mro.sampled_token_ids[i] = [1]
        real(out, mro)

    drv._apply = apply
    drv.run_until_done()
    drv.flush()
    for r in reqs:
        delivered = drv.count(r.request_id)
        assert delivered == stop_at[r.request_id]
        assert delivered <= charged[r.request_id] <= delivered + 1


@pytest.mark.parametrize("is_async", MODES)
def test_abort_mid_throttle_frees_everything(is_async):
    sched, drv, _ = setup(limits(1), is_async)
    reqs = [make_request("a", prompt_len=40, max_tokens=50) for _ in range(3)]
    drv.add(*reqs)
    drv.run(5)
    assert sched.output_rate.last_step.throttled
    free_before = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    sched.finish_requests([r.request_id for r in reqs], RequestStatus.FINISHED_ABORTED)
    drv.flush()
    drv.step()
    assert not sched.running and not sched.has_requests()
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() > free_before
    assert sched.kv_cache_manager.usage == 0
