"""The real vLLM Scheduler with output-rate limits when nobody has budget and
users go idle: the engine loop's wait (at most 50 ms, to the next budget),
and the limiter's cleanup of idle users, which changes nothing scheduled.

Real KV cache manager, controlled model outputs, a fake clock (see harness);
every test on the four charge paths (scheduler_setup.charge_path).
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from harness import make_request
from scheduler_setup import charge_path  # noqa: F401  (autouse: every test on the four charge paths)
from scheduler_setup import limits, setup
from vllm_output_rate import core as orl_core


# -- engine-loop wait ------------------------------------------------------------


def test_idle_wait_is_min_of_50ms_and_next_ready():
    sched, drv, clock = setup(limits(Fraction(1, 2)), False)
    drv.add(make_request("a", max_tokens=5))
    drv.step()
    out = drv.step()
    assert out.total_num_scheduled_tokens == 0
    assert sched.output_rate_idle_wait_s() == pytest.approx(0.05)
    ready = sched.output_rate_wake_target_ns()
    clock.now_ns = ready - 3_000_000
    assert sched.output_rate_idle_wait_s() == pytest.approx(0.003)
    clock.now_ns = ready + 1
    assert sched.output_rate_idle_wait_s() == 0.0


def test_no_wait_when_nobody_is_refused():
    sched, drv, _ = setup(limits(1000), False)
    drv.add(make_request("a", max_tokens=5))
    drv.step()
    assert sched.output_rate_idle_wait_s() is None


def test_a_requests_kept_state_is_always_its_users_state_in_the_limiter(monkeypatch):
    # The lean hook charges the state kept on the request; the limiter
    # drops idle users (here every 3 steps: the never-binding users are
    # idle at every cleanup) and a request that arrives later must not
    # start a second state beside the kept one.
    monkeypatch.setattr(orl_core, "CLEANUP_EVERY_STEPS", 3)
    sched, drv, _ = setup(limits(10**6, b=30))
    limiter = sched.output_rate.limiter
    reqs = [make_request(u, max_tokens=60) for u in "aab"]
    drv.add(*reqs)
    dropped = []
    cleanup = limiter.cleanup_idle_users

    def counted_cleanup(now):
        users = cleanup(now)
        dropped.extend(users)
        return users

    monkeypatch.setattr(limiter, "cleanup_idle_users", counted_cleanup)
    for step in range(50):
        if step in (5, 11, 17):
            later = [make_request("a", max_tokens=30), make_request("b", max_tokens=30)]
            reqs += later
            drv.add(*later)
        drv.step()
        for request in sched.requests.values():
            kept = request.output_rate_state
            assert kept is None or kept is limiter._users.get(request.output_rate_user), step
    assert "a" in dropped  # (the case above happened)
    b_tokens = sum(drv.count(r.request_id) for r in reqs if r.output_rate_user == "b")
    assert b_tokens >= 30 * 0.5 - 2
    assert b_tokens <= 30 * 0.5 + 3 + 1  # 50 steps of 10 ms at 30 tok/s, + burst + 1


def test_cleanup_every_256_steps_changes_nothing():
    def run(every):
        orl_core.CLEANUP_EVERY_STEPS = every
        try:
            sched, drv, _ = setup(limits(7, b=3))
            reqs = [make_request(u, max_tokens=40) for u in "ababc"]
            drv.add(*reqs)
            drv.run_until_done()
            return {r.request_id[-1]: drv.tokens[r.request_id] for r in reqs}, len(sched.output_rate.limiter)
        finally:
            orl_core.CLEANUP_EVERY_STEPS = 256

    with_cleanup, users_left = run(3)
    without, _ = run(10**9)
    assert [v for v in with_cleanup.values()] == [v for v in without.values()]
