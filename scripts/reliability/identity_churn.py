"""The ``identity_churn`` group: many distinct user ids through the real
scheduler and telemetry without a server (``identity_churn``), then
through a live server (``http_churn_case``): labels capped, state bounded,
memory flat."""

from __future__ import annotations

import asyncio
import tempfile
import time


from vllm_output_rate.telemetry.metrics import series_name
from vllm_output_rate.tools.reliability.cases import (
    CaseResult,
    Live,
    body_for,
    state_entries,
    wait_quiet,
)


def identity_churn(n_users: int, model: str | None = None, batch: int = 256, limit: int = 20,
                   max_tokens: int = 4) -> CaseResult:
    """``n_users`` distinct user ids, ``batch`` new ones per step, each with
    one request of ``max_tokens`` tokens, through the real scheduler and
    KV cache manager with the engine telemetry attached (no server: a fake
    clock, 10 ms steps, an export every 100 steps as the exporter's second).
    At ``limit`` tok/s a user's last token waits for its budget (the burst
    lets ``1 + 0.1 x limit`` through), so throttle episodes open and close
    too. Expected: the ``user`` label capped, no per-request state left,
    per-user state bounded, the limiter's users dropped once idle, and the
    process' memory flat over the second half of the run."""
    import gc

    import psutil

    from vllm_output_rate.core import CLEANUP_EVERY_STEPS
    from vllm_output_rate.telemetry.books import USER_STATES_CAP
    from vllm_output_rate.tools.common.scheduler_driver import (
        VirtualClock,
        attach_telemetry,
        make_request,
        make_scheduler,
        model_output_for,
    )

    case = CaseResult("identity_churn", f"{n_users:,} distinct user ids",
                      f"{n_users:,} users, {batch} new per 10 ms step, one request of {max_tokens} "
                      f"tokens each at {limit} tok/s; real scheduler and telemetry, fake clock",
                      "user label capped; no per-request state left; per-user state bounded; "
                      "limiter users dropped when idle; RSS flat over the second half")
    t0 = time.perf_counter()
    clock = VirtualClock()
    in_flight = batch * (2 + max_tokens * 100 // max(1, limit))
    sched = make_scheduler({"default_user_output_tokens_per_second": limit}, clock=clock, model=model,
                           max_num_seqs=in_flight, max_num_batched_tokens=16 * in_flight,
                           num_blocks=2 * in_flight + 64)
    proc = psutil.Process()
    with tempfile.TemporaryDirectory(prefix="output-rate-churn-") as out_dir:
        tel = attach_telemetry(sched, out_dir, start_thread=False)
        steps = 0

        peak_sizes: dict[str, int] = {}
        peak_limiter = 0

        def step() -> None:
            nonlocal steps, peak_limiter
            out = sched.schedule()
            sched.update_from_output(out, model_output_for(sched, out))
            clock.advance_ms(10)
            steps += 1
            if steps % 100 == 0:
                tel.export()
            if steps % 25 == 0:  # the peaks, while adding and draining
                peak_limiter = max(peak_limiter, len(sched.output_rate.limiter))
                for key, v in tel.state_sizes().items():
                    peak_sizes[key] = max(peak_sizes.get(key, 0), v)

        rss: dict[str, float] = {}
        marks = {"warm": n_users // 10, "half": n_users // 2}
        added = 0
        while added < n_users:
            k = min(batch, n_users - added)
            for i in range(k):
                sched.add_request(make_request(f"churn-{added + i}", prompt_len=8, max_tokens=max_tokens))
            before, added = added, added + k
            step()
            for name, at in marks.items():
                if before < at <= added:
                    gc.collect()
                    rss[name] = proc.memory_info().rss / 2**20
        while sched.has_requests():
            step()
        tel.export()
        gc.collect()
        rss["end"] = proc.memory_info().rss / 2**20
        # idle, past every user's budget; then one request and enough steps
        # for the limiter's periodic cleanup
        clock.advance_ms(2000)
        sched.add_request(make_request("churn-last", prompt_len=8, max_tokens=CLEANUP_EVERY_STEPS + 1))
        for _ in range(CLEANUP_EVERY_STEPS + 2):
            step()
        tel.export()
        sizes = tel.state_sizes()
        limiter_users = len(sched.output_rate.limiter)
        labels = sizes["labels"]
        cap = tel.labeler.top_k + len(tel.labeler.pinned) + 1
    per_request = {k: v for k, v in sizes.items() if k.startswith("requests.") and v > 1}
    bound = {k: v for k, v in peak_sizes.items() if k.startswith("users.")}
    # per-user state may hold the users of one export interval (100 steps)
    # and the introspection cap, whatever the number of ids
    per_user_cap = 2 * batch * 100 + 61 * USER_STATES_CAP
    # the limiter drops idle users every CLEANUP_EVERY_STEPS steps: it may
    # hold the users of that many steps, and the live ones
    limiter_cap = (CLEANUP_EVERY_STEPS + 1) * batch + in_flight
    growth = rss["end"] - rss["half"]
    case.seconds = time.perf_counter() - t0
    case.measured = (f"{steps} steps in {case.seconds:.0f} s; user labels {labels} (cap {cap}); "
                     f"per-request entries left {sum(v for k, v in sizes.items() if k.startswith('requests.'))} "
                     f"(the one live request's); per-user entries at most {max(bound.values(), default=0)} "
                     f"(bound {per_user_cap}, whatever the number of ids); "
                     f"limiter users at most {peak_limiter} during (bound {limiter_cap}), {limiter_users} after idle; "
                     f"RSS {rss['warm']:.0f} MiB at 10%, {rss['half']:.0f} at 50%, {rss['end']:.0f} at the end "
                     f"(+{growth:.1f} MiB over the second half)")
    case.ok = (labels <= cap and not per_request and limiter_users <= 1
               and max(bound.values(), default=0) <= per_user_cap
               and peak_limiter <= limiter_cap and growth <= 64)
    return case


async def http_churn_case(live: Live, n_users: int, server_pid: int) -> CaseResult:
    """``n_users`` distinct user ids through a real server (16 requests at a
    time, 2 tokens each): every request served, the ``user`` label capped,
    the engine core's own state back to empty or bounded once quiet, its
    RSS flat (read with psutil; state sizes from ``/metrics``)."""
    import psutil

    from vllm_output_rate import settings
    from vllm_output_rate.core import CLEANUP_EVERY_STEPS
    from vllm_output_rate.telemetry.books import USER_STATES_CAP
    from vllm_output_rate.tools.common.client import rss_mib
    from vllm_output_rate.tools.bench.profile_engine import find_engine_core

    top_k = int(settings.get_or_default("TOP_K_USERS"))
    label_cap = top_k + 2  # the top users, the configured one, the overflow bucket
    case = CaseResult(
        "identity_churn", f"{n_users:,} ids through the server",
        f"{n_users} non-streamed requests, max_tokens 2, each with a user id of its own, 16 at a time",
        f"every request HTTP 200; at most {label_cap} user labels on /metrics; once quiet the "
        "per-request state empty, per-user state bounded; the limiter's idle users dropped "
        "once the engine runs again (one more stream); engine-core RSS growth <= 64 MiB")
    t0 = time.perf_counter()
    try:
        engine = psutil.Process(find_engine_core(server_pid, timeout_s=30))
        gate = asyncio.Semaphore(16)

        async def one(user: str) -> int:
            async with gate:
                status, _ = await live.post(body_for(user, 2, False))
                return status

        await asyncio.gather(*(one(f"churn-warm-{i}") for i in range(64)))  # allocator warm-up
        await asyncio.sleep(2.5)
        rss_before = rss_mib(engine)
        statuses = await asyncio.gather(*(one(f"churn-http-{i}") for i in range(n_users)))
        quiet, seen = await wait_quiet(live)
        await asyncio.sleep(2.5)  # one export after going quiet
        rss_after = rss_mib(engine)
        idle_users = state_entries((await live.metrics())[0]).get("limiter.users", -1.0)
        # the limiter drops idle users every CLEANUP_EVERY_STEPS steps of the
        # engine (an idle engine runs none): one more stream, longer than
        # that, and the churned ids are gone
        status, _ = await live.post(body_for("churn-after", CLEANUP_EVERY_STEPS + 44, False))
        await asyncio.sleep(2.5)
        samples, _ = await live.metrics()
        users = {dict(ls).get("user") for (n, ls), _ in samples.items() if n == series_name("tokens_charged")}
        state = state_entries(samples)
        per_request = sum(v for k, v in state.items() if k.startswith("requests."))
        per_user = max((v for k, v in state.items() if k.startswith("users.")), default=0.0)
        limiter = state.get("limiter.users", -1.0)
        ok_status = sum(1 for st in statuses if st == 200)
        growth = rss_after - rss_before
        case.measured = (f"{ok_status}/{n_users} HTTP 200; {len(users)} user labels; after: {seen}; "
                         f"limiter users {idle_users:.0f} while idle, {limiter:.0f} after a "
                         f"{CLEANUP_EVERY_STEPS + 44}-token stream (HTTP {status}); per-request "
                         f"state {per_request:.0f}, largest per-user {per_user:.0f}; engine-core RSS "
                         f"{rss_before:.0f} -> {rss_after:.0f} MiB ({growth:+.1f})")
        case.ok = (ok_status == n_users and status == 200 and len(users) <= label_cap and quiet
                   and bool(state) and per_request == 0 and per_user <= 61 * USER_STATES_CAP
                   and 0 <= limiter <= 2 and growth <= 64)
    except Exception as exc:  # noqa: BLE001
        case.measured = f"{type(exc).__name__}: {exc}"[:300]
    case.seconds = time.perf_counter() - t0
    return case
