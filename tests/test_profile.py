"""The py-spy schedule-cost report: parser and classifier on fixed input, the
permission-error path with a fake py-spy, and one run against a real engine."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from vllm_output_rate.tools.bench import profile_engine as prof
from vllm_output_rate.tools.bench import profile_stacks
from vllm_output_rate.tools.bench.profile_stacks import (
    CATEGORIES,
    IDLE,
    INPUT,
    LIMITER,
    MODEL,
    OTHER,
    SCHEDULE,
    TELEMETRY,
    UPDATE,
    build_report,
    classify,
    parse_raw,
)

LOOP = ("thread (100): MainThread;<module> (<string>:1);"
        "EngineCoreProc.run_engine_core (vllm/v1/engine/core.py:1496);"
        "EngineCoreProc.run_busy_loop (vllm/v1/engine/core.py:1555)")
STEP = (LOOP + ";install.<locals>._process_engine_step (vllm_patch/engine_loop.py:93)"
        ";EngineCoreProc._process_engine_step (vllm/v1/engine/core.py:1606)"
        ";EngineCore.step (vllm/v1/engine/core.py:668)")
OURS = "OutputRateSchedulerMixin.schedule (vllm_patch/scheduler.py:174)"
UPSTREAM = "Scheduler.schedule (vllm/v1/core/sched/scheduler.py:751)"

#: (collapsed line, expected self category, expected inclusive categories)
CASES = [
    # the limiter's wrapper's own lines: self limiter, inside schedule()
    (f"{STEP};{OURS};OutputRateSchedulerMixin._orl_order_running (vllm_patch/scheduler.py:246) 7",
     LIMITER, {SCHEDULE, LIMITER}),
    # vLLM's schedule() own lines under our wrapper
    (f"{STEP};{OURS};{UPSTREAM} 11", SCHEDULE, {SCHEDULE}),
    # a stack in two categories: the limiter's charge hook called by vLLM's schedule()
    (f"{STEP};{OURS};{UPSTREAM};OutputRateSchedulerMixin._reserve_prefill_lookahead "
     "(vllm_patch/scheduler.py:334);OutputRateLimiter.available (vllm_patch/limiter.py:110) 5",
     LIMITER, {SCHEDULE, LIMITER}),
    # vLLM's KV cache manager called through the limiter's allocate_slots wrapper:
    # schedule()'s own work, with the limiter on the stack
    (f"{STEP};{OURS};{UPSTREAM};OutputRateSchedulerMixin._orl_allocate_slots "
     "(vllm_patch/scheduler.py:399);KVCacheManager.allocate_slots "
     "(vllm/v1/core/kv_cache_manager.py:595);<genexpr> (vllm/v1/core/kv_cache_coordinator.py:339) 3",
     SCHEDULE, {SCHEDULE, LIMITER}),
    # telemetry observer called from the wrapper
    (f"{STEP};{OURS};EngineTelemetry.on_step (telemetry/engine.py:205) 2",
     TELEMETRY, {SCHEDULE, TELEMETRY}),
    # upstream schedule() without the limiter (feature off)
    (f"{STEP};Scheduler.schedule (vllm/v1/core/sched/scheduler.py:660);"
     "KVCacheManager.new_step_starts (vllm/v1/core/kv_cache_manager.py:922) 13", SCHEDULE, {SCHEDULE}),
    # update_from_output and a stdlib leaf under it
    (f"{STEP};Scheduler.update_from_output (vllm/v1/core/sched/scheduler.py:2167);"
     "Request.append_output_token_ids (vllm/v1/request.py:283) 4", UPDATE, {UPDATE}),
    # waiting for the worker process
    (f"{STEP};MultiprocExecutor.execute_model (vllm/v1/executor/multiproc_executor.py:344);"
     "MessageQueue.acquire_read (vllm/distributed/device_communicators/shm_broadcast.py:864);"
     "sched_yield (vllm/distributed/utils.py:46) 40", MODEL, {MODEL}),
    # the limiter's idle wait on the input queue
    (LOOP + ";install.<locals>._process_engine_step (vllm_patch/engine_loop.py:95);"
     "idle_wait (vllm_patch/engine_loop.py:70);Queue.get (queue.py:180);"
     "Condition.wait (threading.py:331) 20", IDLE, {IDLE}),
    # ... woken by a request: handling it is input, inside the idle wait
    (LOOP + ";install.<locals>._process_engine_step (vllm_patch/engine_loop.py:95);"
     "idle_wait (vllm_patch/engine_loop.py:74);"
     "EngineCoreProc._handle_client_request (vllm/v1/engine/core.py:1700);"
     "EngineCore.add_request (vllm/v1/engine/core.py:300) 1", INPUT, {IDLE, INPUT}),
    # vLLM's 1 ms nap after a step that ran no model (time.sleep: no Python frame below)
    (LOOP + ";install.<locals>._process_engine_step (vllm_patch/engine_loop.py:93);"
     "EngineCoreProc._process_engine_step (vllm/v1/engine/core.py:1617) 6", IDLE, {IDLE}),
    # upstream's blocking input_queue.get when no request is left
    (LOOP + ";EngineCoreProc._process_input_queue (vllm/v1/engine/core.py:1588);"
     "Queue.get (queue.py:171);Condition.wait (threading.py:327) 30", IDLE, {IDLE}),
    # the loop's own glue
    (STEP.rsplit(";", 1)[0] + ";Queue.put_nowait (queue.py:191) 2", OTHER, {OTHER}),
]
#: threads that are not the engine loop: not counted
OTHER_THREADS = [
    "thread (101): Thread-1 (process_input_sockets);Thread._bootstrap (threading.py:1002);"
    "EngineCoreProc.process_input_sockets (vllm/v1/engine/core.py:1888);Poller.poll (zmq/sugar/poll.py:106) 124",
    "thread (102): MultiprocWorkerMonitor;Thread._bootstrap (threading.py:1002);"
    "_PollLikeSelector.select (selectors.py:415) 124",
]


def test_parse_raw_frames_threads_counts():
    stacks = parse_raw([CASES[0][0] + "\n", "\n", OTHER_THREADS[0]])
    assert len(stacks) == 2
    first = stacks[0]
    assert first.thread == "MainThread" and first.count == 7
    assert first.frames[0].func == "<module>" and first.frames[0].file == "<string>"
    leaf = first.frames[-1]
    assert (leaf.func, leaf.file, leaf.line) == (
        "OutputRateSchedulerMixin._orl_order_running", "vllm_patch/scheduler.py", 246)
    assert leaf.short == "_orl_order_running"
    # a thread name with parentheses, a frame without a line number
    second = stacks[1]
    assert second.thread == "Thread-1 (process_input_sockets)" and second.count == 124
    (nolineno,) = parse_raw(["thread (0x7f): MainThread;f (a/b.py);g (c.py:3) 2"])
    assert nolineno.frames[0].line is None and nolineno.frames[0].file == "a/b.py"
    (no_threads,) = parse_raw(["f (a.py:1);g (b.py:2) 9"])
    assert no_threads.thread is None and len(no_threads.frames) == 2
    with pytest.raises(ValueError):
        parse_raw(["f (a.py:1) notacount"])


def _installed(line: str) -> str:
    """The same stack from a wheel install: site-packages/vllm_output_rate/..."""
    site = "/usr/lib/python3.11/site-packages/vllm_output_rate/"
    return (line.replace("(vllm_patch/", "(" + site)
            .replace("(telemetry/", "(" + site + "telemetry/")
            .replace("(tracing/", "(" + site + "tracing/"))


@pytest.mark.parametrize("layout", ["checkout", "wheel"])
@pytest.mark.parametrize("line,want_self,want_incl", CASES,
                         ids=[f"{i}-{c[1]}" for i, c in enumerate(CASES)])
def test_classify(line, want_self, want_incl, layout):
    if layout == "wheel":
        line = _installed(line)
        assert "vllm_patch/" not in line
    (stack,) = parse_raw([line])
    self_cat, inclusive = classify(stack.frames)
    assert self_cat == want_self
    assert set(inclusive) == want_incl


def test_report_shares_add_up_and_inclusive_covers_self():
    report = build_report(parse_raw([c[0] for c in CASES] + OTHER_THREADS))
    total = sum(int(c[0].rsplit(" ", 1)[1]) for c in CASES)
    assert report.total == total
    assert report.threads == ["MainThread"]
    assert dict(report.other_threads) == {"Thread-1 (process_input_sockets)": 124,
                                          "MultiprocWorkerMonitor": 124}
    assert sum(report.self_counts[c] for c in CATEGORIES) == total
    assert sum(report.self_share(c) for c in CATEGORIES) == pytest.approx(1.0)
    for cat in CATEGORIES:
        assert report.inclusive_counts[cat] >= report.self_counts[cat]
    # the expected counts, summed over the fixed stacks
    for cat in CATEGORIES:
        want_self = sum(int(c[0].rsplit(" ", 1)[1]) for c in CASES if c[1] == cat)
        want_incl = sum(int(c[0].rsplit(" ", 1)[1]) for c in CASES if cat in c[2])
        assert (report.self_counts[cat], report.inclusive_counts[cat]) == (want_self, want_incl), cat
    # a stack in two categories is counted once in each inclusive column
    assert report.inclusive_counts[SCHEDULE] == 7 + 11 + 5 + 3 + 2 + 13
    assert report.inclusive_counts[LIMITER] == 7 + 5 + 3
    assert report.limiter_in_schedule == 7 + 5 + 3
    assert report.limiter_self_in_schedule == 7 + 5
    table = profile_stacks.format_table({"on": report, "off": report})
    assert "| schedule() |" in table and "on self" in table and "off incl." in table


def test_speedscope_file_is_one_profile_per_thread():
    stacks = parse_raw([c[0] for c in CASES] + OTHER_THREADS)
    doc = profile_stacks.to_speedscope(stacks, "on")
    assert doc["$schema"].endswith("file-format-schema.json")
    frames = doc["shared"]["frames"]
    assert len(doc["profiles"]) == 3 and "MainThread" in doc["profiles"][0]["name"]
    main = doc["profiles"][0]
    assert main["endValue"] == sum(main["weights"]) == build_report(stacks).total
    for sample in main["samples"]:
        assert all(0 <= i < len(frames) for i in sample)
    json.dumps(doc)


def _fake_py_spy(tmp_path, message: str, code: int = 1) -> str:
    exe = tmp_path / "py-spy"
    exe.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        sys.stderr.write({message!r} + "\\n")
        sys.exit({code})
        """))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


@pytest.fixture
def fake_engine_core():
    """A process whose command line names it an engine core (once it does:
    right after the fork it still has this process's command line)."""
    import psutil

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "VLLM::EngineCore"])
    deadline = time.monotonic() + 30
    while "VLLM::EngineCore" not in " ".join(psutil.Process(proc.pid).cmdline()):
        assert time.monotonic() < deadline, "the fake engine core never named itself"
        time.sleep(0.01)
    yield proc
    proc.kill()
    proc.wait()


def test_permission_error_says_what_to_do(tmp_path, fake_engine_core, capsys):
    exe = _fake_py_spy(tmp_path, "Error: Permission Denied: Try running again with elevated "
                       "permissions by going 'sudo env \"PATH=$PATH\" !!'")
    rc = prof.main(["--pid", str(fake_engine_core.pid), "--no-load", "--seconds", "1",
                    "--py-spy", exe, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc != 0
    assert f"could not attach to the engine-core process (pid {fake_engine_core.pid})" in err
    assert "ptrace_scope=0" in err and "SYS_PTRACE" in err and "root" in err
    assert "Permission Denied" in err  # py-spy's own words are kept


def test_other_py_spy_failure_and_missing_engine(tmp_path, fake_engine_core, capsys):
    exe = _fake_py_spy(tmp_path, "Error: Failed to find python version", code=1)
    rc = prof.main(["--pid", str(fake_engine_core.pid), "--no-load", "--py-spy", exe,
                    "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc != 0 and "py-spy failed" in err and "ptrace_scope" not in err
    # a process that is no engine core and has no engine-core child
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        rc = prof.main(["--pid", str(plain.pid), "--no-load", "--py-spy", exe])
    finally:
        plain.kill()
        plain.wait()
    err = capsys.readouterr().err
    assert rc != 0 and "not a vLLM engine core" in err


def test_compare_off_needs_own_servers(capsys):
    assert prof.main(["--pid", str(os.getpid()), "--compare-off"]) != 0
    assert "--compare-off starts its own servers" in capsys.readouterr().err


@pytest.mark.e2e
def test_profile_real_engine(tmp_path, engines):
    """A real tiny-model server with one user throttled (the pool's tiny
    engine: `profile_engine.serve_args`' flags, its limits from the file):
    a short recording under load has samples in schedule() and in the
    limiter, shares add up."""
    server = engines.get("tiny", default=100_000, users={"user-a": 20})
    core = prof.find_engine_core(server.proc.pid, timeout_s=30)
    # Sampling: schedule() is a few percent of the engine loop and the
    # limiter a fraction of that (about 6 of 1,250 samples), so a short
    # recording can miss it by chance: up to three recordings before calling
    # it absent. 250 Hz: py-spy pauses the engine for each sample, and on two
    # cores shared with the load it takes 8 ms a sample (5 s at 1 kHz
    # recorded for 22-39 s; at 250 Hz for 9)
    for attempt in range(3):
        out = tmp_path / f"attempt-{attempt}"
        out.mkdir()
        report = prof.profile_engine(
            core, out, "on", seconds=5, base_url=server.base_url,
            plan=[("user-a", 4, 200), ("user-b", 4, 900)], warmup_s=2.0, rate=250)
        if report.inclusive_counts[LIMITER] > 0:
            break
    print("\n" + profile_stacks.format_table({"on": report}))
    assert report.threads == ["MainThread"]
    assert report.total > 0
    assert sum(report.self_counts[c] for c in CATEGORIES) == report.total
    assert sum(report.self_share(c) for c in CATEGORIES) == pytest.approx(1.0)
    for cat in CATEGORIES:
        assert report.inclusive_counts[cat] >= report.self_counts[cat]
    assert report.inclusive_counts[SCHEDULE] > 0
    assert report.inclusive_counts[LIMITER] > 0
    assert report.inclusive_counts[MODEL] > 0
    assert report.meta["tokens"].get("user-b", 0) > 0  # the load ran during the recording
    # the files people open
    assert (out / "on.raw.txt").read_text().strip()
    doc = json.loads((out / "on.speedscope.json").read_text())
    assert doc["profiles"] and doc["shared"]["frames"]
    saved = json.loads((out / "on.report.json").read_text())
    assert saved["samples"] == report.total
