"""The verification's report: ``report.md`` (every check, the per-user
figures, the plots) and the summary printed after a run."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from vllm_output_rate.limiter import BURST_NS
from vllm_output_rate.telemetry.metrics import series_name
from vllm_output_rate.tools.loadgen.run import RequestRecord
from vllm_output_rate.tools.verify.analysis import EVENTS_ENV, STALL_FACTOR, Analysis, Check, UserStats
from vllm_output_rate.tools.verify.checks import IDLE_GAUGES
from vllm_output_rate.tools.verify.plots import plot_spacing_cdf, plot_throttled, plot_timeline

PLOTS = {"timeline.png": "Per-user token timeline", "spacing_cdf.png": "Spacing CDF per user",
         "throttled_kv.png": "Throttled requests and KV over time"}


def write_report(a: Analysis, checks: list[Check], stats: dict[str, UserStats], out_dir: Path,
                 notes: list[str] = ()) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    plots_ok = []
    for name, fn in (("timeline.png", plot_timeline),
                     ("spacing_cdf.png", lambda a_, p: plot_spacing_cdf(a_, stats, p)),
                     ("throttled_kv.png", plot_throttled)):
        try:
            import matplotlib

            matplotlib.use("Agg")
            fn(a, out_dir / name)
            plots_ok.append(name)
        except Exception as exc:  # a plot must not hide the verdict
            notes = [*notes, f"plot {name} failed: {type(exc).__name__}: {exc}"]
    ok = all(c.ok for c in checks)
    sc = a.scenario
    start = a.limits_in_force() or {}
    lines = [f"# Engine-side ITL verification: {'PASS' if ok else 'FAIL'}", "",
             f"Scenario `{sc.name}` ({sc.path}), run `{a.run.run_id}` against {a.run.base_url}; "
             f"{len(a.run.requests)} requests in {len(sc.phases)} phase(s)"
             + (" (the run hit its timeout)" if a.run.timed_out else "") + ".",
             f"Engine limits: default {start.get('default_limit')}, overrides "
             f"`{json.dumps(start.get('limits'))}`; expected: "
             + ", ".join(f"{u} {'unlimited' if r is None else f'{float(r):g}'}"
                         for u, r in sc.users.items()) + ".", ""]
    failed = [c for c in checks if not c.ok]
    if failed:
        lines += ["Failed: " + ", ".join(f"`{c.label}`" for c in failed), ""]
    lines += ["## Checks", "", "| check | result | measured |", "|---|---|---|"]
    for c in checks:
        lines.append(f"| `{c.label}` | {'pass' if c.ok else '**FAIL**'} | {c.summary} |")
        for d in c.details:
            lines.append(f"|  | | {d} |")
    lines += ["", "## Per user (engine-side)", "",
              "| user | limit tok/s | requests | tokens | demand s | rate tok/s | rate/limit | "
              "stream spacing p50 ms | streams/limit ms | user spacing p50 ms | worst window |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for user, st in stats.items():
        lim = "unlimited" if st.limit is None else f"{float(st.limit):g}"
        ratio = "" if st.limit is None else f"{st.rate / float(st.limit):.3f}"
        g = st.gcra
        worst = (f"{g['tokens']} tok in {g['window_s']:.2f} s (bound {g['bound']})"
                 if g.get("tokens") is not None else "")
        exp = "" if math.isnan(st.expected_ms) else f"{st.expected_ms:.1f}"
        lines.append(f"| {user} | {lim} | {st.requests} | {st.tokens} | {st.demand_s:.1f} | "
                     f"{st.rate:.2f} | {ratio} | {st.spacing_p50_ms:.2f} | {exp} | "
                     f"{st.user_spacing_p50_ms:.2f} | {worst} |")
    lines += ["", "## Requests", "",
              "| phase | user | requests | prompt | max_tokens | tokens | finish | cancelled | errors |",
              "|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[RequestRecord]] = defaultdict(list)
    for r in a.run.requests:
        groups[(r.phase, r.user, r.prompt, r.max_tokens)].append(r)
    for (phase, user, prompt, mt), rs in groups.items():
        fins = sorted({str(r.finish_reason) for r in rs})
        lines.append(f"| {phase} | {user} | {len(rs)} | {prompt} | {mt} | "
                     f"{'/'.join(str(r.completion_tokens) for r in rs)} | {', '.join(fins)} | "
                     f"{sum(r.cancelled for r in rs)} | {sum(r.error is not None for r in rs)} |")
    lines += ["", "## Plots", ""]
    lines += [f"![{PLOTS[p]}]({p})" for p in plots_ok]
    lines += ["", "## Method", "",
              "Every figure above comes from the engine core's own event log "
              f"(`{EVENTS_ENV}`): one `tokens` line per engine step with the step's output "
              "tokens per request, stamped when the step's output was processed; `finished` per "
              "request; the throttled state about once a second. Client-side times are not used "
              "for any check (HTTP buffering blurs them).", "",
              f"- **GCRA bound**: for every pair of token events i <= j of a user (both "
              f"included), tokens <= floor((W + {BURST_NS / 1e9:g} s) x limit) + 1, exact integer arithmetic. "
              f"*Step slack*: the limiter charges when a step is dispatched, the event is stamped "
              f"when its output is processed, so a token's stamp lags its charge by its step's "
              f"duration, which varies (a step with a long prefill takes longer). W is therefore "
              f"measured from the engine output {a.lag} step(s) before event i (the earliest "
              f"moment event i's step can have been dispatched: "
              f"{'synchronous scheduling dispatches a step after the previous output' if a.lag == 1 else 'async scheduling dispatches one step ahead'}) "
              f"to event j: exactly one engine step of slack, never a fixed time. The same check "
              f"without slack is reported in the details when it differs.",
              f"- **Rate**: demand exceeds the limit while at least one request of the user is "
              f"generating (from its first to its last token; one stream alone runs far above "
              f"every limit here, see the unlimited user's spacing). Rate = (tokens - segments) / "
              f"total length of the union of those intervals; need >= {sc.checks.rate_min_ratio:g} "
              f"x limit.",
              f"- **Spacing**: each gap between consecutive tokens of one request, divided by "
              f"k / limit with k the user's requests generating at the gap's midpoint; the p50 of "
              f"that ratio must be within {sc.checks.spacing_tolerance:g} of 1.",
              f"- **Unlimited users**: engine-side per-request spacing p50 in phase "
              f"`{sc.checks.compare_phase}` (beside the limited users) over phase "
              f"`{sc.checks.baseline_phase}` (alone) must be <= {sc.checks.unlimited_max_ratio:g}. "
              f"The tolerance is a ratio, not equality: a CPU step gets slower with every sequence "
              f"and every prefill in the batch, and the limited users still get their budget, so "
              f"some of the unlimited user's steps carry their tokens too; the median is robust to "
              f"the occasional long-prompt prefill step. Without the limiter the limited users' "
              f"streams would be in every step at full speed.",
              "- **Complete**: every request the client did not cancel: a finish reason, no "
              "error, `completion_tokens` = tokens in the engine's events = the engine's "
              "`output_tokens`; `ignore_eos` answers have all `max_tokens`.",
              f"- **Freed**: every cancelled request has a `finished` event; after the run the "
              f"last throttled-state line is all zero and {', '.join(IDLE_GAUGES)} are 0 on "
              f"/metrics. vLLM publishes its scheduler gauges with a step's output, so an abort "
              f"handled while the engine is idle can leave them stale: the verifier sends one "
              f"1-token probe request after the run and scrapes after it (a request left "
              f"behind would still show as running then).",
              f"- **Resumed**: the user was throttled (requests skipped on /metrics or in the "
              f"engine log), every request it did not cancel finished, and no request waited "
              f"longer than {STALL_FACTOR:g} x streams/limit + {sc.checks.stall_extra_s:g} s between two "
              f"tokens.",
              f"- **Charged**: the engine charged ({series_name('tokens_charged')}, delta over the "
              "run) at least the tokens it produced, and at most one extra token per request "
              "(allowed over-charge: a step dispatched before a cancel or after a stop).", ""]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    (out_dir / "checks.json").write_text(json.dumps(
        [{"check": c.label, "ok": c.ok, "summary": c.summary, "details": c.details} for c in checks],
        indent=1))
    return path


def print_summary(checks: list[Check], stats: dict[str, UserStats], a: Analysis) -> None:
    for user, st in stats.items():
        if st.limit is not None:
            print(f"{user}: limit {float(st.limit):g} tok/s, engine-side rate {st.rate:.2f} "
                  f"({st.rate / float(st.limit):.3f} x), stream spacing p50 "
                  f"{st.spacing_p50_ms:.1f} ms vs streams/limit {st.expected_ms:.1f} ms")
        else:
            print(f"{user}: unlimited, engine-side rate {st.rate:.1f} tok/s, "
                  f"stream spacing p50 {st.spacing_p50_ms:.2f} ms")
    for c in checks:
        print(f"  {'ok  ' if c.ok else 'FAIL'} {c.label}: {c.summary}")
        if not c.ok:
            for d in c.details[:5]:
                print(f"         {d}")
