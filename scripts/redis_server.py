"""A throwaway ``redis-server`` on a free loopback port (Debian's package), or a Redis Cluster of them.

For the shared-budget tests, the fleet simulation and anyone trying the
shared-budget mode on one machine. Nothing is persisted: no RDB, no AOF, so
``restart()`` gives an empty store (a store that lost its data).
``RedisCluster(shards=3)``: that many masters in cluster mode on loopback
ports, the slots split evenly (``replicas=1``: a replica of each, for a
failover); a node restarted keeps its slots (its cluster file) and comes
back empty. ``python -m
vllm_output_rate.tools.redis_server --shards 3`` starts one, prints its URL
and keeps it until interrupted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from vllm_output_rate.tools.common.client import free_port


def redis_server_binary() -> str | None:
    """``redis-server`` on PATH (or where Debian puts it), if installed."""
    found = shutil.which("redis-server")
    if found:
        return found
    return "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None


class RedisServer:
    """``redis-server`` bound to 127.0.0.1, in a temporary directory.

    ``nice``: a scheduling priority to raise it by (root only; ignored
    otherwise). The end-to-end tests run two engines, their workers and
    their API servers on two cores beside it; in a fleet the store has a
    CPU of its own, and a store starved of CPU for half a second starves
    every engine of leases."""

    def __init__(self, port: int | None = None, nice: int = 0, extra: tuple[str, ...] = ()) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server; "
                               "make tools does it)")
        self.binary = binary
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="output-rate-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.nice = nice
        #: more options for the server (cluster mode: ``RedisCluster``)
        self.extra = extra

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        log = open(self.dir / "redis.log", "ab")
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                   "--save", "", "--appendonly", "no", "--dir", str(self.dir),
                   "--protected-mode", "no", *self.extra]
        nice = shutil.which("nice")
        if self.nice and nice is not None and os.geteuid() == 0:
            # Raised by nice(1), which execs the server (the same process):
            # no Python run in a forked child of a process full of threads
            # (a preexec_fn), which stalled a restart for seconds once.
            # Not root: the default priority.
            command = [nice, "-n", str(-self.nice), *command]
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # no retries inside the client: redis-py's default retries a refused
        # connection with exponential backoff (seconds), which hid a store
        # that was up long before the helper said so (12 s on a busy machine)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1,
                             socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                                   + (self.dir / "redis.log").read_text(errors="replace")[-2000:])
            try:
                if client.ping():
                    client.close()
                    return self
            except redis.RedisError:
                time.sleep(0.05)
        client.close()
        raise TimeoutError(f"redis-server not ready on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: a store that crashed (no shutdown, its data gone)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> RedisServer:
        """Stop and start on the same port: the store comes back empty."""
        self.stop()
        return self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    import socket

    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free pair of ports for a cluster node")


class RedisCluster:
    """``shards`` masters of a Redis Cluster on loopback, and ``replicas``
    replicas of each (``nodes``: the masters first, then the replicas).

    ``cluster-require-full-coverage no``: while one shard is down the others
    keep serving (Redis' default stops the whole cluster). Node timeout 1 s."""

    SLOTS = 16384

    def __init__(self, shards: int = 3, nice: int = 0, replicas: int = 0) -> None:
        self.shards = shards
        self.nodes = [RedisServer(_cluster_port(), nice=nice, extra=(
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no"))
            for _ in range(shards * (1 + replicas))]

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def client(self, i: int, timeout_s: float = 5.0):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.nodes[i].port, socket_timeout=timeout_s)

    def start(self, timeout_s: float = 30.0) -> RedisCluster:
        for node in self.nodes:
            node.start()
        n = self.shards
        for i in range(len(self.nodes)):
            c = self.client(i)
            if i < n:
                start, end = i * self.SLOTS // n, (i + 1) * self.SLOTS // n - 1
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", start, end)
            if i:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port)
            c.close()
        self.wait_ok(timeout_s)
        for i in range(n, len(self.nodes)):  # each replica follows its master
            master = self.client(i % n)
            master_id = master.execute_command("CLUSTER", "MYID")
            master.close()
            self._until(lambda: self._replicate(i, master_id), timeout_s)
        for i in range(n, len(self.nodes)):
            self._until(lambda: self._linked(i), timeout_s)
        self.wait_ok(timeout_s)
        return self

    def _linked(self, i: int) -> bool:
        """Replica ``i`` in sync with its master (a manual failover needs it)."""
        c = self.client(i, 1.0)
        try:
            return c.info("replication").get("master_link_status") == "up"
        finally:
            c.close()

    def _replicate(self, i: int, master_id: bytes) -> bool:
        import redis

        c = self.client(i)
        try:
            c.execute_command("CLUSTER", "REPLICATE", master_id)
            return True
        except redis.RedisError:  # the master not known to it yet
            return False
        finally:
            c.close()

    @staticmethod
    def _until(check, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError("the Redis Cluster did not become ready")
            time.sleep(0.05)

    def failover(self, replica: int) -> None:
        """``CLUSTER FAILOVER`` on node ``replica``: it becomes its shard's
        master (its old master a replica), and the cluster is ok again."""
        c = self.client(replica)
        c.execute_command("CLUSTER", "FAILOVER")
        c.close()

        def promoted() -> bool:
            c = self.client(replica, 1.0)
            try:
                return c.execute_command("ROLE")[0] in (b"master", "master")
            finally:
                c.close()

        self._until(promoted, 30.0)
        self.wait_ok()

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every node says the cluster is ok and knows every master."""
        import redis

        n = self.shards
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ok = 0
            for i, node in enumerate(self.nodes):
                if node.proc is None:
                    continue
                try:
                    c = self.client(i, 1.0)
                    info = c.execute_command("CLUSTER", "INFO")
                    info = info.decode() if isinstance(info, bytes) else str(info)
                    slots = c.execute_command("CLUSTER", "SLOTS")
                    c.close()
                except redis.RedisError:
                    continue
                if "cluster_state:ok" in info and len(slots) >= n:
                    ok += 1
            if ok == sum(1 for node in self.nodes if node.proc is not None):
                return
            time.sleep(0.05)
        raise TimeoutError("the Redis Cluster did not become ready")

    def kill(self, i: int) -> None:
        """SIGKILL one master (its slots unserved until it is back)."""
        self.nodes[i].kill()

    def restart_empty(self, i: int) -> None:
        """Node ``i`` stopped and started again: its slots back (its cluster
        file), its data gone."""
        self.nodes[i].stop()
        self.nodes[i].start()
        self.wait_ok()

    def flushall(self) -> None:
        for i, node in enumerate(self.nodes):
            if node.proc is not None:
                c = self.client(i)
                c.flushall()
                c.close()

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=0,
                        help="start a Redis Cluster of this many masters (0: one plain server)")
    parser.add_argument("--replicas", type=int, default=0, help="replicas of each master (a cluster)")
    args = parser.parse_args(argv)
    server = RedisCluster(args.shards, replicas=args.replicas) if args.shards else RedisServer()
    with server:
        print(server.url, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
