"""The demo: a tiny local model served with per-user limits, load, results.

1. generate the tiny random-weight Llama and its tokenizer (no hub);
2. serve it with ``--output-rate-default-tokens-per-second`` and overrides;
3. stream load through the OpenAI API: user-a 4 streams at 20 tok/s,
   user-b 1 stream at 100 tok/s, user-c (10,000 tok/s, far above what two
   stream can do on a CPU) 2 streams;
4. print per user: limit, achieved rate over its first-to-last token, tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from fractions import Fraction

from vllm_output_rate.tools.common.help_text import PlainHelpFormatter
from vllm_output_rate.tools.common.tiny_model import cache_dir, default_model_dir

DEFAULT_LIMIT = 10_000
#: user-c is listed at the default so that its metrics have their own label
#: from the first token (unlisted users get one once among the top-K active)
USER_LIMITS = {"user-a": 20, "user-b": 100, "user-c": DEFAULT_LIMIT}
PLAN = [("user-a", 4, 100), ("user-b", 1, 400), ("user-c", 2, 600)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-output-rate demo", description=__doc__,
                                     formatter_class=PlainHelpFormatter)
    parser.add_argument("--model-dir", default=None,
                        help="where the tiny model is made (default: %s)" % default_model_dir())
    parser.add_argument("--model", default=None,
                        help="serve this model directory as it is instead of making the tiny "
                        "model (any model vLLM's CPU engine loads; sizes are in its tokens)")
    parser.add_argument("--log", default=None,
                        help="server log (default: %s)" % (cache_dir() / "logs" / "demo-server.log"))
    args = parser.parse_args(argv)
    args.log = args.log or str(cache_dir() / "logs" / "demo-server.log")
    args.model_dir = args.model_dir or str(default_model_dir())

    from tqdm import tqdm

    from vllm_output_rate.telemetry.metrics import series_name
    from vllm_output_rate.tools.common.client import Server, metric_value, run_load, scrape_metrics, summarize
    from vllm_output_rate.tools.common.tiny_model import ensure_tiny_model

    if args.model:
        model = args.model
        print(f"[1/3] model {model}")
    else:
        print(f"[1/3] tiny model in {args.model_dir}")
        model = str(ensure_tiny_model(args.model_dir))
    serve_args = [
        "--max-num-seqs", "16", "--max-num-active-seqs", "8", "--max-model-len", "1024",
        "--output-rate-default-tokens-per-second", str(DEFAULT_LIMIT),
        "--output-rate-user-tokens-per-second", json.dumps(USER_LIMITS),
    ]
    print("[2/3] starting vllm-output-rate serve (about a minute on a CPU); log: " + args.log)
    print("      limits: default %s tok/s per user, overrides %s" % (DEFAULT_LIMIT, USER_LIMITS))
    t0 = time.monotonic()
    with Server(model, serve_args, args.log) as server:
        print(f"      ready in {time.monotonic() - t0:.0f} s at {server.base_url}")
        total = sum(streams * tokens for _, streams, tokens in PLAN)
        print("[3/3] streaming load: " + ", ".join(f"{u} {s} stream(s) x {n} tokens" for u, s, n in PLAN))
        before = scrape_metrics(server.base_url)
        with tqdm(total=total, unit="tok", desc="load", mininterval=0.5) as bar:
            results = asyncio.run(run_load(server.base_url, PLAN, progress=bar))
        time.sleep(2.5)  # the engine exports its telemetry every second
        after = scrape_metrics(server.base_url)

    limits = {u: Fraction(v) for u, v in USER_LIMITS.items()}
    rows = summarize(results, limits)
    print()
    def delta(name: str, user: str) -> float:
        return metric_value(after, name, user=user) - metric_value(before, name, user=user)

    print(f"{'user':<8} {'limit tok/s':>11} {'streams':>7} {'tokens':>7} {'span s':>7} "
          f"{'rate tok/s':>10} {'rate/limit':>10} {'complete':>8} "
          f"{'engine charged':>14} {'engine spacing ms':>17}")
    ok = True
    for row in sorted(rows, key=lambda r: r.user):
        limit = limits.get(row.user, Fraction(DEFAULT_LIMIT))
        ratio = row.rate / float(limit)
        charged = delta(series_name("tokens_charged"), row.user)
        count = delta(series_name("inter_token_seconds", "count"), row.user)
        spacing = delta(series_name("inter_token_seconds", "sum"), row.user) / count if count else 0.0
        print(f"{row.user:<8} {float(limit):>11g} {row.streams:>7} {row.tokens:>7} "
              f"{row.span_s:>7.2f} {row.rate:>10.1f} {ratio:>10.3f} {row.complete:>5}/{row.streams} "
              f"{charged:>14.0f} {spacing * 1e3:>17.2f}")
        ok &= row.errors == 0 and row.complete == row.streams
    print("\nrate: measured at the client, from each user's first to last streamed token.")
    print("engine charged / spacing: from the engine's own telemetry on /metrics (mean")
    print("spacing between consecutive tokens of a stream: streams / limit when held).")
    print("user-a and user-b are held at their limits; user-c, far below its limit, runs")
    print("at the engine's own speed. Errors: " + ("none" if ok else "see above"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
