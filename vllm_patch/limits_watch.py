"""Live files: the engine core re-reads ``--output-rate-limits-file`` (and
the API servers ``--output-rate-api-keys``).

A background thread of the engine-core process polls the file's ``stat``
(modification time, size, inode: a Kubernetes ConfigMap update swaps a
symlink, which changes the inode seen through it) every ``POLL_S`` and, on
SIGHUP, reads it at once. A changed file is read, hashed (SHA-256 of its
bytes) and checked with the same rules as at start-up; a valid one becomes
``current``, which the scheduler puts in force at its next step boundary
(``core.OutputRateCore._orl_apply_limits``). A file that fails the
checks changes nothing: it is logged once per content and counted. An
empty file is looked at once more at the next poll before it counts: a
file rewritten in place (truncated, then written) reads empty in between,
and that moment is not the operator's content.

The scheduler's thread never waits here: it compares one reference per
step. Everything the thread publishes is replaced whole (a reference swap),
never mutated in place; counters are only written by this thread.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from vllm_output_rate.config import (
    LIMITS_FILE_OPTION,
    OutputRateConfig,
    OutputRateConfigError,
    parse_limits_document,
)
from vllm_output_rate.observers import LimitsStatus

logger = logging.getLogger("vllm_output_rate")

#: How often the file's stat is polled (a change is in force within about this).
POLL_S = 0.25
#: Results of one look at the file that found something to do.
RESULTS = ("loaded", "unchanged", "invalid", "unreadable")


class WatchedFile:
    """Keeps ``current`` equal to the last valid content of a file.

    Subclasses say how to parse (``parse``: raise ``OutputRateConfigError``
    naming the file and key), what the current value's digest is, and what
    to log when a new value is taken (``accept``)."""

    #: the option that names the file (in error messages)
    option = ""
    #: the thread's name
    thread_name = "output-rate-file"

    def __init__(self, path: str, current: Any, digest: str, poll_s: float = POLL_S,
                 start_thread: bool = True) -> None:
        self.path = path
        self.poll_s = poll_s
        #: the last valid value (swapped whole, never changed in place)
        self.current = current
        self.digest = digest
        self.loaded_unix = time.time()
        self.results = dict.fromkeys(RESULTS, 0)
        self.last_error: str | None = None
        #: what the file's stat was at the last look (None: look at once)
        self._stat: tuple | None = None
        #: digest of the content that failed last (logged and counted once)
        self._failed_digest: str | None = None
        self._unreadable = False
        #: the last look read the file empty (being written, maybe)
        self._empty = False
        self._forced = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        # The file may have changed since the value was read.
        self._quiet = True
        if self.check() == "unchanged":
            self.results["unchanged"] = 0
        self._quiet = False
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()
            install_sighup(self)  # a live watcher re-reads its file on SIGHUP too

    # -- for subclasses -------------------------------------------------------

    def parse(self, content: bytes) -> Any:
        raise NotImplementedError

    def accept(self, old: Any, new: Any, digest: str) -> Any:
        """The value to keep for newly parsed content (and log it)."""
        return new

    # -- what the engine reads ----------------------------------------------

    def status(self) -> LimitsStatus:
        return LimitsStatus(self.path, self.digest, self.loaded_unix,
                            dict(self.results), self.last_error)

    def request_reload(self) -> None:
        """Read the file at once (SIGHUP), whether its stat changed or not.
        Safe to call from a signal handler."""
        self._forced = True
        self._wake.set()

    def close(self) -> None:
        forget(self)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    # -- the watcher's thread ----------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.check()
            except Exception:  # never let the thread die
                logger.exception("output-rate: checking %s failed", self.path)

    def _stat_key(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)

    def check(self) -> str | None:
        """One look at the file: the result, or None when nothing changed."""
        forced, self._forced = self._forced, False
        key = self._stat_key()
        if key == self._stat and not forced and not self._unreadable:
            return None
        self._stat = key
        try:
            with open(self.path, "rb") as f:
                content = f.read()
        except OSError as exc:
            if not self._unreadable or forced:
                self._unreadable = True
                self.last_error = f"{self.option} {self.path}: cannot read it ({exc.strerror or exc})"
                self.results["unreadable"] += 1
                logger.error("output-rate: %s; what is in force stays (sha256 %s)",
                             self.last_error, self.digest[:12])
                return "unreadable"
            return None
        self._unreadable = False
        if not content and not forced and not self._empty:
            self._empty = True  # truncated and not written yet? look again
            self._stat = None
            return None
        self._empty = False
        digest = hashlib.sha256(content).hexdigest()
        if digest == self.digest:
            self._failed_digest = None
            self.results["unchanged"] += 1
            if not self._quiet:
                logger.info("output-rate: %s %s, content unchanged (sha256 %s)",
                            self.path, "re-read on request" if forced else "touched",
                            digest[:12])
            return "unchanged"
        if digest == self._failed_digest and not forced:
            return None  # the same bad content: logged and counted already
        try:
            # accept() may refuse too (what this engine cannot serve)
            current = self.accept(self.current, self.parse(content), digest)
        except OutputRateConfigError as exc:
            self._failed_digest = digest
            self.last_error = str(exc)
            self.results["invalid"] += 1
            logger.error("output-rate: %s was changed but is not valid, what is in "
                         "force stays (sha256 %s): %s", self.path, self.digest[:12], exc)
            return "invalid"
        self._failed_digest = None
        self.last_error = None
        self.current = current
        self.digest = digest
        self.loaded_unix = time.time()
        self.results["loaded"] += 1
        return "loaded"


class LimitsWatcher(WatchedFile):
    """The limits file: ``current`` is the ``OutputRateConfig`` to put in force."""

    option = LIMITS_FILE_OPTION
    thread_name = "output-rate-limits"

    def __init__(self, config: OutputRateConfig, poll_s: float = POLL_S,
                 start_thread: bool = True,
                 refuse: Callable[[OutputRateConfig], str | None] | None = None) -> None:
        if config.limits_file is None:
            raise ValueError("LimitsWatcher needs a config read from a limits file")
        #: what the engine cannot serve of a new file (its error, or None)
        self.refuse = refuse
        super().__init__(config.limits_file, config, config.digest, poll_s, start_thread)

    def parse(self, content: bytes) -> OutputRateConfig:
        return parse_limits_document(content, self.path)

    def accept(self, old: OutputRateConfig, new: OutputRateConfig,
               digest: str) -> OutputRateConfig:
        config = replace(new, unlisted_users=old.unlisted_users, shared_state=old.shared_state,
                         prefill_ahead=old.prefill_ahead)
        problem = self.refuse(config) if self.refuse is not None else None
        if problem:
            raise OutputRateConfigError(problem)
        added, removed, changed = diff_limits(old, config)
        logger.info("output-rate: limits reloaded from %s (sha256 %s): default %s tok/s, "
                    "%d user(s) added, %d removed, %d changed",
                    self.path, digest[:12], config.default_rate,
                    len(added), len(removed), len(changed))
        return config


def diff_limits(old: OutputRateConfig, new: OutputRateConfig
                ) -> tuple[list[str], list[str], list[str]]:
    """Users added, removed and with a changed limit (sorted)."""
    before, after = old.user_rates, new.user_rates
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(u for u in set(before) & set(after) if before[u] != after[u])
    return added, removed, changed


# -- SIGHUP ---------------------------------------------------------------------

# The process's one SIGHUP handler: every live ``WatchedFile`` (the engine
# core's limits, the API server's keys) registers itself when it starts and
# leaves when closed; the API server of an engine core that watches a file
# installs it only to forward the signal (``plugin.configure_output_rate``).
_watchers: list[WatchedFile] = []
_hup_installed = False


def _on_sighup(signum: int, frame: Any) -> None:
    for watcher in list(_watchers):
        watcher.request_reload()
    forward_sighup()


def install_sighup(watcher: WatchedFile | None = None) -> bool:
    """Make SIGHUP reload the limits file in this process (and forward it to
    child processes that reload on it). Only from the main thread and only
    over the default handler: another program's handler is left alone.
    Returns whether SIGHUP reloads here."""
    global _hup_installed
    if watcher is not None and watcher not in _watchers:
        _watchers.append(watcher)
    if _hup_installed:
        return True
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return False
    # (SIG_IGN too: under ``nohup`` the process must not die of a hangup,
    # and reloading does not; another program's own handler is kept)
    if signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, signal.SIG_IGN, None):
        return False
    signal.signal(signal.SIGHUP, _on_sighup)
    _hup_installed = True
    return True


def forget(watcher: WatchedFile) -> None:
    if watcher in _watchers:
        _watchers.remove(watcher)


def forward_sighup() -> list[int]:
    """Send SIGHUP to this process's descendants that catch it (an engine
    core whose limits come from a file): a front end given SIGHUP (``kill
    -HUP`` on the serving process, PID 1 in a container) passes it on.
    Processes that do not catch SIGHUP would die of it and are skipped
    (Linux: ``SigCgt`` in ``/proc/PID/status``)."""
    sent = []
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
    except Exception:
        return sent
    for child in children:
        if _catches_sighup(child.pid):
            try:
                os.kill(child.pid, signal.SIGHUP)
                sent.append(child.pid)
            except OSError:
                pass
    return sent


def _catches_sighup(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGHUP - 1)))
    except (OSError, ValueError):
        pass
    return False
