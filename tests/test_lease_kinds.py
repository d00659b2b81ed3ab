"""Each kind of a user's fleet-wide budgets (its rate, ceiling and prompt
budget: ``lease_store.KIND_KEYS``, each a lane of the lease thread) asked
for and counted as the rate is: a user the store cut is asked for again at
its share when it runs short (``fleet_math.LeaseSizer``), so a ceiling and a
prompt budget cost the store as many entries as a rate; the lease counters
by kind (``shared_tokens_*``, ``shared_store_entries``). Against a real
``redis-server``, on a fake clock (``tools.fleet_sim``)."""

from __future__ import annotations

import math
from fractions import Fraction

from vllm_output_rate.fleet_math import LeaseSizer
from vllm_output_rate.lease_store import CEILING, KIND_KEYS, PROMPT, RATE
from vllm_output_rate.limiter import NS_PER_S
from vllm_output_rate.shared_settings import SharedStateSettings
from vllm_output_rate.tools.fleet_sim import T0_NS

# (the fixtures and helpers of the modules beside: one Redis, budget fleets)
from test_fleet_budgets import budgets_fleet, check_kinds, needs_redis
from test_long_slices import fresh, redis_server  # noqa: F401


def test_a_user_the_store_cut_is_asked_for_at_its_share_when_it_runs_short():
    """A user the store granted less than asked (a retry set) keeps its
    demand while it waits; when the retry falls due and it neither spent
    nor ran short since, it is not asked for (its demand over two ticks
    would come whole and run out a tick later: a second ask per retry);
    once it runs short, it is asked for at its share until the next ask."""
    settings_ = SharedStateSettings("redis://x:1")
    sizer = LeaseSizer(settings_, CEILING)
    limit = lambda u: Fraction(60)  # noqa: E731
    tick = int(settings_.tick_s * NS_PER_S)
    t = T0_NS
    (ask,) = sizer.asks(t, {"u": 3}, set(), {}, {}, {"u": 4}, {}, limit)
    retry = {"u": t + sizer.retry_ns}  # cut: granted less than asked
    demand = sizer.demand["u"]
    for k in (1, 2):  # waiting: no ask, no decay
        assert sizer.asks(t + k * tick, {}, set(), {}, {}, {"u": 4}, retry, limit) == []
        assert sizer.demand["u"] == demand
    due = t + 3 * tick
    assert retry["u"] <= due
    assert sizer.asks(due, {}, set(), {}, {}, {"u": 4}, retry, limit) == []
    (short,) = sizer.asks(due + tick, {}, {"u"}, {}, {}, {"u": 4}, {}, limit)
    cover = sizer.retry_ns / NS_PER_S + 2 * settings_.tick_s
    assert short.want == math.ceil(60 / 4 * cover)  # its share, to the next ask


@needs_redis
def test_a_users_ceiling_and_prompt_budget_are_asked_for_as_often_as_its_rate(redis_server):
    """Users on four of eight engines each, every engine wanting more of
    each budget than the fleet gives: each kind's entries per second (the
    ``shared_store_entries`` counters by kind) within a tenth of the rate's
    (before, the ceiling's and the prompt budget's were about twice the
    rate's: an ask at each retry for the demand over two ticks, granted
    whole, and another a tick later, cut), every budget at its limit."""
    import random

    at = fresh(redis_server)
    fleet = budgets_fleet(at, SharedStateSettings(at), seed=7, step_s=0.05)
    engines = [fleet.add_engine() for _ in range(8)]
    rng = random.Random(1)
    users = [f"user-{i}" for i in range(24)]
    for user in users:
        for engine in rng.sample(engines, 4):
            engine.streams[user], engine.prompts[user] = 2, 200
    fleet.run(3.0)

    def entries() -> dict[str, int]:
        out = dict.fromkeys(KIND_KEYS, 0)
        for engine in engines:
            for kind, k in engine.limiter.stats()["kinds"].items():
                out[kind] += k["entries_ok"]
        return out

    before, start = entries(), fleet.now_ns
    fleet.run(3.0)
    per_user = {k: (n - before[k]) / 3.0 / len(users) for k, n in entries().items()}
    print(f"\nentries per user per second: {per_user}")
    for kind in (CEILING, PROMPT):
        assert abs(per_user[kind] - per_user[RATE]) <= 0.1 * per_user[RATE], per_user
    for user in users[:4]:
        assert 0.95 * 20 <= fleet.spent(user, start) / 3.0 <= 21
        for kind, (limit, _) in fleet.budgets.items():
            got = sum(n for t, n in fleet.kind_spends[kind][user] if t >= start) / 3.0
            assert 0.95 * float(limit) <= got <= 1.05 * float(limit), (user, kind, got)
        check_kinds(fleet, user)


@needs_redis
def test_the_lease_counters_say_which_kind_asked_failed_and_fell_back(redis_server):
    """The lease machinery's counters per kind of budget (the ``kind``
    label of ``shared_tokens_*`` and ``shared_store_entries``, three values):
    an engine leasing a user's rate, ceiling and prompt budget through a
    store outage counts each kind's entries asked (in calls answered and
    failed), tokens leased and spent, and tokens spent in fallback; a lane
    closed (reloaded limits without ceilings) keeps its counters; the
    exporter writes one series per kind and result."""
    from types import SimpleNamespace

    from vllm_output_rate.telemetry.export import SnapshotWriter
    from vllm_output_rate.telemetry.metrics import (
        SHARED_STORE_ENTRIES, SHARED_TOKENS_LEASED, SHARED_TOKENS_UNLEASED)

    at = fresh(redis_server)
    fleet = budgets_fleet(at, SharedStateSettings(at, timeout_s=0.05), seed=3)
    engine = fleet.add_engine()
    engine.streams, engine.prompts = {"u": 2}, {"u": 300}
    fleet.run(1.0)
    redis_server.stop()
    try:
        fleet.run(1.0)
    finally:
        redis_server.start()
    fleet.run(1.0)
    kinds = engine.limiter.stats()["kinds"]
    assert kinds.keys() == {RATE, CEILING, PROMPT}
    for kind, k in kinds.items():
        assert k["entries_ok"] > 0 and k["entries_failed"] > 0, (kind, k)
        assert k["leased"] >= k["spent"] > 0 and k["unleased"] > 0, (kind, k)
    # each kind asked and spent apart: the prompt budget's tokens are its own
    assert kinds[PROMPT]["spent"] > 5 * kinds[RATE]["spent"]
    counters: dict = {}
    SnapshotWriter._fold_shared_state(SimpleNamespace(_store_call_hist=None),
                                      {**engine.limiter.stats(), "call_seconds": []}, counters, {})
    for kind in (RATE, CEILING, PROMPT):
        assert counters[SHARED_STORE_ENTRIES.key(kind, "failed")] == kinds[kind]["entries_failed"]
        assert counters[SHARED_TOKENS_UNLEASED.key(kind)] == kinds[kind]["unleased"]
    assert SHARED_TOKENS_LEASED.key() not in counters  # no series without its kind
    leased = kinds[CEILING]["leased"]
    engine.others[CEILING].close()  # the ceilings go (reloaded limits)
    fleet.run(0.5)
    after = engine.limiter.stats()["kinds"][CEILING]
    assert after["leased"] == leased and after["entries_ok"] >= kinds[CEILING]["entries_ok"]
