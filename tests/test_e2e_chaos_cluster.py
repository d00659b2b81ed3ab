"""The fleet's faults on Redis Cluster, on real engines: two vLLM CPU
engines sharing one user's budget through a real 3-shard Redis Cluster
(Debian's ``redis-server`` in cluster mode on loopback, a replica for each
master), while the user streams on both (issue 49's chaos matrix: "a shard
failover").

The shard that holds the user's keys fails over mid-stream (``CLUSTER
FAILOVER`` on its replica: the replica becomes the master, the slot map
names another node). Checked as ``test_e2e_chaos`` checks every case: every
stream completes with all its tokens; the fleet bound holds over every
window (engine-side, both engines' event logs); the user is back at its
limit within a stated time; the counters say what happened. The figures it
prints are RELIABILITY.md's ("Fleet faults").

Long (``make test-all``): about 20 s of streams after two engine starts.
"""

from __future__ import annotations

import time

import pytest

from harness import fleet_engines, spend_rate, start_all
from test_e2e_chaos import back_at_limit_s, check_bound, fleet_steps, LIMIT
from test_e2e_shared_state import fleet_tokens, run_streams, wait_for_events
from vllm_output_rate.cluster_store import user_key
from vllm_output_rate.tools.common.client import metric_value, scrape_metrics
from vllm_output_rate.tools.redis_server import RedisCluster, redis_server_binary

pytestmark = [pytest.mark.e2e, pytest.mark.long,
              pytest.mark.skipif(redis_server_binary() is None, reason="redis-server not installed")]

SHARDS = 3
RESETS = "vllm_output_rate_shared_store_resets_total"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chaos-cluster")
    cluster = RedisCluster(shards=SHARDS, replicas=1, nice=10).start()
    limits = tmp / "limits.yaml"
    limits.write_text(f"default: {LIMIT}\nusers:\n  warm-up: 100000\n")
    events = [tmp / f"events-{i}.jsonl" for i in range(2)]
    engines = fleet_engines("e2e-chaos-cluster", lambda i: [
        "--max-num-seqs", "16", "--max-model-len", "1024",
        "--output-rate-limits-file", str(limits),
        "--output-rate-shared-state", cluster.url], events)
    errors = start_all(engines)
    try:
        assert not errors, errors
        for streams in (1, 2):  # the batch shapes of the case, met once
            run_streams(engines, [(i, "warm-up", streams, 4) for i in range(2)])
        yield {"cluster": cluster, "engines": engines, "events": events}
    finally:
        for e in engines:
            e.stop()
        for node in cluster.nodes:
            node.close()


def shard_of(cluster: RedisCluster, user: str) -> int:
    """The master (node index) whose slots hold ``user``'s keys."""
    c = cluster.client(0)
    try:
        slot = int(c.execute_command("CLUSTER", "KEYSLOT", user_key(user)))
    finally:
        c.close()
    return slot * SHARDS // RedisCluster.SLOTS


def test_a_shard_failover_mid_stream_holds_the_bound(fleet):
    """user-a streams on both engines (two streams of 100 tokens each, 20
    s at its 20 tok/s); once both have served it, its shard fails over.
    The engines' next calls find the slot map changed and treat the shard
    as one that lost its data (no burst: the bound holds), then lease from
    the new master."""
    cluster, engines, events = fleet["cluster"], fleet["engines"], fleet["events"]
    shard = shard_of(cluster, "user-a")
    replica = SHARDS + shard  # (the replicas follow the masters: node n + k follows k)
    resets_before = [metric_value(scrape_metrics(e.base_url), RESETS) for e in engines]
    marks: dict[str, int] = {}
    start = time.monotonic_ns()

    def failover():
        wait_for_events(events, "user-a", 60, start)
        marks["failover"] = time.monotonic_ns()
        cluster.failover(replica)
        marks["done"] = time.monotonic_ns()

    results = run_streams(engines, [(i, "user-a", 2, 100) for i in range(2)], during=failover)
    assert [r.error for r in results if r.error] == []
    assert [r.completion_tokens for r in results] == [100] * 4
    wait_for_events(events, "user-a", 400, start)
    spends = fleet_tokens(events, "user-a", start)
    excess = check_bound(spends)
    back = back_at_limit_s(spends, fleet_steps(events, start), marks["done"])
    after = [(t, n) for t, n in spends if t >= marks["done"] + 3 * 10**9]
    resets = [metric_value(scrape_metrics(e.base_url), RESETS) - b
              for e, b in zip(engines, resets_before)]
    print(f"\nshard {shard} failed over in {(marks['done'] - marks['failover']) / 1e9:.2f} s: "
          f"worst window {excess:+d} tokens against the fleet bound, back at the limit "
          f"{back:.2f} s after, then {spend_rate(after):.2f} tok/s over both engines; "
          f"store resets counted {resets}")
    assert back <= 3.0, back
    # each engine saw its shard's data gone (a failover is an empty restart to it)
    assert all(n >= 1 for n in resets), resets
