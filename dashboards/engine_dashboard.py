"""The engine dashboard (``output-rate-engine.json``): the engine loop's
idle waits and wake-up lateness, the limiter's cost, exact all-user
totals, the limits in force and their reloads, the shared budget store,
and the telemetry's own health. A function of the config."""

from __future__ import annotations

from vllm_output_rate.dashboards.config import Config, m, quantile
from vllm_output_rate.dashboards.expressions import (
    LIMITS_FAILED,
    LIMITS_FAILED_MATCHER,
    STORE_FAILED,
    STORE_OK,
    limit_sets_expr,
)
from vllm_output_rate.dashboards.panels import TOKS, Dashboard, Panel, Row, Target, right_axis
from vllm_output_rate.limits_watch import RESULTS as LIMITS_RESULTS


def engine_dashboard(c: Config) -> Dashboard:
    lateness = c.sel("wake_lateness_seconds", "_bucket")
    share = c.sel("schedule_limiter_ratio", "_bucket")
    items: list[Panel | Row] = [
        Row("Engine loop: waiting for budget without spinning"),
        Panel(
            "Wake-up lateness of the engine loop",
            "When only throttled work is left, the engine loop waits for the earliest time a "
            "user has budget again; this is how late it woke after that time. Healthy: p99 "
            f"well below {1000 * c['wake_lateness']['seconds']:.0f} ms (alert threshold); late "
            "wake-ups cost throttled users rate below their limit.",
            "s",
            [Target(quantile(0.5, lateness, c.by("engine")), "p50, engine {{engine}}" + c.on_group(), "positive"),
             Target(quantile(0.99, lateness, c.by("engine")), "p99, engine {{engine}}" + c.on_group(), "positive")]),
        Panel(
            "Idle waits per second, by what ended them",
            "Waits of the engine loop while only throttled requests remained (timeout: budget "
            "came back; input: a new request or an abort woke it). Healthy: waits only while "
            "every active user is throttled; none on a busy engine.",
            "suffix: waits/s",
            [Target(f"sum by ({c.by('engine', 'reason')}) (rate({m('idle_wait_seconds').full_name}_count"
                    f"{c.matchers(m('idle_wait_seconds').labels, '', True)}[$__rate_interval]))",
                    "{{reason}}, engine {{engine}}" + c.on_group(), "positive")]),
        Panel(
            "Idle wait duration",
            "How long one idle wait lasted, by what ended it (capped at 50 ms by design). "
            "Healthy: at most 50 ms; timeouts about the users' 1/limit or shorter.",
            "s",
            [Target(quantile(0.5, c.sel("idle_wait_seconds", "_bucket"), "reason"), "p50 {{reason}}", "positive"),
             Target(quantile(0.99, c.sel("idle_wait_seconds", "_bucket"), "reason"), "p99 {{reason}}", "positive")]),
        Row("Limiter cost"),
        Panel(
            "Limiter's share of schedule() time vs vLLM's step rate",
            "Share of each schedule() call spent in the limiter's own code (left axis) beside "
            "vLLM's engine steps per second (right axis). Healthy: the share stays small (a few "
            "percent) and does not grow with the step rate.",
            "percentunit",
            [Target(quantile(0.5, share, c.by("engine")), "limiter share p50, engine {{engine}}" + c.on_group(), "positive"),
             Target(quantile(0.99, share, c.by("engine")), "limiter share p99, engine {{engine}}" + c.on_group(), "positive"),
             Target(f"sum by ({c.by('engine')}) (rate({c.vsel('vllm:iteration_tokens_total', '_count')}[$__rate_interval]))",
                    "steps/s, engine {{engine}}" + c.on_group(), "positive")],
            overrides=[right_axis("steps/s.*", "suffix: steps/s")]),
        Panel(
            "Mean limiter share of schedule()",
            "Mean share of schedule() time spent in the limiter, per engine. Healthy: a few "
            "percent.",
            "percentunit",
            [Target(f"sum by ({c.by('engine')}) (rate({c.sel('schedule_limiter_ratio', '_sum')}[$__rate_interval]))"
                    f" / sum by ({c.by('engine')}) (rate({c.sel('schedule_limiter_ratio', '_count')}[$__rate_interval]))",
                    "engine {{engine}}" + c.on_group(), "positive")]),
        Row("All users (exact totals, no label cap)"),
        Panel(
            "Tokens charged and refunded, requests skipped: all users",
            "Exact engine totals (the per-user series are capped to configured plus the most "
            "active users). Healthy: refunds near 0; skips only while someone is throttled.",
            "suffix: /s",
            [Target(f"sum by ({c.by('engine')}) (rate({c.sel('engine_tokens_charged')}[$__rate_interval]))",
                    "charged tok/s, engine {{engine}}" + c.on_group(), "positive"),
             Target(f"sum by ({c.by('engine')}) (rate({c.sel('engine_tokens_refunded')}[$__rate_interval]))",
                    "refunded tok/s, engine {{engine}}" + c.on_group(), "data"),
             Target(f"sum by ({c.by('engine')}) (rate({c.sel('engine_requests_skipped')}[$__rate_interval]))",
                    "skips/s, engine {{engine}}" + c.on_group(), "positive")]),
        Panel(
            "Requests out of budget preempted for a request with budget",
            "Throttled requests (or borrowers) preempted so that a request of a user with "
            "budget runs: for a resident slot (every slot held, some by users with more "
            "streams than their budget and rate keep busy) or for KV blocks (--scheduling-policy priority). Each is recomputed "
            "when admitted again. Healthy: 0, or a trickle while one user asks for far more "
            "than its rate with many streams; a steady rate means --max-num-seqs is too small "
            "for the streams the limits let users open.",
            "suffix: /s",
            [Target(f"sum by ({c.by('engine', 'reason')}) (rate({c.sel('engine_throttled_preempted')}[$__rate_interval]))",
                    "{{reason}}, engine {{engine}}" + c.on_group(), "data")]),
        Panel(
            "Throttled requests and their KV blocks vs running and waiting requests",
            "Throttled requests and the KV blocks they hold (all users) beside vLLM's running "
            "and waiting requests. Healthy: waiting stays near 0 while requests are throttled "
            "(they gave their place away); throttled blocks small next to the cache.",
            "short",
            [Target(f"sum by ({c.by('engine')}) ({c.sel('engine_throttled_requests')})",
                    "throttled requests, engine {{engine}}" + c.on_group(), "positive"),
             Target(f"sum by ({c.by('engine')}) ({c.sel('engine_throttled_kv_blocks')})",
                    "throttled KV blocks, engine {{engine}}" + c.on_group(), "positive"),
             Target(f"sum by ({c.by('engine')}) ({c.vsel('vllm:num_requests_running')})",
                    "running (vLLM), engine {{engine}}" + c.on_group(), "data"),
             Target(f"sum by ({c.by('engine')}) ({c.vsel('vllm:num_requests_waiting')})",
                    "waiting (vLLM), engine {{engine}}" + c.on_group(), "data")]),
        Panel(
            "Engine-side inter-token spacing, all users",
            "Spacing between consecutive output tokens over all users (exact, no label cap). "
            "Healthy: p50 near the engine step time when nobody is throttled.",
            "s",
            [Target(quantile(0.5, c.sel("engine_inter_token_seconds", "_bucket"), c.by("engine")), "p50, engine {{engine}}" + c.on_group(), "positive"),
             Target(quantile(0.99, c.sel("engine_inter_token_seconds", "_bucket"), c.by("engine")), "p99, engine {{engine}}" + c.on_group(), "positive")]),
        *limits_panels(c),
        *shared_store_panels(c),
        Row("Configuration and telemetry health"),
        Panel(
            "Configured limits",
            "The output-token limits each engine runs with: per-user overrides and the default "
            "for everyone else. Healthy: the same on every engine serving a model, and as the "
            "deployment intends.",
            TOKS,
            [Target(f"max by ({c.by('model_name', 'engine', 'user')}) ({c.sel('user_limit_tokens_per_second')})",
                    "", "users", instant=True, format="table"),
             Target(f'label_replace(max by ({c.by("model_name", "engine")}) ({c.sel("default_limit_tokens_per_second")}), '
                    f'"user", "(default)", "", "")', "", "data", instant=True, format="table")],
            kind="table"),
        Panel(
            "Telemetry snapshot age",
            "Seconds since the engine core wrote the snapshot that /metrics shows (written every "
            "second by its exporter thread). Healthy: 1-2 s plus the scrape interval; a steady "
            "climb means the exporter or the engine core is stuck.",
            "s",
            [Target(f"time() - max by ({c.by('engine')}) ({c.sel('telemetry_snapshot_timestamp_seconds')})",
                    "engine {{engine}}" + c.on_group(), "data")]),
        Panel(
            "Telemetry dropped",
            "Engine snapshots that failed to export, by reason (the output_rate_ metrics are "
            "stale while this grows). Healthy: always 0.",
            "short",
            [Target(f"sum by ({c.by('engine', 'reason')}) (increase({c.sel('telemetry_dropped')}[$__rate_interval]))",
                    "{{reason}}, engine {{engine}}" + c.on_group(), "data")]),
        Panel(
            "The project's own state in the engine core",
            "Entries held per container: requests.* per live request (back to 0 when nothing "
            "runs), users.*, labels and series bounded by the label cap, limiter.users the users "
            "whose budget is not full (idle ones dropped every 256 steps). Healthy: flat under "
            "any churn of user ids; a steady climb is a leak.",
            "short",
            [Target(f"sum by ({c.by('engine', 'container')}) ({c.sel('state_entries')})",
                    "{{container}}, engine {{engine}}" + c.on_group(), "data")]),
    ]
    return Dashboard(
        "output-rate-engine", "Output rate: engine loop and cost",
        "The output-rate limiter inside vLLM's engine: idle waits and wake-up lateness, the "
        "limiter's share of schedule(), exact all-user totals, configured limits.", items)


def limits_panels(c: Config) -> list[Panel | Row]:
    """The limits in force: their digest per engine, how many distinct ones
    a fleet runs, reloads of the limits file by result, their age."""
    loaded = c.sel("limits_loaded_timestamp_seconds")
    fleet_legend = "{{model_name}}" + "".join(f" in {{{{{label}}}}}" for label in c.same_by())
    failed = LIMITS_FAILED_MATCHER
    ok = f'result=~"{"|".join(r for r in LIMITS_RESULTS if r not in LIMITS_FAILED)}"'
    reloads = "sum by ({by}) (increase({sel}[$__rate_interval]))"
    return [
        Row("Limits"),
        Panel(
            "Distinct limits in force per model",
            "How many different sets of limits (SHA-256 of the limits file, or of the "
            "command-line options, in force) the engines of each model run"
            + (f", per {', '.join(c.same_by())}" if c.same_by() else "")
            + ", over every replica the variables select. Healthy: 1 (green); 2 or more (red) "
            "means a user's limit depends on the replica serving it: see the table beside, and "
            f"above 1 for {c['limits_differ']['for']} the 'limits differ' alert fires.",
            "short",
            [Target(limit_sets_expr(c, dashboard=True), fleet_legend, "positive")],
            kind="stat", w=6, thresholds=[("green", None), ("red", 2)]),
        Panel(
            "Limits in force per engine (SHA-256, source, loaded ago)",
            "Per engine and replica: the SHA-256 of the limits in force (of the limits file's "
            "bytes: `sha256sum` of the file gives the same; with limits from the command line, "
            "of their normalized form), where they come from (the file, or 'command line') and "
            "how long ago they were loaded. Healthy: one SHA-256 on every row of a model, equal "
            "to the file an SRE last wrote, loaded within a second or two of each other.",
            "s",
            [Target(f"max by ({c.by('model_name', 'engine', 'sha256', 'source')}) ({c.sel('limits_info')})"
                    f" * on ({c.by('model_name', 'engine')}) group_left ()"
                    f" (time() - max by ({c.by('model_name', 'engine')}) ({loaded}))",
                    "", "positive", instant=True, format="table")],
            kind="table", w=18,
            overrides=[{"matcher": {"id": "byName", "options": "Value"},
                        "properties": [{"id": "displayName", "value": "loaded ago"},
                                       {"id": "unit", "value": "s"}]}]),
        Panel(
            "Limits file reloads by result",
            "Looks at the limits file that found it changed (or were asked by SIGHUP), per "
            "interval: loaded (new limits in force), unchanged (same content), and in red "
            "bars the failures: invalid (refused by the checks) and unreadable. A bad file is "
            "counted once. Healthy: a 'loaded' when someone changes the file, on every engine "
            "at about the same time; never a red bar (after one, the limits in force are older "
            "than the file: the 'reload failed' alert fires).",
            "short",
            [Target(reloads.format(by=c.by("engine", "result"), sel=c.sel("limits_reloads", extra=ok)),
                    "{{result}}, engine {{engine}}" + c.on_group(), "data"),
             Target(reloads.format(by=c.by("engine", "result"), sel=c.sel("limits_reloads", extra=failed)),
                    "FAILED {{result}}, engine {{engine}}" + c.on_group(), "data")],
            overrides=[
                {"matcher": {"id": "byRegexp", "options": "^FAILED.*"},
                 "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}},
                                {"id": "custom.drawStyle", "value": "bars"},
                                {"id": "custom.fillOpacity", "value": 100},
                                {"id": "custom.lineWidth", "value": 2}]},
                {"matcher": {"id": "byRegexp", "options": "^loaded.*"},
                 "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": "green"}}]},
            ]),
        Panel(
            "Age of the limits in force",
            "Seconds since each engine loaded the limits it runs with (at start-up, or the "
            "last reload that changed them). Healthy: a steady climb that drops to 0 when "
            "someone changes the limits, on every engine of a model together; a change that "
            "does not bring it to 0 was not loaded (see the reloads beside).",
            "s",
            [Target(f"time() - max by ({c.by('engine')}) ({loaded})",
                    "engine {{engine}}" + c.on_group(), "positive")]),
    ]


def shared_store_panels(c: Config) -> list[Panel | Row]:
    """Shared-budget mode: what each engine leased and spent, its calls to
    the store, fallback (empty without --output-rate-shared-state)."""
    rate = "sum by ({by}) (rate({sel}[$__rate_interval]))"
    calls = c.sel("shared_store_call_seconds", "_bucket")
    by_kind = c.by("engine", "kind")
    return [
        Row("Shared budgets (--output-rate-shared-state)"),
        Panel(
            "Leased, spent, expired and unleased tokens per engine",
            "Tokens the shared store granted this engine (leased), what it spent of them, what "
            "expired unspent (the store's slots passed: given to no one), and what it spent "
            "without a lease in fallback, per kind of budget (rate: the users' output rates; "
            "ceiling: their ceilings, every output token of a user with one; prompt: their "
            "prompt budgets, prompt tokens computed). Healthy: spent close to leased, expired "
            "a small share, unleased 0.",
            "suffix: tok/s",
            [Target(rate.format(by=by_kind, sel=c.sel("shared_tokens_leased")),
                    "leased {{kind}}, engine {{engine}}" + c.on_group(), "positive"),
             Target(rate.format(by=by_kind, sel=c.sel("shared_tokens_spent")),
                    "spent {{kind}}, engine {{engine}}" + c.on_group(), "positive"),
             Target(rate.format(by=by_kind, sel=c.sel("shared_tokens_expired")),
                    "expired {{kind}}, engine {{engine}}" + c.on_group(), "data"),
             Target(rate.format(by=by_kind, sel=c.sel("shared_tokens_unleased")),
                    "unleased (fallback) {{kind}}, engine {{engine}}" + c.on_group(), "data")]),
        Panel(
            "Budget entries asked of the store per engine and kind",
            "Entries (one user's budget of one kind) this engine's lease thread asked the store "
            "for per second, per kind of budget (rate, ceiling, prompt), and those in calls that "
            "failed or timed out: the store's work comes from the entries, not the calls. "
            "Healthy: no failed entries; with long slices (slice_ms) the entries of users at "
            "their limits a fraction of those without.",
            "suffix: entries/s",
            [Target(rate.format(by=by_kind, sel=c.sel("shared_store_entries", extra=STORE_OK)),
                    "{{kind}}, engine {{engine}}" + c.on_group(), "positive"),
             Target(rate.format(by=by_kind, sel=c.sel("shared_store_entries", extra=STORE_FAILED)),
                    "failed {{kind}}, engine {{engine}}" + c.on_group(), "data")]),
        Panel(
            "Store calls: latency and failures",
            "Duration of the lease thread's calls to the store (off the scheduler's thread: "
            "a slow store delays grants, never a step) and failed calls per second. Healthy: "
            "p99 well below the lease tick (50 ms by default); no failures.",
            "s",
            [Target(quantile(0.5, calls, c.by("engine")), "p50, engine {{engine}}" + c.on_group(), "positive"),
             Target(quantile(0.99, calls, c.by("engine")), "p99, engine {{engine}}" + c.on_group(), "positive"),
             Target(rate.format(by=c.by("engine"), sel=c.sel("shared_store_calls", extra=STORE_FAILED)),
                    "failed calls/s, engine {{engine}}" + c.on_group(), "data")],
            overrides=[right_axis("failed calls.*", "suffix: calls/s")]),
        Panel(
            "Fallback and live engines",
            "1 while an engine is in fallback (the store unreachable: each user at its limit "
            "divided by the engines last seen sharing it) and the share of the time it spent "
            "there; 1 while an engine is cut off from a store it last saw up (a partition: "
            "its fallback share reserved at the store, nothing spent after partition_ms); "
            "beside the engines the store counts as live (heartbeats) and the times an "
            "engine found the store empty (restarted without its data). Healthy: fallback and "
            "cut off 0; live engines = the replicas (times data-parallel ranks) serving the "
            "model; no resets.",
            "short",
            [Target(f"max by ({c.by('engine')}) ({c.sel('shared_store_fallback')})",
                    "fallback, engine {{engine}}" + c.on_group(), "data"),
             Target(f"max by ({c.by('engine')}) ({c.sel('shared_store_partitioned')})",
                    "cut off, engine {{engine}}" + c.on_group(), "data"),
             Target(rate.format(by=c.by("engine"), sel=c.sel("shared_store_fallback_seconds")),
                    "share of time in fallback, engine {{engine}}" + c.on_group(), "data"),
             Target(f"max by ({c.by('engine')}) ({c.sel('shared_live_engines')})",
                    "live engines seen by engine {{engine}}" + c.on_group(), "positive"),
             Target(f"sum by ({c.by('engine')}) (increase({c.sel('shared_store_resets')}[$__rate_interval]))",
                    "store resets, engine {{engine}}" + c.on_group(), "data")]),
    ]
