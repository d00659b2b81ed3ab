"""An engine core whose API server is gone shuts itself down.

vLLM's model workers watch the engine core through a death pipe; the engine
core does not watch the process that started it (the API server, or the
launcher of several API servers and data-parallel engines). When that
process alone dies (killed, out of memory), the engine core lives on as an
orphan: it goes on generating for clients that are gone, holding its memory,
and in shared-budget mode it goes on leasing its users' budgets, so that the
other engines of the fleet serve those users at a fraction of their limits.

``ParentWatch`` runs in an engine-core process whose scheduler is ours (the
feature on; started by the scheduler's constructor): a daemon thread that
looks every ``interval_s`` at the parent's pid. When the process has been
re-parented (the parent died), it logs one error, releases what the engine
holds beyond the process (``release``: in shared-budget mode the lease
thread stops and the engine leaves the store, ``LeaseThread.leave``, so
that the other engines get its share of each user at their next call), and
sends the process SIGTERM, which vLLM's engine core handles as its own
shutdown signal: the in-flight requests are aborted (``--shutdown-timeout``
0, the default) or drained, the workers exit, ``Scheduler.shutdown`` runs.
If the process is still there ``exit_after_s`` later (a drain, workers slow
to exit), it exits at once with status 1 (``os._exit``; the workers follow
through their death pipe).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable

logger = logging.getLogger("vllm_output_rate")

#: How often the parent is looked at (seconds): the orphan is seen within it.
INTERVAL_S = 0.25
#: From SIGTERM to the hard exit, when vLLM's own shutdown has not ended
#: the process by then (seconds).
EXIT_AFTER_S = 2.0
#: The name vLLM's ``CoreEngineProcManager`` gives each engine-core process
#: (``EngineCore``, ``EngineCore_DP<n>``).
ENGINE_CORE_PROCESS = "EngineCore"


def _terminate() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def _hard_exit() -> None:
    os._exit(1)


class ParentWatch:
    """Calls ``release`` then ``on_orphan`` once when this process's parent
    is no longer ``parent_pid``, then ``on_stuck`` if the process outlives
    it by ``exit_after_s``."""

    def __init__(self, parent_pid: int, interval_s: float = INTERVAL_S,
                 exit_after_s: float = EXIT_AFTER_S,
                 release: Callable[[], None] | None = None,
                 on_orphan: Callable[[], None] = _terminate,
                 on_stuck: Callable[[], None] = _hard_exit,
                 getppid: Callable[[], int] = os.getppid) -> None:
        self.parent_pid = parent_pid
        self.release = release
        self.interval_s = interval_s
        self.exit_after_s = exit_after_s
        self.on_orphan = on_orphan
        self.on_stuck = on_stuck
        self.getppid = getppid
        self.orphaned = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> bool:
        """Whether the parent is gone (this process was re-parented)."""
        return self.getppid() != self.parent_pid

    def start(self) -> ParentWatch:
        self._thread = threading.Thread(target=self._run, name="output-rate-parent-watch",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.check():
                break
        else:
            return
        self.orphaned = True
        logger.error(
            "output-rate: this engine core's parent process (pid %d) is gone; shutting the "
            "engine core down (its requests aborted, its shared leases released)",
            self.parent_pid)
        if self.release is not None:
            try:
                self.release()
            except Exception:  # the shutdown must go on
                logger.exception("output-rate: releasing the orphaned engine core's state failed")
        self.on_orphan()
        if not self._stop.wait(self.exit_after_s):
            logger.error("output-rate: the orphaned engine core is still running %.0f s after "
                         "SIGTERM; exiting", self.exit_after_s)
            self.on_stuck()


def in_engine_core_process() -> bool:
    """Whether this process is an engine core that vLLM started as a child
    process (not an engine core running inside the caller's process, as
    ``LLM`` or a test builds one: there, the parent is the user's shell)."""
    return (multiprocessing.parent_process() is not None
            and multiprocessing.current_process().name.startswith(ENGINE_CORE_PROCESS))


def watch_parent(release: Callable[[], None] | None = None) -> ParentWatch | None:
    """Start the watch in an engine-core child process; elsewhere nothing.
    ``release`` (safe from another thread) runs first when the parent is
    gone."""
    if not in_engine_core_process():
        return None
    parent = multiprocessing.parent_process()
    assert parent is not None and parent.pid is not None
    # The pid vLLM's launcher had (not getppid(): it may be gone already).
    return ParentWatch(parent.pid, release=release).start()
