"""Side by side with upstream vLLM on the real CPU engine (tiny model), in one run.

Starts, one after another, three servers with the same command:
``limiter`` (sync scheduling, the limit flags given), ``upstream`` (the same
command without the limit flags: the plugin installs nothing, vLLM's own
scheduler) and ``limiter, async`` (the limit flags and
``OUTPUT_RATE_FORCE_ASYNC_SCHEDULING=1``), and measures:

1. isolation: an unlimited user B (one stream at a time, sequential requests)
   alone, then while user A floods with 32 streams (A limited with the
   limiter, not limited upstream): B's TTFT and token spacing p50/p99, each as
   a ratio to B alone on the same server. Per-user figures are client-side in
   both arms (upstream has no per-user metrics); the limiter arm adds B's
   engine-side spacing from the per-user spacing histogram
   (``inter_token_seconds`` in ``vllm_output_rate.telemetry.metrics``).
2. throughput when no limit binds: 16 streams of 4 users whose limit is far
   above what the engine does, output tokens/s engine-side (vLLM's own
   ``vllm:generation_tokens_total``), limiter vs upstream.
3. idle behaviour: engine-core CPU while every user is throttled (limiter) vs
   an upstream engine with nothing to do, and the limiter's engine with
   nothing to do.
4. the seed's experiment: a 20 tok/s user with 1 and 4 streams (200 tokens
   each) beside a 100 tok/s user, sync and async scheduling; rates engine-side
   (from the per-user spacing histogram) and client-side.

The flooding and saturating load runs in a separate client process, as
non-streaming requests, so the measuring client's event loop only carries
B's stream and the load on the engine stays steady. Prints a Markdown
report and writes it (and the raw figures as JSON) to ``--out``.

    flock /tmp/orl-engine.lock .venv/bin/python -m vllm_output_rate.tools.bench.compare_upstream
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

import psutil
from vllm_output_rate import settings
from vllm_output_rate.config import USER_FIELD
from vllm_output_rate.tools.common.help_text import PlainHelpFormatter
from vllm_output_rate.telemetry.metrics import metric, series_name
from vllm_output_rate.tools.common.client import (
    http_limits,
    Samples,
    Server,
    StreamResult,
    metric_value,
    run_load,
    scrape_metrics,
    summarize,
)
from vllm_output_rate.tools.common.stats import quantile

SERVE_ARGS = ["--max-num-seqs", "64", "--max-num-active-seqs", "16", "--max-model-len", "1024"]
UNLIMITED = 100_000
LIMITS = {
    "user-a": 50,        # the flooder, with the limiter
    "user-b": UNLIMITED,  # listed so that it has its own metric label at once
    "seed-20": 20,
    "seed-100": 100,
    "slow": 0.5,
    **{f"tp-{i}": UNLIMITED for i in range(4)},
}
LIMIT_FLAGS = ["--output-rate-default-tokens-per-second", str(UNLIMITED),
               "--output-rate-user-tokens-per-second", json.dumps(LIMITS)]
#: the per-user spacing histogram (family name: hist_delta adds the series suffixes)
SPACING = metric("inter_token_seconds").full_name
FLOOD = [("user-a", 32, 1000)]
SATURATE = [(f"tp-{i}", 4, 512) for i in range(4)]


# -- load in a separate process ------------------------------------------------------

async def _keep_streams(base_url: str, plan: list[tuple[str, int, int]]) -> None:
    """Non-streaming requests: one response per request keeps this client and
    the API server (which share the 2 cores with the engine) out of the way,
    so the load on the engine is steady."""
    import httpx

    async def slot(client: Any, user: str, n: int) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Explain batching."}],
                "max_tokens": n, "ignore_eos": True, "vllm_xargs": {USER_FIELD: user}}
        while True:
            try:
                resp = await client.post(f"{base_url}/v1/chat/completions", json=body)
                ok = resp.status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                await asyncio.sleep(0.5)

    limits = http_limits(256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await asyncio.gather(*(slot(client, u, n) for u, s, n in plan for _ in range(s)))


def _load_process_main(base_url: str, plan: list[tuple[str, int, int]]) -> None:
    asyncio.run(_keep_streams(base_url, plan))


class BackgroundLoad:
    """``plan``'s requests kept running (finished ones replaced) in a child process."""

    def __init__(self, base_url: str, plan: list[tuple[str, int, int]]):
        self.proc = mp.get_context("spawn").Process(
            target=_load_process_main, args=(base_url, plan), daemon=True)

    def __enter__(self) -> BackgroundLoad:
        self.proc.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.proc.terminate()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


# -- figures -------------------------------------------------------------------------

def token_gaps(r: StreamResult) -> list[float]:
    """Client-side spacing per token: a chunk carrying k tokens adds its gap
    since the previous chunk and k - 1 zeros."""
    gaps: list[float] = []
    prev_t, prev_n = None, 0
    for t, n in r.chunks:
        if n <= 0:
            continue
        if prev_t is not None and n > prev_n:
            gaps.append(t - prev_t)
            gaps.extend([0.0] * (n - prev_n - 1))
        prev_t, prev_n = t, n
    return gaps


def hist_delta(before: Samples, after: Samples, name: str, **labels: str) -> tuple[list[tuple[float, float]], float, float]:
    """Cumulative buckets [(le, count)], sum and count of a histogram between two scrapes."""
    les: dict[float, float] = {}
    for (n, ls), v in after.items():
        d = dict(ls)
        if n == f"{name}_bucket" and all(d.get(k) == w for k, w in labels.items()):
            le = float(d["le"])
            les[le] = les.get(le, 0.0) + v - before.get((n, ls), 0.0)
    buckets = sorted(les.items())
    s = metric_value(after, f"{name}_sum", **labels) - metric_value(before, f"{name}_sum", **labels)
    c = metric_value(after, f"{name}_count", **labels) - metric_value(before, f"{name}_count", **labels)
    return buckets, s, c


def hist_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus-style histogram_quantile (linear inside the bucket)."""
    if not buckets or buckets[-1][1] <= 0:
        return float("nan")
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if le == float("inf"):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def engine_core(server: Server) -> psutil.Process:
    from vllm_output_rate.tools.bench.profile_engine import find_engine_core

    return psutil.Process(find_engine_core(server.proc.pid, timeout_s=30))


def cpu_share(core: psutil.Process, seconds: float) -> float:
    before, t0 = core.cpu_times(), time.monotonic()
    time.sleep(seconds)
    after, t1 = core.cpu_times(), time.monotonic()
    return ((after.user + after.system) - (before.user + before.system)) / (t1 - t0)


def b_requests(server: Server, n: int, tokens: int) -> list[StreamResult]:
    """User B's sequential requests (one stream at a time)."""
    async def run() -> list[StreamResult]:
        out = []
        for _ in range(n):
            out += await run_load(server.base_url, [("user-b", 1, tokens)])
        return out
    return asyncio.run(run())


def b_figures(results: list[StreamResult]) -> dict[str, Any]:
    ttft = [r.first - r.started for r in results if r.first is not None]
    ttlt = [r.last - r.started for r in results if r.last is not None]
    gaps = [g for r in results for g in token_gaps(r)]
    return {
        "requests": len(results),
        "complete": sum(r.completion_tokens == r.max_tokens and r.error is None for r in results),
        "ttft_p50": quantile(ttft, 0.5), "ttft_p99": quantile(ttft, 0.99),
        "gap_p50": quantile(gaps, 0.5), "gap_p99": quantile(gaps, 0.99),
        "gap_mean": statistics.fmean(gaps) if gaps else float("nan"),
        "ttlt_p50": quantile(ttlt, 0.5), "ttlt_p99": quantile(ttlt, 0.99),
        "errors": [r.error for r in results if r.error][:3],
    }


def isolation(server: Server, limited: bool, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase in ("alone", "flood"):
        s0 = scrape_metrics(server.base_url)
        if phase == "alone":
            results = b_requests(server, args.b_requests, args.b_tokens)
        else:
            with BackgroundLoad(server.base_url, FLOOD):
                time.sleep(args.flood_warmup)
                results = b_requests(server, args.b_requests, args.b_tokens)
        time.sleep(2.5)  # the engine exports its telemetry every second
        s1 = scrape_metrics(server.base_url)
        fig = b_figures(results)
        itl_b, itl_s, itl_c = hist_delta(s0, s1, "vllm:inter_token_latency_seconds")
        _, ttft_s, ttft_c = hist_delta(s0, s1, "vllm:time_to_first_token_seconds")
        fig["engine_itl_mean_all"] = itl_s / itl_c if itl_c else float("nan")
        fig["engine_ttft_mean_all"] = ttft_s / ttft_c if ttft_c else float("nan")
        if limited:
            b, s, c = hist_delta(s0, s1, SPACING, user="user-b")
            fig["engine_b_gap_mean"] = s / c if c else float("nan")
            fig["engine_b_gap_p50"] = hist_quantile(b, 0.5)
            fig["engine_b_gap_p99"] = hist_quantile(b, 0.99)
            charged = series_name("tokens_charged")
            a_tokens = (metric_value(s1, charged, user="user-a")
                        - metric_value(s0, charged, user="user-a"))
            fig["a_charged_tokens"] = a_tokens
        out[phase] = fig
        print(f"  isolation {phase}: {json.dumps(fig, default=str)}", flush=True)
    return out


def throughput(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    windows = []
    with BackgroundLoad(server.base_url, SATURATE):
        time.sleep(args.tp_warmup)
        for _ in range(args.tp_windows):
            s0, t0 = scrape_metrics(server.base_url), time.monotonic()
            time.sleep(args.tp_seconds)
            s1, t1 = scrape_metrics(server.base_url), time.monotonic()
            tokens = (metric_value(s1, "vllm:generation_tokens_total")
                      - metric_value(s0, "vllm:generation_tokens_total"))
            windows.append(tokens / (t1 - t0))
    out = {"windows": windows, "median": statistics.median(windows)}
    print(f"  throughput: {json.dumps(out)}", flush=True)
    return out


def idle(server: Server, limited: bool, args: argparse.Namespace) -> dict[str, Any]:
    core = engine_core(server)
    out: dict[str, Any] = {"no_requests": cpu_share(core, args.idle_seconds)}
    if limited:
        async def throttled() -> float:
            task = asyncio.create_task(run_load(server.base_url, [("slow", 2, 6)]))
            await asyncio.sleep(2.0)  # prefill and the burst are done
            share = await asyncio.to_thread(cpu_share, core, args.idle_seconds)
            await task
            return share
        out["all_throttled"] = asyncio.run(throttled())
    print(f"  idle: {json.dumps(out)}", flush=True)
    return out


def seed_experiment(server: Server) -> dict[str, Any]:
    out = {}
    for streams in (1, 4):
        plan = [("seed-20", streams, 200), ("seed-100", 1, 1000)]
        s0 = scrape_metrics(server.base_url)
        results = asyncio.run(run_load(server.base_url, plan))
        time.sleep(2.5)
        s1 = scrape_metrics(server.base_url)
        client = {s.user: s for s in summarize(results, {})}
        row: dict[str, Any] = {}
        for user, n in (("seed-20", streams), ("seed-100", 1)):
            _, s, c = hist_delta(s0, s1, SPACING, user=user)
            row[user] = {
                # n streams running side by side: n tokens per mean spacing
                "engine_rate": n * c / s if s else float("nan"),
                "client_rate": client[user].rate,
                "tokens": client[user].tokens,
                "complete": client[user].complete,
                "streams": client[user].streams,
                "errors": [r.error for r in results if r.user == user and r.error][:3],
                "finish": sorted({str(r.finish_reason) for r in results if r.user == user}),
            }
        out[f"{streams}_streams"] = row
        print(f"  seed {streams} stream(s): {json.dumps(row)}", flush=True)
    return out


# -- report --------------------------------------------------------------------------

def _r(x: float, base: float) -> str:
    return f"{x / base:.2f}" if base and base == base and x == x else "n/a"


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}" if x == x else "n/a"


def report(res: dict[str, Any], args: argparse.Namespace, elapsed_s: float) -> str:
    lim, up = res["limiter"], res["upstream"]
    lines = [f"Run of {time.strftime('%Y-%m-%d')}, {elapsed_s / 60:.1f} min, servers: "
             f"`vllm-output-rate serve <tiny model> {' '.join(SERVE_ARGS)}` plus, for the "
             f"limiter arms, the limit flags (A = `user-a` limited to {LIMITS['user-a']} tok/s, "
             f"every other user {UNLIMITED:,} tok/s unless listed).", ""]

    lines += ["**1. Isolation**: user B, one stream at a time, "
              f"{args.b_requests} requests x {args.b_tokens} tokens, streamed, alone and while A "
              f"keeps 32 requests x {FLOOD[0][2]} tokens running (non-streaming, from a separate "
              "client process). Ratios are flood / alone on the same server (1.00 = B "
              "unaffected). Client-side spacing of a fast stream is blurred by HTTP and event-loop "
              "bunching on this 2-core machine (chunks arrive together: spacing near 0); time to "
              "last token is not.", "",
              "| figure | where | limiter: alone | limiter: A floods | limiter ratio "
              "| upstream: alone | upstream: A floods | upstream ratio |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    li, ui = lim["isolation"], up["isolation"]
    for key, label, where in (("ttft_p50", "B TTFT p50 (ms)", "client"),
                              ("ttft_p99", "B TTFT p99 (ms)", "client"),
                              ("gap_p50", "B spacing p50 (ms)", "client"),
                              ("gap_p99", "B spacing p99 (ms)", "client"),
                              ("gap_mean", "B spacing mean (ms)", "client"),
                              ("ttlt_p50", "B time to last token p50 (ms)", "client"),
                              ("ttlt_p99", "B time to last token p99 (ms)", "client"),
                              ("engine_b_gap_p50", "B spacing p50 (ms)", "engine, per user"),
                              ("engine_b_gap_p99", "B spacing p99 (ms)", "engine, per user"),
                              ("engine_b_gap_mean", "B spacing mean (ms)", "engine, per user"),
                              ("engine_itl_mean_all", "ITL mean, all users (ms)", "engine, vLLM"),
                              ("engine_ttft_mean_all", "TTFT mean, all users (ms)", "engine, vLLM")):
        la, lf = li["alone"].get(key, float("nan")), li["flood"].get(key, float("nan"))
        ua, uf = ui["alone"].get(key, float("nan")), ui["flood"].get(key, float("nan"))
        up_cells = (f"{_ms(ua)} | {_ms(uf)} | {_r(uf, ua)}" if key in ui["alone"]
                    else "n/a | n/a | no per-user metrics")
        lines.append(f"| {label} | {where} | {_ms(la)} | {_ms(lf)} | {_r(lf, la)} | {up_cells} |")
    lines += ["", f"B's requests complete: limiter {li['alone']['complete']}+{li['flood']['complete']}"
              f"/{2 * args.b_requests}, upstream {ui['alone']['complete']}+{ui['flood']['complete']}"
              f"/{2 * args.b_requests}; A's tokens charged during B's flood run (limiter): "
              f"{li['flood'].get('a_charged_tokens', 0):.0f}.", ""]

    lines += ["**2. Throughput, no limit binding**: 4 users x 4 requests x "
              f"{SATURATE[0][2]} tokens kept running (non-streaming), {args.tp_windows} windows of "
              f"{args.tp_seconds:.0f} s after {args.tp_warmup:.0f} s warm-up per server; output "
              "tokens/s engine-side (`vllm:generation_tokens_total`); each round starts a fresh "
              "limiter server, then a fresh upstream server.", "",
              "| round | limiter tok/s (windows) | upstream tok/s (windows) | "
              "limiter / upstream, medians (target >= 0.98) |",
              "|---|---:|---:|---:|"]
    all_l, all_u = [], []
    for rnd in range(args.rounds):
        suffix = "" if rnd == 0 else f"_tp{rnd}"
        lt, ut = res["limiter" + suffix]["throughput"], res["upstream" + suffix]["throughput"]
        all_l += lt["windows"]
        all_u += ut["windows"]
        lines.append(f"| {rnd + 1} | {lt['median']:.0f} ({', '.join(f'{w:.0f}' for w in lt['windows'])}) | "
                     f"{ut['median']:.0f} ({', '.join(f'{w:.0f}' for w in ut['windows'])}) | "
                     f"{lt['median'] / ut['median']:.3f} |")
    ml, mu = statistics.median(all_l), statistics.median(all_u)
    lines += [f"| all | {ml:.0f} | {mu:.0f} | {ml / mu:.3f} |", ""]

    lid, uid = lim["idle"], up["idle"]
    lines += [f"**3. Idle behaviour**: engine-core CPU (user + system) over {args.idle_seconds:.0f} s, "
              "share of one core (psutil).", "",
              "| state | limiter | upstream |", "|---|---:|---:|",
              f"| every user throttled (2 streams of a 0.5 tok/s user) | "
              f"{lid['all_throttled']:.1%} | (no throttling upstream) |",
              f"| no requests | {lid['no_requests']:.1%} | {uid['no_requests']:.1%} |", ""]

    lines += ["**4. The seed's experiment**: `seed-20` (20 tok/s) with 1 or 4 streams x 200 tokens "
              "beside `seed-100` (100 tok/s, 1 stream x 1000 tokens), `ignore_eos`. Engine-side: "
              "streams / mean engine-side spacing of the user's tokens "
              f"(`{SPACING}`); client-side: tokens after the first over "
              "the user's first-to-last token span. The seed (RTX 4090, Qwen3-8B, client-side): "
              "20.1-20.2 and 102 tok/s.", "",
              "| scheduling | seed-20 streams | seed-20 engine | seed-20 client | "
              "seed-100 engine | seed-100 client | complete |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for mode, key in (("sync", "limiter"), ("async", "limiter_async")):
        for streams in (1, 4):
            row = res[key]["seed"][f"{streams}_streams"]
            a, b = row["seed-20"], row["seed-100"]
            lines.append(f"| {mode} | {streams} | {a['engine_rate']:.2f} | {a['client_rate']:.2f} | "
                         f"{b['engine_rate']:.1f} | {b['client_rate']:.1f} | "
                         f"{a['complete'] + b['complete']}/{a['streams'] + b['streams']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_output_rate.tools.bench.compare_upstream",
                                     description=__doc__,
                                     formatter_class=PlainHelpFormatter)
    parser.add_argument("--out", default=str(Path(".cache") / "compare-upstream.md"))
    parser.add_argument("--b-requests", type=int, default=8)
    parser.add_argument("--b-tokens", type=int, default=200)
    parser.add_argument("--flood-warmup", type=float, default=5.0)
    parser.add_argument("--tp-warmup", type=float, default=5.0)
    parser.add_argument("--tp-windows", type=int, default=3)
    parser.add_argument("--tp-seconds", type=float, default=10.0)
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--skip-async", action="store_true", help="no async-scheduling server")
    parser.add_argument("--rounds", type=int, default=2,
                        help="throughput: rounds of fresh limiter and upstream servers, "
                        "alternating (the first round also does everything else)")
    args = parser.parse_args(argv)

    from vllm_output_rate.tools.common.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model())
    logs = Path(".cache") / "logs"
    t_start = time.monotonic()
    res: dict[str, Any] = {}
    arms = [("limiter", LIMIT_FLAGS, {}), ("upstream", [], {})]
    if not args.skip_async:
        arms.append(("limiter_async", LIMIT_FLAGS,
                     settings.child_env(FORCE_ASYNC_SCHEDULING=True)))
    for extra in range(1, args.rounds):
        arms += [(f"limiter_tp{extra}", LIMIT_FLAGS, {}), (f"upstream_tp{extra}", [], {})]
    for name, flags, env in arms:
        print(f"[{time.monotonic() - t_start:5.0f} s] starting server: {name}", flush=True)
        with Server(model, SERVE_ARGS + flags, logs / f"compare-{name}.log",
                    extra_env={**settings.child_env(TELEMETRY=True), **env}) as server:
            limited = bool(flags)
            if name == "limiter_async":
                log = server.log_path.read_text(errors="replace")
                assert "OutputRateAsyncScheduler" in log, "the async server does not run async"
                res[name] = {"seed": seed_experiment(server)}
                continue
            if "_tp" in name:
                res[name] = {"throughput": throughput(server, args)}
                continue
            res[name] = {
                "isolation": isolation(server, limited, args),
                "throughput": throughput(server, args),
                "idle": idle(server, limited, args),
            }
            if limited:
                res[name]["seed"] = seed_experiment(server)
    if args.skip_async:
        res["limiter_async"] = {"seed": {k: {u: {"engine_rate": float("nan"), "client_rate": float("nan"),
                                                 "complete": 0, "streams": 0} for u in ("seed-20", "seed-100")}
                                         for k in ("1_streams", "4_streams")}}
    elapsed = time.monotonic() - t_start
    text = report(res, args, elapsed)
    print("\n" + text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2, default=str))
    print(f"written to {out} (and {out.with_suffix('.json').name})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
