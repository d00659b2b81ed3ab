"""A throwaway ``redis-server`` on a free loopback port (Debian's package).

For the shared-budget tests, the fleet simulation and anyone trying the
shared-budget mode on one machine. Nothing is persisted: no RDB, no AOF, so
``restart()`` gives an empty store (a store that lost its data).
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

    def __init__(self, port: int | None = None, nice: int = 0) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server; "
                               "make tools does it)")
        self.binary = binary
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="output-rate-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.nice = nice

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        log = open(self.dir / "redis.log", "ab")
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                   "--save", "", "--appendonly", "no", "--dir", str(self.dir),
                   "--protected-mode", "no"]
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
