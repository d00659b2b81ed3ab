"""Test glue for shared budgets, light (no vLLM): a Redis or Redis Cluster
of ``tools.redis_server``, started if stopped and emptied for the next test;
the shared-state modules' (``test_shared_state_*.py``) Redis fixtures: a
``redis-server`` a module, and its URL emptied for each test."""

from __future__ import annotations

import pytest

from vllm_output_rate.tools.redis_server import RedisServer, redis_server_binary

needs_redis = pytest.mark.skipif(redis_server_binary() is None,
                                 reason="redis-server not installed (make tools installs it)")


@pytest.fixture(scope="module")
def redis_server():
    if redis_server_binary() is None:
        pytest.skip("redis-server not installed")
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture
def store_url(redis_server):
    import redis

    if redis_server.proc is None:
        redis_server.start()
    redis.Redis.from_url(redis_server.url).flushdb()
    # The protocol's tests: a store that answers late is not what they
    # check (the outage tests set their own timeouts), and the version
    # matrix runs them at the lowest CPU priority beside the suite's engines
    # (the server it starts too): 5 s instead of the engines' 250 ms.
    return redis_server.url + "?timeout_ms=5000"



def fresh_store(server) -> str:
    """A ``tools.redis_server.RedisServer``'s URL, started if stopped and
    emptied."""
    import redis

    if server.proc is None:
        server.start()
    redis.Redis.from_url(server.url).flushdb()
    return server.url


def fresh_cluster(cluster) -> str:
    """A ``tools.redis_server.RedisCluster``'s URL, each stopped node
    restarted empty and every node emptied."""
    for i, node in enumerate(cluster.nodes):
        if node.proc is None:
            cluster.restart_empty(i)
    cluster.flushall()
    return cluster.url
