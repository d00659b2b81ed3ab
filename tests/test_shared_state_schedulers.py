"""Shared-budget mode in vLLM's own Scheduler / AsyncScheduler: two real
schedulers on one fake clock sharing a user's budget through a real
``redis-server`` (Debian's, started here on a free loopback port), and
through a store outage: the fallback share, back at the limit, the fleet
bound in every window."""

from __future__ import annotations

from fractions import Fraction

import pytest

from stores import needs_redis, redis_server, store_url  # noqa: F401  (fixtures)
from vllm_output_rate.fleet_math import fleet_bound
from vllm_output_rate.limiter import NS_PER_S
from vllm_output_rate.tools.fleet_sim import worst_window_excess


# -- the real vLLM scheduler in shared-budget mode ------------------------------------

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


@needs_redis
@pytest.mark.parametrize("is_async", MODES)
def test_two_real_schedulers_share_one_users_budget(store_url, is_async, monkeypatch):
    """vLLM's own Scheduler / AsyncScheduler and KV cache manager, two of
    them on one fake clock, sharing user-a's budget through the real store;
    the lease threads' rounds run between steps (their threads off). The two
    are the ranks of ``--data-parallel-size 2`` (each rank's engine core is
    an engine of the fleet, named by its rank; the real engine's case is
    test_e2e_shared_state's data-parallel test, in ``make test-all``)."""
    from harness import Driver, VirtualClock, make_request
    from vllm_output_rate.ledger import OutputRateState
    from vllm_output_rate.tools.common.scheduler_driver import make_vllm_config, scheduler_for_config

    monkeypatch.setattr(OutputRateState, "watch_thread", False)
    clock = VirtualClock()
    limits = {"default_user_output_tokens_per_second": 20,
              "user_output_tokens_per_second": {"user-b": 1000},
              "shared_state": store_url}
    drivers, user_b = [], []
    for rank in range(2):
        vllm_config = make_vllm_config(limits, async_scheduling=is_async)
        vllm_config.parallel_config.data_parallel_size = 2
        vllm_config.parallel_config.data_parallel_index = rank
        sched = scheduler_for_config(vllm_config, clock=clock)
        # the engine's fleet name carries its rank (host:pid:rank:random)
        assert sched.output_rate.limiter.thread.engine_id.split(":")[2] == str(rank)
        drivers.append(Driver(sched, None, is_async=is_async))
        for _ in range(2):
            sched.add_request(make_request("user-a", max_tokens=400))
        user_b.append(make_request("user-b", max_tokens=400))
        sched.add_request(user_b[-1])
    first_step = clock()
    charged: list[tuple[int, int]] = []
    steps = 600  # 6 s at 10 ms
    for i in range(steps):
        now = clock()
        for drv in drivers:
            thread = drv.scheduler.output_rate.limiter.thread
            if i % 5 == 0 or drv.scheduler.output_rate.limiter.starved:
                thread.tick(now_us=now / 1000)
            drv.step()
            n = sum(1 for u in drv.scheduler.output_rate.last_step.charged.values() if u == "user-a")
            if n:
                charged.append((now, n))
        clock.advance_ms(10)
    total = sum(n for _, n in charged)
    warm = [(t, n) for t, n in charged if t >= first_step + 2 * NS_PER_S]
    rate = sum(n for _, n in warm) / 4.0
    assert 0.97 * 20 <= rate <= fleet_bound(4.0, 20, 0.5, 0.25) / 4.0, rate
    excess, window = worst_window_excess(charged, Fraction(20), 0.5, 0.25)
    assert excess <= 0, (excess, window)
    # both schedulers served user-a, and user-b beside it ran at full speed
    for drv, b in zip(drivers, user_b):
        assert drv.scheduler.output_rate.limiter.thread.live_engines == 2
        assert drv.scheduler.output_rate.limiter.book.spent > 0.25 * total
        # one token per step from its first lease on: done within 420 steps
        assert drv.finished.get(b.request_id) is not None
        assert drv.tokens[b.request_id][-1][0] <= 420
        drv.scheduler.shutdown()


@needs_redis
@pytest.mark.parametrize("is_async", MODES)
def test_two_real_schedulers_through_a_store_outage_on_one_clock(redis_server, is_async,
                                                                  monkeypatch):
    """test_e2e_shared_state's outage, on vLLM's own schedulers sharing one
    fake clock: user-a's four streams over two engines, the store stopped
    3 s in and started again empty 5 s later. Serving never stops; during
    the outage each engine runs user-a at its fallback share (20 / 2), the
    fleet at 20; after it they share again at the limit; and the fleet
    bound holds in every window across the outage and the reset. The
    store's time is the fake clock's (the lease rounds run between steps),
    so nothing here depends on how promptly this process runs."""
    from harness import VirtualClock, run_shared, shared_schedulers
    from stores import fresh_store
    from vllm_output_rate.ledger import OutputRateState

    url = fresh_store(redis_server)
    monkeypatch.setattr(OutputRateState, "watch_thread", False)
    clock = VirtualClock()
    # 5 s: a call timing out on a loaded machine would be a second fault
    # (its reply lost, a lease or report counted twice); the stopped store
    # refuses connections at once
    drivers = shared_schedulers([url + "?timeout_ms=5000"] * 2, clock, is_async)
    t0 = clock()
    marks = {}
    s = NS_PER_S

    def outage(i, now):
        if now == t0 + 3 * s:
            marks["down"] = now
            redis_server.stop()
        if now == t0 + 8 * s:
            redis_server.start()  # back, and empty: a store that lost its data
            marks["up"] = now

    spends = run_shared(drivers, clock, 1200, outage)  # 12 s at 10 ms
    fleet = sorted(spends[0] + spends[1])

    def tokens(of, lo, hi):
        return sum(n for t, n in of if lo <= t < hi)

    # serving never stopped: every engine spent in every second
    for k in range(2):
        assert all(tokens(spends[k], t0 + j * s, t0 + (j + 1) * s) > 0 for j in range(12)), k
    # during the outage (from a second after it began): each engine at its
    # fallback share, the fleet at the limit
    lo, hi = marks["down"] + s, marks["up"]
    seconds = (hi - lo) / s
    for k in range(2):
        share = tokens(spends[k], lo, hi) / seconds
        assert abs(share - 10) <= 1 / seconds, (k, share)  # to a token
    # after it (from a second after the restart): shared again, at the limit
    seconds = (clock() - marks["up"] - s) / s
    after = tokens(fleet, marks["up"] + s, clock()) / seconds
    assert abs(after - 20) <= 1 / seconds, after
    # the same bound across the outage and the reset
    excess, window = worst_window_excess(fleet, Fraction(20), 0.5, 0.25)
    assert excess <= 0, (excess, window)
    for drv in drivers:
        stats = drv.scheduler.output_rate.limiter.stats()
        assert stats["fallback_episodes"] == 1 and stats["fallback"] == 0.0, stats
        assert stats["failed_calls"] >= 2 and stats["unleased"] > 0, stats
        assert drv.scheduler.output_rate.limiter.book.spent > 0
        drv.scheduler.shutdown()
