"""An engine core whose parent is gone shuts itself down (``orphan``):
real processes, a parent killed with SIGKILL, the watch in its orphaned
child seeing it. vLLM's engine core and its SIGTERM handling end to end:
``test_e2e_shared_state.py``."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

from vllm_output_rate import orphan

#: The child of a parent that the test kills: it watches its parent, and
#: writes what happened to a file (the test cannot wait() on a grandchild).
LEAF = textwrap.dedent("""
    import os, sys, time
    from vllm_output_rate.orphan import ParentWatch
    out = sys.argv[1]
    stuck = sys.argv[2] == "stuck"

    def note(what):
        with open(out, "a") as f:
            f.write(what + "\\n")

    def on_orphan():
        note("orphan")
        if not stuck:
            os._exit(0)

    watch = ParentWatch(os.getppid(), interval_s=0.05, exit_after_s=0.2, on_orphan=on_orphan,
                        on_stuck=lambda: (note("stuck"), os._exit(3))).start()
    note("watching")
    time.sleep(120)
    note("timeout")
""")

#: The parent: starts the leaf, says its pid, then waits to be killed.
MIDDLE = textwrap.dedent("""
    import subprocess, sys, time
    leaf = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]])
    print(leaf.pid, flush=True)
    time.sleep(120)
""")


def _wait_for(path, word, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and word in path.read_text().split():
            return True
        time.sleep(0.02)
    return False


def _orphan_a_leaf(tmp_path, mode):
    out = tmp_path / f"leaf-{mode}.txt"
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, LEAF, str(out), mode],
                              stdout=subprocess.PIPE, text=True)
    leaf_pid = int(middle.stdout.readline())
    try:
        assert _wait_for(out, "watching")
        assert "orphan" not in out.read_text()  # its parent lives: nothing
        os.kill(middle.pid, signal.SIGKILL)
        middle.wait()
        return out
    finally:
        if middle.poll() is None:
            middle.kill()
        if mode == "stuck" and not _wait_for(out, "stuck", 60):
            try:
                os.kill(leaf_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_watch_sees_its_parent_killed(tmp_path):
    out = _orphan_a_leaf(tmp_path, "exit")
    assert _wait_for(out, "orphan")
    assert out.read_text().split() == ["watching", "orphan"]


def test_an_orphan_that_does_not_end_is_ended(tmp_path):
    """SIGTERM's shutdown does not end the process (a drain, a hang): the
    hard exit follows."""
    out = _orphan_a_leaf(tmp_path, "stuck")
    assert _wait_for(out, "stuck")
    assert out.read_text().split() == ["watching", "orphan", "stuck"]


def test_the_check_compares_the_parent():
    assert not orphan.ParentWatch(os.getppid()).check()
    assert orphan.ParentWatch(os.getppid(), getppid=lambda: 1).check()


def test_a_stopped_watch_does_nothing():
    called = []
    watch = orphan.ParentWatch(os.getppid(), interval_s=0.01, getppid=lambda: 1,
                               on_orphan=lambda: called.append(1))
    watch.stop()
    watch.start()._thread.join(10)
    assert called == [] and not watch.orphaned


def _in_engine_core(queue):
    queue.put(orphan.in_engine_core_process())


def test_only_an_engine_core_child_process_is_watched():
    """Not the test process (an engine core built in the caller's process,
    as ``LLM`` may: its parent is the user's shell), nor another child; a
    child named as vLLM names its engine cores is."""
    assert not orphan.in_engine_core_process()
    assert orphan.watch_parent() is None
    context = multiprocessing.get_context("spawn")
    seen = {}
    for name in ("EngineCore", "EngineCore_DP1", "SomethingElse"):
        queue = context.Queue()
        process = context.Process(target=_in_engine_core, args=(queue,), name=name)
        process.start()
        seen[name] = queue.get(timeout=120)
        process.join(60)
    assert seen == {"EngineCore": True, "EngineCore_DP1": True, "SomethingElse": False}
