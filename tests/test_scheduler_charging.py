"""The real vLLM Scheduler / AsyncScheduler with output-rate limits: the
class installed, what is charged and when (the rate, fair sharing within a
user, one question per user a step), and prompts whose user has no budget.

Real KV cache manager, controlled model outputs, a fake clock (see harness);
every test on the four charge paths (scheduler_setup.charge_path).
"""

from __future__ import annotations

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from harness import make_request, make_scheduler, scheduled_ids
from scheduler_setup import charge_path  # noqa: F401  (autouse: every test on the four charge paths)
from scheduler_setup import MODES, ahead, exhaust, limits, setup
from vllm_output_rate import config as orl_config
from vllm_output_rate import core as orl_core
from vllm_output_rate import request_fields
from vllm_output_rate.charges import DirectCharges, SettledCharges
from vllm_output_rate.scheduler import OutputRateAsyncScheduler, OutputRateScheduler


def test_each_charge_path_is_the_one_that_runs(charge_path):
    sched, drv, _ = setup(ahead(limits(1000, a=1)))
    drv.add(make_request("a", max_tokens=4), make_request("a", max_tokens=4))
    drv.step()
    drv.step()
    # a's first request decodes without budget; its second is one short of
    # its first token (refused at the charge point, as a prefill)
    throttled = sched.output_rate.last_step.throttled
    assert len(throttled) == 2
    held = sched.output_rate.last_step.held_back
    assert held == (1 if charge_path.startswith("held") else 0)
    assert len(sched.running) == 2  # held-back requests are back after the step
    assert type(sched.output_rate.step.charges) is (
        SettledCharges if charge_path.endswith("settled") else DirectCharges)
    # vLLM's own hooks only: nothing of ours set on the instance per step
    assert "_reserve_prefill_lookahead" not in sched.__dict__
    assert "allocate_slots" not in sched.kv_cache_manager.__dict__


# -- installation ---------------------------------------------------------------


@pytest.mark.parametrize("is_async", MODES)
def test_feature_off_is_upstream_class(is_async):
    sched = make_scheduler(None, async_scheduling=is_async)
    assert type(sched) is (AsyncScheduler if is_async else Scheduler)


@pytest.mark.parametrize("is_async", MODES)
def test_feature_on_picks_matching_variant(is_async):
    sched = make_scheduler(limits(10), async_scheduling=is_async)
    assert type(sched) is (OutputRateAsyncScheduler if is_async else OutputRateScheduler)
    assert isinstance(sched, AsyncScheduler) == is_async


def _trace(lim, is_async):
    """Schedule decisions of a mixed workload, step by step."""
    sched, drv, _ = setup(lim, is_async, max_num_seqs=4, max_num_batched_tokens=64)
    reqs = [make_request(u, prompt_len=p, max_tokens=m, req_id=f"{u}-{i}")
            for i, (u, p, m) in enumerate([("a", 100, 20), ("b", 10, 30), ("a", 40, 5),
                                           ("c", 70, 12), (None, 5, 25), ("b", 3, 8)])]
    drv.add(*reqs)
    trace = []
    while sched.has_requests():
        out = drv.step()
        trace.append((dict(out.num_scheduled_tokens), sorted(out.preempted_req_ids),
                      sorted(out.finished_req_ids)))
    drv.flush()
    return trace, {r: len(t) for r, t in drv.tokens.items()}


@pytest.mark.parametrize("is_async", MODES)
def test_limits_that_never_bind_schedule_exactly_like_upstream(is_async):
    upstream = _trace(None, is_async)
    limited = _trace(limits(10**6), is_async)
    assert limited == upstream


# -- charging -------------------------------------------------------------------


@pytest.mark.parametrize("is_async", MODES)
def test_charge_only_on_sampling_steps(is_async):
    sched, drv, _ = setup(limits(1000), is_async, max_num_batched_tokens=32)
    req = make_request("a", prompt_len=100, max_tokens=5)
    drv.add(req)
    charges = []
    for _ in range(4):  # 32 + 32 + 32 + 4 prompt tokens
        out = drv.step()
        charges.append((out.num_scheduled_tokens[req.request_id],
                        sched.output_rate.last_step.charged))
    assert [c[1] for c in charges[:3]] == [{}, {}, {}]
    assert charges[3] == (4, {req.request_id: "a"})  # final chunk samples: 1
    out = drv.step()
    assert sched.output_rate.last_step.charged == {req.request_id: "a"}  # decode: 1


@pytest.mark.parametrize("is_async", MODES)
def test_rate_is_the_limit_and_tokens_complete(is_async):
    sched, drv, clock = setup(limits(20), is_async)
    reqs = [make_request("a", max_tokens=100) for _ in range(4)]
    t0 = clock()
    drv.add(*reqs)
    drv.run_until_done()
    assert all(drv.count(r.request_id) == 100 for r in reqs)
    assert all(drv.finished[r.request_id] == "length" for r in reqs)
    times = sorted(t for r in reqs for _, t in drv.tokens[r.request_id])
    span_s = (times[-1] - times[0]) / 1e9
    # GCRA bound: n <= (W + 0.1) * rate + 1, and no slower than one step late
    assert len(times) <= (span_s + 0.1) * 20 + 1
    assert len(times) - 1 >= (span_s - 0.1 - 0.02) * 20
    assert t0 <= times[0]


@pytest.mark.parametrize("is_async", MODES)
def test_four_streams_share_evenly(is_async):
    """4 streams of one user, 400 tokens each: at every step within 1 token."""
    sched, drv, _ = setup(limits(100), is_async)
    reqs = [make_request("a", max_tokens=400) for _ in range(4)]
    drv.add(*reqs)
    while sched.has_requests():
        drv.step()
        counts = [drv.count(r.request_id) for r in reqs]
        assert max(counts) - min(counts) <= 1, counts
    drv.flush()
    assert [drv.count(r.request_id) for r in reqs] == [400] * 4


@pytest.mark.parametrize("is_async", MODES)
def test_streams_of_different_priority_rotate_separately(is_async):
    sched, drv, _ = setup(limits(50), is_async, policy="priority")
    high = [make_request("a", max_tokens=60, priority=0) for _ in range(2)]
    low = [make_request("a", max_tokens=60, priority=1) for _ in range(2)]
    drv.add(*high, *low)
    drv.run(40)
    h = [drv.count(r.request_id) for r in high]
    assert abs(h[0] - h[1]) <= 1


@pytest.mark.parametrize("is_async", MODES)
def test_throttled_user_never_delays_another(is_async):
    sched, drv, _ = setup(limits(5, b=10**6), is_async)
    a = [make_request("a", max_tokens=50) for _ in range(6)]
    b = [make_request("b", max_tokens=60) for _ in range(2)]
    drv.add(*a, *b)
    drv.step()  # prefills
    for _ in range(58):
        out = drv.step()
        assert {r.request_id for r in b} <= scheduled_ids(out)
    assert sched.output_rate.last_step.throttled  # a was being throttled


@pytest.mark.parametrize("is_async", MODES)
def test_refused_user_is_asked_once_per_step(is_async, monkeypatch):
    sched, drv, _ = setup(ahead(limits(1)), is_async)
    drv.add(*[make_request("a", max_tokens=10) for _ in range(8)])
    drv.run(3)
    calls = []
    real = sched.output_rate.limiter.available
    monkeypatch.setattr(sched.output_rate.limiter, "available",
                        lambda u, now: calls.append(u) or real(u, now))
    drv.step()
    assert len(sched.output_rate.last_step.throttled) == 8
    assert calls == ["a"]


def test_user_is_resolved_once_per_request(monkeypatch):
    calls = []
    real = request_fields.resolve_user
    monkeypatch.setattr(orl_core, "resolve_user", lambda x: calls.append(x) or real(x))
    sched, drv, _ = setup(limits(50))
    reqs = [make_request("a", max_tokens=30), make_request(None, max_tokens=30)]
    drv.add(*reqs)
    drv.run_until_done()
    assert len(calls) == 2
    assert [r.output_rate_user for r in reqs] == ["a", orl_config.ANONYMOUS_USER]


# -- prefill when the budget is gone --------------------------------------------


@pytest.mark.parametrize("is_async", MODES)
def test_chunked_prefill_stops_one_short_without_budget(is_async):
    sched, drv, clock = setup(ahead(limits(2)), is_async)
    exhaust(sched, drv)
    req = make_request("a", prompt_len=50, max_tokens=3)
    drv.add(req)
    out = drv.step()
    assert out.num_scheduled_tokens == {req.request_id: 49}
    assert sched.output_rate.last_step.charged == {}
    assert req.status == RequestStatus.RUNNING
    for _ in range(10):
        out = drv.step()
        assert req.request_id not in out.num_scheduled_tokens
    drv.run_until_done()
    drv.flush()
    assert drv.count(req.request_id) == 3


@pytest.mark.parametrize("is_async", MODES)
def test_without_chunked_prefill_prefill_waits_whole_and_others_pass(is_async):
    sched, drv, _ = setup(limits(2, b=1000), is_async, enable_chunked_prefill=False)
    exhaust(sched, drv)
    a = make_request("a", prompt_len=50, max_tokens=3)
    b = make_request("b", prompt_len=20, max_tokens=3)
    drv.add(a, b)
    out = drv.step()
    assert out.num_scheduled_tokens == {b.request_id: 20}
    assert a.status == RequestStatus.WAITING
    drv.run_until_done()
    drv.flush()
    assert drv.count(a.request_id) == 3 and drv.count(b.request_id) == 3


@pytest.mark.parametrize("is_async", MODES)
def test_full_prefix_hit_without_budget_does_not_block_others(is_async):
    """A prompt whose cache hit leaves only its last token cannot be held one
    short: it must be skipped, not stop admission for everyone behind it."""
    sched, drv, _ = setup(limits(1, b=1000), is_async)
    prompt = list(range(100, 133))  # 33 tokens: 2 full blocks + 1
    first = make_request("a", prompt=prompt, max_tokens=1)
    drv.add(first)
    drv.run_until_done()
    drv.flush()
    exhaust(sched, drv)
    again = make_request("a", prompt=prompt, max_tokens=2)
    other = make_request("b", prompt_len=10, max_tokens=2)
    drv.add(again, other)
    out = drv.step()
    assert other.request_id in out.num_scheduled_tokens
    assert again.request_id not in out.num_scheduled_tokens
    drv.run_until_done()
    drv.flush()
    assert drv.count(again.request_id) == 2


def _has_cache_aware_admission() -> bool:
    from vllm.config import SchedulerConfig

    return "cache_aware_admission_window" in SchedulerConfig.__dataclass_fields__


@pytest.mark.skipif(not _has_cache_aware_admission(),
                    reason="cache-aware admission is vLLM 0.34's")
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prefill"])
@pytest.mark.parametrize("is_async", MODES)
def test_cache_aware_admission_never_admits_a_user_past_its_budget(is_async, chunked):
    """vLLM 0.34 moves waiting requests with a cached prefix ahead of cold
    ones (``--cache-aware-admission-window``). A throttled user's requests
    moved to the front are still held (chunked prefill: one short of their
    first token; otherwise not admitted), charged nothing, and the cold
    request of another user behind them starts in the same step."""
    sched, drv, clock = setup(limits(1, b=1000), is_async, enable_chunked_prefill=chunked,
                              scheduler_options={"cache_aware_admission_window": 8,
                                                 "cache_aware_admission_threshold": 0.0})
    assert sched.cache_aware_window == 8
    prefix = list(range(100, 164))  # 4 full blocks
    warm = make_request("a", prompt=prefix + [5], max_tokens=1)
    drv.add(warm)
    drv.run_until_done()
    drv.flush()
    exhaust(sched, drv)
    orders = []
    upstream = sched._reorder_waiting_by_cached_prefix

    def reorder():
        upstream()
        orders.append([r.request_id for r in sched.waiting])

    sched._reorder_waiting_by_cached_prefix = reorder
    cold = make_request("b", prompt_len=70, max_tokens=3)
    hot = [make_request("a", prompt=prefix + [6, 7, i], max_tokens=3) for i in range(2)]
    drv.add(cold, *hot)
    out = drv.step()
    # the premise: vLLM put a's cached requests ahead of b's cold one
    assert orders and orders[0][-1] == cold.request_id, orders
    assert cold.request_id in out.num_scheduled_tokens
    assert set(sched.output_rate.last_step.charged.values()) == {"b"}
    for request in hot:
        scheduled = out.num_scheduled_tokens.get(request.request_id, 0)
        if chunked:  # held one short of the first token
            assert request.num_computed_tokens <= request.num_tokens - 1
        else:
            assert scheduled == 0 and request.status == RequestStatus.WAITING
    # a's budget returns 0.9 s after it was spent (1 tok/s, 100 ms burst):
    # none of a's tokens before that
    for _ in range(80):
        drv.step()
    assert all(drv.count(r.request_id) == 0 for r in hot)
    drv.run_until_done()
    drv.flush()
    assert all(drv.count(r.request_id) == 3 for r in [cold, *hot])
