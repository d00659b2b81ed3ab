"""Scheduler cost with the limiter on vs off, side by side in one run.

Drives the real vLLM Scheduler and KV cache manager with synthetic model
outputs (no model), R requests resident and decoding, spread over U users.
A share of the users is throttled (0.001 tok/s: after their first token they
are refused every step; ``--throttled-rate`` sets another limit); the others
have a limit that never binds.

Reports per-step ``schedule()`` + ``update_from_output()`` time, as the
median over interleaved blocks (on, off, on, off, ...) so that machine noise
hits both alike, and the ratio on/off. With the limiter off every resident
request runs every step; with it on, throttled requests are skipped.

    .venv/bin/python -m vllm_output_rate.tools.bench.scheduler            # full grid
    .venv/bin/python -m vllm_output_rate.tools.bench.scheduler --quick    # R=64,256 only
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

from vllm_output_rate.tools.common.help_text import PlainHelpFormatter
from vllm_output_rate.tools.common.scheduler_driver import (
    VirtualClock,
    attach_telemetry,
    make_request,
    make_scheduler,
    model_output_for,
)

PROMPT = 16
NEVER_BINDS = 10**9
THROTTLED = "0.001"
#: --cpu: measure the process's CPU time per step (see measure_same)
CPU = False
#: --thread-cpu: measure the scheduler thread's own CPU time per step
THREAD_CPU = False
#: --shared-state: the store URL of shared-budget mode (see measure_same)
SHARED_STATE: str | None = None
#: --waiting: requests of the throttled users waiting beside the resident
#: ones (the resident set full): what a step scans for the slots it keeps
WAITING = 0
#: --prompt-rate: every user's prompt budget (tokens/s) in the limited arm
#: (None: no prompt budgets)
PROMPT_RATE: float | None = None


def build(limited: bool, running: int, users: int, throttled_share: float):
    # Requests go to users in contiguous blocks, so that the throttled share
    # of users is also the throttled share of requests.
    users = min(users, running)
    throttled_users = round(users * throttled_share)
    user_names = [f"u{i}" for i in range(users)]
    limits = None
    if limited:
        limits = {
            "default_user_output_tokens_per_second": NEVER_BINDS,
            "user_output_tokens_per_second": throttled_limits(user_names[:throttled_users]),
        }
        if PROMPT_RATE is not None:
            limits["default_prompt_rate"] = str(PROMPT_RATE)
    if limited and SHARED_STATE is not None:
        import redis

        # each scheduler its own budgets: nothing left over from another row
        redis.Redis.from_url(SHARED_STATE).flushdb()
        limits["shared_state"] = SHARED_STATE
    clock = VirtualClock()
    sched = make_scheduler(
        limits, clock=clock, num_blocks=running * 64, max_num_seqs=running,
        max_num_batched_tokens=max(2048, running * PROMPT), max_model_len=4096,
        enable_prefix_caching=False,
    )
    for i in range(running):
        sched.add_request(make_request(user_names[i * users // running], prompt_len=PROMPT, max_tokens=4000))
    waiting_users = user_names[:throttled_users] or user_names
    for i in range(WAITING):
        sched.add_request(make_request(waiting_users[i % len(waiting_users)], prompt_len=PROMPT,
                                       max_tokens=4000))
    return sched, clock


def throttled_limits(users: list[str]) -> dict[str, str]:
    """The throttled users' limits: ``THROTTLED`` for all; a limit that
    lets them through (above 0.01 tok/s) is spread over +-20% so that they
    come through in different steps, as users who started at different
    times would, not all in the same step."""
    rate = float(THROTTLED)
    if rate <= 0.01 or len(users) < 2:
        return {u: THROTTLED for u in users}
    return {u: f"{rate * (0.8 + 0.4 * i / (len(users) - 1)):.4f}" for i, u in enumerate(users)}


def step(sched, clock, via=None) -> float:
    """One timed step of ``sched``; ``via`` runs it through another view of
    the same scheduler (vLLM's own methods under our mixin)."""
    run = sched if via is None else via
    t0 = time.perf_counter()
    out = run.schedule()
    t1 = time.perf_counter()
    mro = model_output_for(sched, out)
    t2 = time.perf_counter()
    run.update_from_output(out, mro)
    t3 = time.perf_counter()
    clock.advance_ms(10)
    return (t1 - t0) + (t3 - t2)


#: An OTLP/HTTP trace receiver in its own process: accepts and counts spans.
RECEIVER = r"""
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200); self.send_header("Content-Type", "application/x-protobuf"); self.end_headers()
    def log_message(self, *a): pass
s = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_port, flush=True)
s.serve_forever()
"""


def start_receiver():
    """(process, OTLP/HTTP traces URL) of a receiver on loopback."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    return proc, f"http://127.0.0.1:{port}/v1/traces"


def with_telemetry(pair, directory: str, traces_url: str | None = None):
    """All engine telemetry on a limited scheduler: metrics exported by
    their thread, and (with ``traces_url``) spans through the real OTLP/HTTP
    exporter and batch processor, as the engine core builds them."""
    import os

    from vllm_output_rate.internals import SchedulerView
    from vllm_output_rate.telemetry.engine import _span_recorder

    sched, clock = pair
    spans = None
    if traces_url is not None:
        os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = traces_url
        os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
        spans = _span_recorder(SchedulerView(sched))
        assert spans is not None and spans.drops is not None
    attach_telemetry(sched, directory, spans=spans)
    return pair


def close_telemetry(sched) -> None:
    """Stop ``sched``'s telemetry, if any, and say if spans were dropped."""
    telemetry = sched.output_rate.observer
    if telemetry is None:
        return
    sched.output_rate.observer = None
    telemetry.close()
    if telemetry.spans is not None and any(telemetry.spans.drops.counts.values()):
        print(f"  (spans dropped: {telemetry.spans.drops.counts})", flush=True)


def measure_pair(running: int, users: int, share: float, blocks: int, block_steps: int,
                 telemetry_dir: str | None, traces_url: str | None, on_first: bool,
                 control: bool = False):
    """(on, off, active, on/off) medians of one freshly built pair of schedulers."""
    def build_on():
        pair = build(True, running, users, share)
        if telemetry_dir is not None:
            pair = with_telemetry(pair, telemetry_dir, traces_url)
        return pair

    # "off" is vLLM's own scheduler, or with telemetry_dir the limited
    # scheduler without telemetry.
    # With ``control`` both arms are the same (the method's noise floor).
    limited_off = telemetry_dir is not None or control
    if on_first:
        on = build_on()
        off = build(limited_off, running, users, share)
    else:
        off = build(limited_off, running, users, share)
        on = build_on()
    for pair in (on, off):  # prefill + a few decode steps: steady state
        for _ in range(5):
            step(*pair)
    on_times, off_times = [], []
    # The cyclic GC would land its pauses on whichever side allocates when
    # a threshold trips: collect between blocks, not inside them.
    # What was built stays out of the collections (each would walk the
    # whole KV block pool otherwise).
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        for _ in range(blocks):
            gc.collect()
            on_times.append(statistics.median(step(*on) for _ in range(block_steps)))
            gc.collect()
            off_times.append(statistics.median(step(*off) for _ in range(block_steps)))
    finally:
        gc.enable()
        gc.unfreeze()
    active = len(on[0].output_rate.last_step.charged)
    close_telemetry(on[0])
    on_median, off_median = statistics.median(on_times), statistics.median(off_times)
    return on_median, off_median, active, on_median / off_median


def measure_same(running: int, users: int, share: float, blocks: int, block_steps: int,
                 telemetry_dir: str | None, traces_url: str | None, control: bool = False):
    """(on, off, active, on/off, on/off with the metrics export charged in
    full, the scheduler thread's own on/off, the background threads' CPU
    per on step over an off step (the last three ``CPU`` only)) on ONE
    limited scheduler whose steps alternate
    between the two arms, so both arms see the same requests in the same
    memory (no build-to-build difference at all).

    Limiter on/off: an "off" step runs vLLM's own ``schedule()`` and
    ``update_from_output()`` (the classes under the mixin) on the instance,
    with vLLM's own ``_reserve_prefill_lookahead``,
    ``_handle_blocked_waiting_request`` and ``allocate_slots``: upstream
    code on the same state (a request the limiter keeps waiting, its
    prompt just in time for its user's budget, is admitted by the first
    "off" step and stays resident after, throttled in "on" steps). Telemetry: an "off" step is the same
    scheduler with its telemetry observers unset. Shared state: an "off"
    step is the same scheduler with a plain limiter of the same limits in
    place of the shared-budget one (whose lease thread keeps running against
    the store in both arms). With ``control`` both arms run the same code
    (the method's noise floor).
    """
    from vllm_output_rate.charges import choose
    from vllm_output_rate.limiter import OutputRateLimiter
    from vllm_output_rate.scheduler import OutputRateSchedulerMixin

    sched, clock = pair = build(True, running, users, share)
    if telemetry_dir is not None:
        with_telemetry(pair, telemetry_dir, traces_url)
    upstream = super(OutputRateSchedulerMixin, sched)
    telemetry = sched.output_rate.observer
    shared = sched.output_rate.limiter if SHARED_STATE is not None else None
    plain = None
    if shared is not None:
        plain = OutputRateLimiter(shared.default_rate, shared.user_rates)

    def step_off() -> float:
        if control:
            return step(sched, clock)
        if shared is not None:
            choose(sched.output_rate, plain, None)
            sched.output_rate.limiter_begin = None
            took = step(sched, clock)
            choose(sched.output_rate, shared, None)
            sched.output_rate.limiter_begin = shared.begin_step
            return took
        if telemetry_dir is not None:
            sched.output_rate.observer = None
            took = step(sched, clock)
            sched.output_rate.observer = telemetry
            return took
        # (vLLM's own hooks too: its admission admits a waiting request the
        # limiter holds back just in time, as vLLM without the limiter would)
        sched._reserve_prefill_lookahead = upstream._reserve_prefill_lookahead
        sched._handle_blocked_waiting_request = upstream._handle_blocked_waiting_request
        sched.kv_cache_manager.__dict__.pop("allocate_slots", None)
        took = step(sched, clock, via=upstream)
        del sched._reserve_prefill_lookahead
        del sched._handle_blocked_waiting_request
        return took

    spans = telemetry.spans if telemetry is not None else None

    def block(arm: str) -> float:
        run = (lambda: step(sched, clock)) if arm == "on" else step_off
        if not (CPU or THREAD_CPU):
            return statistics.median(run() for _ in range(block_steps))
        # The scheduler thread's own CPU time per step; what the telemetry
        # threads spend is added to the on arm below (only its steps give
        # them work).
        c0 = time.thread_time()
        for _ in range(block_steps):
            run()
        return (time.thread_time() - c0) / block_steps

    # (Shared budgets: until the leases keep up with the demand; the store
    # runs on real time, the scheduler on the fake clock.)
    for _ in range(5 if shared is None else 100):
        step(sched, clock)
        if shared is not None:
            time.sleep(0.002)
    on_times, off_times = [], []
    # The metrics export runs once a second of wall time whatever the steps
    # (a snapshot of every series, written out): over this run it also runs
    # in the off arm's seconds, which a process running the on arm only
    # would not spend on it. Its CPU (the folds it starts with aside: those
    # are the steps' work) is timed apart and charged at the on arm's share
    # of the run's wall time; charged in full as well (the last value).
    export_cpu = [0.0]
    if CPU and hasattr(telemetry, "export"):
        export = telemetry.export

        def timed_export() -> bool:
            telemetry.drain()
            c0 = time.thread_time()
            try:
                return export()
            finally:
                export_cpu[0] += time.thread_time() - c0

        telemetry.export = timed_export
    wall = {"on": 0.0, "off": 0.0}
    if CPU and hasattr(telemetry, "drain"):  # what the warm-up handed over, before counting
        telemetry.drain()
    if CPU and spans is not None:
        spans.flush()
        spans.provider.force_flush()
    background = background_cpu()
    run_start = time.perf_counter()
    # What was built stays out of the collections (each would walk the
    # whole KV block pool otherwise).
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        for i in range(blocks):
            # ABBA order: neither arm always follows the other
            arms = ("on", "off") if i % 2 == 0 else ("off", "on")
            for arm in arms:
                gc.collect()
                w0 = time.perf_counter()
                (on_times if arm == "on" else off_times).append(block(arm))
                wall[arm] += time.perf_counter() - w0
                if arm == "on" and not CPU and hasattr(telemetry, "drain"):
                    # (untimed: what the on arm handed over is folded now,
                    # not by the worker during the off arm's steps)
                    telemetry.drain()
    finally:
        gc.enable()
        gc.unfreeze()
    active = len(sched.output_rate.last_step.charged)
    if CPU:
        # The other threads' CPU over the run (telemetry's exporter, the
        # span builder, the batch span processor; the lease thread in
        # shared-budget mode runs in both arms), the on steps' spans built
        # and exported at the end, spread over the on steps.
        c0 = time.thread_time()
        if hasattr(telemetry, "drain"):
            telemetry.drain()
        if spans is not None:
            spans.flush()
            spans.provider.force_flush()
        extra = (time.thread_time() - c0) + background_cpu() - background
        run_wall = time.perf_counter() - run_start
        # (the two parts of the process's ratio, each read within this run:
        # the scheduler thread's own, block by block, and what the other
        # threads spent per on step over the off arm's mean step; their
        # sum is about the process's ratio)
        thread_only = statistics.geometric_mean(a / b for a, b in zip(on_times, off_times))
        off_mean = statistics.fmean(off_times)
        if export_cpu[0]:
            telemetry.export = export
        both = shared is not None or control  # (both arms give them work: half each)
        # (the export's CPU at the share of the wall time the arms giving
        # it work took)
        busy = wall["on"] + wall["off"] if both else wall["on"]
        share = extra / (len(on_times) * block_steps)
        at_wall = (extra - export_cpu[0] * (1 - busy / run_wall)) / (len(on_times) * block_steps)
        if both:
            share /= 2
            at_wall /= 2
            off_full = [t + share for t in off_times]
            off_times = [t + at_wall for t in off_times]
        else:
            off_full = off_times
        on_full = [t + share for t in on_times]
        on_times = [t + at_wall for t in on_times]
        in_full = statistics.geometric_mean(a / b for a, b in zip(on_full, off_full))
        bg_share = at_wall / off_mean
    close_telemetry(sched)
    if shared is not None:
        shared.close()
    average = statistics.fmean if CPU or THREAD_CPU else statistics.median
    # Block i of one arm ran right beside block i of the other (ABBA): the
    # machine's speed drifts by tens of percent over seconds, far less
    # within one pair of blocks, so the ratio is taken pair by pair.
    paired = statistics.geometric_mean(a / b for a, b in zip(on_times, off_times))
    if not CPU:
        return average(on_times), average(off_times), active, paired, None
    return average(on_times), average(off_times), active, paired, in_full, thread_only, bg_share


def background_cpu() -> float:
    """CPU seconds of every thread of this process but the calling one."""
    import threading

    me = threading.get_ident()
    total = 0.0
    for thread in threading.enumerate():
        if thread.ident is None or thread.ident == me:
            continue
        try:
            total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, ValueError):  # (a thread that just ended)
            pass
    return total


def measure(running: int, users: int, share: float, blocks: int, block_steps: int,
            telemetry_dir: str | None = None, traces_url: str | None = None, pairs: int = 4,
            control: bool = False, same: bool = False):
    """Limiter on vs off (or, with ``telemetry_dir``, limiter with telemetry
    vs limiter without) over ``pairs`` freshly built pairs of schedulers.

    Two schedulers built one after the other differ in speed by a few
    percent whatever they run (an A/A run of two identical schedulers gives
    0.97-1.03: where their objects landed in memory), and the one built
    first tends to be the faster. So each pair is measured on its own, the
    build order alternates from pair to pair, and the result is the
    geometric mean of the pairs' ratios with their spread.
    With ``same`` each "pair" is one scheduler alternating arms
    (``measure_same``).
    Returns (on ms, off ms, active, ratio, lowest ratio, highest ratio,
    ratio of means, ratio with the metrics export charged in full or None,
    the scheduler thread's own ratio or None, the background threads' CPU
    per on step over an off step or None; the last three with ``--cpu``).
    """
    results = []
    for i in range(pairs):
        if same:
            results.append(measure_same(running, users, share, blocks, block_steps,
                                        telemetry_dir, traces_url, control))
        else:
            results.append(measure_pair(running, users, share, blocks, block_steps,
                                        telemetry_dir, traces_url, on_first=i % 2 == 0,
                                        control=control))
        gc.collect()
    # One scheduler alternating arms: its block-by-block ratio (see
    # measure_same); two schedulers: the ratio of their medians.
    ratios = [r[3] for r in results]
    ratio = statistics.geometric_mean(ratios)
    of_means = statistics.geometric_mean(r[0] / r[1] for r in results)
    # (--cpu: the ratio with the metrics export charged in full, see measure_same)
    in_full = [r[4] for r in results if len(r) > 4 and r[4] is not None]
    parts = [r[5:7] for r in results if len(r) > 6]
    return (statistics.median(r[0] for r in results), statistics.median(r[1] for r in results),
            results[-1][2], ratio, min(ratios), max(ratios), of_means,
            statistics.geometric_mean(in_full) if in_full else None,
            statistics.geometric_mean(p[0] for p in parts) if parts else None,
            statistics.fmean(p[1] for p in parts) if parts else None)


def main(argv: list[str] | None = None) -> None:
    global THROTTLED, CPU, THREAD_CPU, SHARED_STATE, WAITING, PROMPT_RATE
    parser = argparse.ArgumentParser(prog="python -m vllm_output_rate.tools.bench.scheduler",
                                     description=__doc__, formatter_class=PlainHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="skip R=1024")
    parser.add_argument("--sizes", type=int, nargs="*", help="running requests R to measure")
    parser.add_argument("--telemetry", action="store_true",
                        help="compare limiter with telemetry vs limiter without (not limiter on/off)")
    parser.add_argument("--no-traces", action="store_true",
                        help="with --telemetry: metrics only, no spans to the OTLP receiver")
    parser.add_argument("--users", type=int, nargs="*", help="user counts (default 1 16 256)")
    parser.add_argument("--shares", type=float, nargs="*", help="throttled shares (default 0 0.5 0.9)")
    parser.add_argument("--pairs", type=int, default=4,
                        help="freshly built scheduler pairs per row, alternating build order")
    parser.add_argument("--control", action="store_true",
                        help="A/A control: both arms the same limited scheduler (ratio should be 1)")
    parser.add_argument("--same-scheduler", action="store_true",
                        help="one scheduler per pair, its steps alternating between the arms")
    parser.add_argument("--throttled-rate", type=float, default=float(THROTTLED),
                        help="limit (tokens/s) of the throttled users: the default is refused "
                        "every step after the first token; 10 lets each throttled user through "
                        "about once every 10 steps (10 ms fake steps; limits spread +-20%%), so "
                        "the throttled set changes in every step")
    parser.add_argument("--cpu", action="store_true",
                        help="with --same-scheduler: CPU time of the whole process (every "
                        "thread) per step: the scheduler thread's per block (mean over "
                        "blocks), and the other threads' over the run (the telemetry "
                        "threads: only the on arm's steps give them work) spread over the "
                        "on steps; the metrics export, which runs once a second whatever the "
                        "steps, at the on arm's share of the wall time (a last column: "
                        "charged in full)")
    parser.add_argument("--thread-cpu", action="store_true",
                        help="with --same-scheduler: the scheduler thread's own CPU time per "
                        "step (mean over blocks; the telemetry worker's is in --cpu)")
    parser.add_argument("--shared-state", action="store_true",
                        help="with --same-scheduler: shared-budget mode (a redis-server started "
                        "on loopback, the lease thread running) vs the plain limiter")
    parser.add_argument("--waiting", type=int, default=0,
                        help="requests of the throttled users (of all users without any) "
                        "waiting beside the R resident ones, which fill the resident set: "
                        "each step looks through them for users with budget (the worst "
                        "case of the slots a step keeps: none found)")
    parser.add_argument("--prompt-rate", type=float, default=None,
                        help="every user's prompt budget (prompt tokens/s) in the limited arm: "
                        "the limiter's cost with prompt budgets on (the decodes of the rows "
                        "compute no prompt: the budgets' cost where nothing is to charge)")
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--block-steps", type=int, default=5)
    args = parser.parse_args(argv)
    SHARED_STATE = None
    WAITING = args.waiting
    PROMPT_RATE = args.prompt_rate
    THROTTLED = str(args.throttled_rate)
    CPU = args.cpu
    THREAD_CPU = args.thread_cpu
    redis_server = None
    if args.shared_state:
        from vllm_output_rate.tools.redis_server import RedisServer

        if not args.same_scheduler:
            parser.error("--shared-state needs --same-scheduler")
        redis_server = RedisServer().start()
        SHARED_STATE = redis_server.url
        print("on = shared-budget limiter (leases from a local redis-server), off = the plain "
              "limiter on the same scheduler\n")
    sizes = args.sizes or ([64, 256] if args.quick else [64, 256, 1024])
    rows = []
    telemetry_dir = traces_url = receiver = None
    if args.telemetry:
        import tempfile

        telemetry_dir = tempfile.mkdtemp(prefix="bench-telemetry-")
        if not args.no_traces:
            receiver, traces_url = start_receiver()
        print("on = limiter with engine telemetry (metrics exported every second"
              + ("" if args.no_traces else "; spans through the OTLP/HTTP exporter to a receiver "
                 "process") + "), off = limiter without telemetry\n")
    print(f"{args.pairs} {'schedulers (arms alternating)' if args.same_scheduler else 'pairs'} per row;"
          " on/off is the geometric mean of their ratios"
          + (" (each scheduler's: the geometric mean of its side-by-side blocks' ratios;"
             " the ratio of means column, of its arms' means)" if args.same_scheduler else "") + "\n")
    full_col = CPU and args.same_scheduler
    if full_col:
        print("(--cpu: the process's on/off is about the scheduler thread's own on/off plus the "
              "background threads' CPU per on step over an off step: both printed last)\n")
    print("| R | users | throttled share | active/step (on) | on ms/step | off ms/step | on/off "
          "| pairs' range | ratio of means |"
          + (" export in full | thread's own | background share |" if full_col else ""))
    print("|---:|---:|---:|---:|---:|---:|---:|---|---:|" + ("---:|---:|---:|" if full_col else ""))
    for running in sizes:
        for users in args.users or (1, 16, 256):
            for share in (0.0, 0.5, 0.9) if args.shares is None else args.shares:
                if users == 1 and share > 0:
                    continue  # one user is either throttled or not
                on, off, active, ratio, low, high, of_means, in_full, thread, bg = measure(
                    running, users, share, args.blocks, args.block_steps,
                    telemetry_dir, traces_url, args.pairs, args.control, args.same_scheduler)
                rows.append((running, users, share, active, on, off, ratio))
                print(f"| {running} | {users} | {share:.0%} | {active} | {on * 1e3:.3f} | "
                      f"{off * 1e3:.3f} | {ratio:.3f} | {low:.3f}-{high:.3f} | {of_means:.3f} |"
                      + (f" {in_full:.3f} | {thread:.3f} | {bg:.3f} |"
                         if full_col and in_full is not None else
                         " | | |" if full_col else ""), flush=True)
    if receiver is not None:
        receiver.terminate()
    if redis_server is not None:
        redis_server.close()


if __name__ == "__main__":
    main()
