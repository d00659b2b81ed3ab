"""The fault proxy (``tools.reliability.fault_proxy``) between a client and a real
``redis-server``: it forwards, it delays each way, a cut makes calls time
out (not fail at once) and a heal lets them through again. The times
checked are lower bounds only (a delay cannot be beaten; a loaded machine
only makes things later) and the timeouts' outcomes, never a duration."""

from __future__ import annotations

import time

import pytest

from vllm_output_rate.tools.reliability.fault_proxy import FaultProxy
from vllm_output_rate.tools.redis_server import RedisServer, redis_server_binary

pytestmark = pytest.mark.skipif(redis_server_binary() is None,
                                reason="redis-server not installed")


@pytest.fixture(scope="module")
def store():
    with RedisServer() as server:
        yield server


def client(proxy: FaultProxy, timeout_s: float = 5.0):
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=timeout_s,
                       socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))


def test_it_forwards_both_ways_and_counts(store):
    with FaultProxy("127.0.0.1", store.port) as proxy:
        c = client(proxy)
        assert c.set("k", "v" * 100_000) and c.get("k") == b"v" * 100_000
        c.close()
        stats = proxy.stats()
    assert stats.connections == 1 and stats.connect_failures == 0
    assert stats.bytes_up > 100_000 and stats.bytes_down > 100_000


def test_slow_delays_each_call_by_at_least_the_delay_each_way(store):
    with FaultProxy("127.0.0.1", store.port) as proxy:
        c = client(proxy)
        c.ping()  # connected before the delay is measured
        proxy.slow(0.2)
        t0 = time.monotonic()
        assert c.ping()
        elapsed = time.monotonic() - t0
        proxy.slow(0)
        c.ping()
        c.close()
    assert elapsed >= 0.4  # 0.2 s up and 0.2 s down, at the least


def test_a_cut_times_calls_out_and_a_heal_lets_them_through(store):
    import redis

    with FaultProxy("127.0.0.1", store.port) as proxy:
        c = client(proxy, timeout_s=0.3)
        assert c.ping()
        proxy.cut()
        assert proxy.is_cut
        with pytest.raises(redis.TimeoutError):
            c.ping()  # the open connection: no answer
        fresh = client(proxy, timeout_s=0.3)
        with pytest.raises(redis.TimeoutError):
            fresh.ping()  # a new one is accepted, not forwarded
        proxy.heal()
        assert not proxy.is_cut
        later = client(proxy)
        assert later.ping()
        for x in (c, fresh, later):
            x.close()
        stats = proxy.stats()
    assert len(stats.cuts) == 1 and stats.cuts[0][1] is not None
    assert stats.cuts[0][1] > stats.cuts[0][0]
    assert stats.held_connections >= 1


def test_a_target_that_is_down_is_counted(store):
    dead = RedisServer()  # a port nobody listens on
    with FaultProxy("127.0.0.1", dead.port) as proxy:
        import redis

        c = client(proxy, timeout_s=1)
        with pytest.raises(redis.RedisError):
            c.ping()
        c.close()
        deadline = time.monotonic() + 10
        while proxy.stats().connect_failures == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proxy.stats().connect_failures == 1
    dead.close()


def test_a_negative_delay_is_refused():
    proxy = FaultProxy("127.0.0.1", 1)
    with pytest.raises(ValueError, match="0 or more seconds"):
        proxy.slow(-1)
