"""A TCP proxy on loopback that injects a store's network faults.

Between an engine and its shared store (``redis-server``, a cluster node)
in the reliability runs: the engine is given the proxy's address, the proxy
forwards to the store, and a test or the stress runner turns faults on and
off while streams run:

- ``slow(seconds)``: every chunk, each way, is delivered ``seconds`` after
  it arrived (latency, not a bandwidth cap: chunks in flight overlap), as a
  store far away or busy;
- ``cut()``: a partition. Nothing is read or written on either side, and
  new connections are accepted (the kernel's listen queue answers SYNs) but
  not forwarded: a client's calls time out, as across a dropped route, and
  are not refused at once as by a closed port;
- ``heal()``: traffic flows again; bytes held in the kernel's buffers during
  the cut are delivered (TCP retransmits across a healed partition), on the
  connections the client has not given up on.

One thread runs an asyncio loop; the controls are thread-safe and take
effect for the next chunk. ``stats()`` says what went through.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from vllm_output_rate.tools.common.client import free_port

#: Read size of each side's pump.
CHUNK = 65536


@dataclass
class ProxyStats:
    """What the proxy did since it started."""

    connections: int = 0
    bytes_up: int = 0  # client -> target
    bytes_down: int = 0  # target -> client
    held_connections: int = 0  # accepted while cut, forwarded after a heal (or never)
    connect_failures: int = 0  # the target refused or was down
    cuts: list[tuple[float, float | None]] = field(default_factory=list)  # (start, end) monotonic


class FaultProxy:
    """Forward ``127.0.0.1:port`` to ``target_host:target_port``."""

    def __init__(self, target_host: str, target_port: int, port: int | None = None) -> None:
        self.target = (target_host, target_port)
        self.port = port or free_port()
        self._delay_s = 0.0
        self._stats = ProxyStats()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open: asyncio.Event | None = None  # set while traffic flows
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    # -- addresses ---------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def redis_url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    # -- controls (any thread) ---------------------------------------------------

    def slow(self, seconds: float) -> None:
        """Deliver each chunk ``seconds`` after it arrived (0: at once)."""
        if seconds < 0:
            raise ValueError(f"a delay must be 0 or more seconds, got {seconds}")
        with self._lock:
            self._delay_s = float(seconds)

    def cut(self) -> None:
        """Stop all traffic, holding connections open."""
        with self._lock:
            if self._stats.cuts and self._stats.cuts[-1][1] is None:
                return
            self._stats.cuts.append((time.monotonic(), None))
        self._call(lambda: self._open.clear())

    def heal(self) -> None:
        """Let traffic flow again."""
        with self._lock:
            if self._stats.cuts and self._stats.cuts[-1][1] is None:
                self._stats.cuts[-1] = (self._stats.cuts[-1][0], time.monotonic())
        self._call(lambda: self._open.set())

    @property
    def is_cut(self) -> bool:
        with self._lock:
            return bool(self._stats.cuts) and self._stats.cuts[-1][1] is None

    def stats(self) -> ProxyStats:
        with self._lock:
            s = self._stats
            return ProxyStats(s.connections, s.bytes_up, s.bytes_down, s.held_connections,
                              s.connect_failures, list(s.cuts))

    # -- life ------------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> FaultProxy:
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the fault proxy did not start on port {self.port}")
        if self._error is not None:
            raise RuntimeError(f"the fault proxy could not listen on port {self.port}: "
                               f"{self._error}") from self._error
        return self

    def close(self) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            return
        loop.call_soon_threadsafe(self._stop_in_loop)
        self._thread.join(10)
        self._loop = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inside the loop's thread ----------------------------------------------------

    def _call(self, fn) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(fn)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        self._open = asyncio.Event()
        if not self.is_cut:
            self._open.set()
        self._stopped = asyncio.Event()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self._ready.set()
        await self._stopped.wait()
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def _stop_in_loop(self) -> None:
        self._stopped.set()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(self._connection(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connection(self, client_r: asyncio.StreamReader,
                          client_w: asyncio.StreamWriter) -> None:
        with self._lock:
            self._stats.connections += 1
            held = not self._open.is_set()
            if held:
                self._stats.held_connections += 1
        target_w = None
        try:
            await self._open.wait()
            try:
                target_r, target_w = await asyncio.open_connection(*self.target)
            except OSError:
                with self._lock:
                    self._stats.connect_failures += 1
                return
            await asyncio.gather(self._pump(client_r, target_w, "bytes_up"),
                                 self._pump(target_r, client_w, "bytes_down"))
        except (asyncio.CancelledError, ConnectionError):
            pass
        finally:
            for w in (client_w, target_w):
                if w is not None:
                    w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    counter: str) -> None:
        """One direction: read a chunk (only while open), deliver it ``delay``
        after it arrived, in order; end both ways when either side closes."""
        queue: deque[tuple[float, bytes]] = deque()
        more = asyncio.Event()
        done = False

        async def deliver() -> None:
            while True:
                while not queue:
                    if done:
                        return
                    more.clear()
                    await more.wait()
                arrived, data = queue[0]
                with self._lock:
                    delay = self._delay_s
                wait = arrived + delay - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._open.wait()
                queue.popleft()
                # counted as handed on (before the write: the peer may read
                # it before this coroutine runs again)
                with self._lock:
                    setattr(self._stats, counter, getattr(self._stats, counter) + len(data))
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                await self._open.wait()
                data = await reader.read(CHUNK)
                if not data:
                    break
                queue.append((time.monotonic(), data))
                more.set()
            done = True
            more.set()
            await sender
        finally:
            sender.cancel()
            if writer.can_write_eof():
                try:
                    writer.write_eof()
                except (OSError, RuntimeError):
                    pass
