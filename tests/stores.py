"""Test glue for shared budgets, light (no vLLM): a Redis or Redis Cluster
of ``tools.redis_server``, started if stopped and emptied for the next test."""

from __future__ import annotations


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
