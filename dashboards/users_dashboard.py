"""The users dashboard (``output-rate-users.json``): each user's rate
against its limit, what it borrowed, the replicas serving it, its
engine-side token spacing, its throttled requests and the KV cache they
hold, charges and refunds, throttle episodes, and vLLM's own latency for
context. A function of the config (selector, group labels, thresholds)."""

from __future__ import annotations

from vllm_output_rate.dashboards.config import Config, quantile
from vllm_output_rate.dashboards.expressions import (
    over_limit_factor,
    over_limit_ratio_expr,
    prompt_share_expr,
    replicas_per_user_expr,
    throttled_share_expr,
)
from vllm_output_rate.dashboards.panels import TOKS, Dashboard, Panel, Row, Target, dashed
from vllm_output_rate.telemetry.metrics import BY_NAME


def users_dashboard(c: Config) -> Dashboard:
    charged = c.sel("tokens_charged")
    limit = c.sel("user_limit_tokens_per_second")
    spacing = c.sel("inter_token_seconds", "_bucket")
    items: list[Panel | Row] = [
        Row("Output rate vs limit"),
        Panel(
            "Output tokens/s per user vs configured limit",
            "Tokens charged to each user per second (engine-side, at dispatch) with its "
            f"configured limit as a dashed line, per {c.group_noun() or 'model'} (each replica "
            "enforces the limit on its own). Healthy: every user's rate at or below its "
            "limit line; a throttled user sits on its line, others below it. Log scale: "
            "'unlimited' users have a very high limit.",
            TOKS,
            [Target(f"sum by ({c.by('user')}) (rate({charged}[$__rate_interval]))",
                    "{{user}}" + c.on_group(), "users"),
             Target(f"max by ({c.by('user')}) ({limit})", "{{user}}" + c.on_group() + " limit", "users")],
            overrides=[dashed(".* limit$")], log_scale=True, key="rate"),
        Panel(
            f"Over-limit users: measured rate / limit ({c.over['window']}, "
            f"{'per ' + c.group_noun() if c.group_noun() else 'all engines'})",
            f"Each user's output rate over the last {c.over['window']}, summed over "
            f"{c.per_group()} (what the over-limit alert sees; the engine filter does not apply), "
            "divided by its configured limit, highest first. Healthy: every row at or below "
            "100%; the limiter allows about "
            f"{100 * over_limit_factor(c):.1f}% plus one token per window at most, so a row "
            "above that is a limiter bug or a user routed to two engines.",
            "percentunit",
            [Target(f"sort_desc({over_limit_ratio_expr(c, dashboard=True)})", "", "users",
                    instant=True, format="table"),
             Target(f"sum by ({c.by('model_name', 'user')}) "
                    f"(rate({c.sel('tokens_charged', engine=False)}[{c.over['window']}]))",
                    "", "users", instant=True, format="table"),
             Target(f"max by ({c.by('model_name', 'user')}) ({c.sel('user_limit_tokens_per_second', engine=False)})",
                    "", "users", instant=True, format="table")],
            kind="table",
            overrides=[
                {"matcher": {"id": "byName", "options": "Value #A"},
                 "properties": [{"id": "displayName", "value": "rate / limit"},
                                {"id": "custom.cellOptions", "value": {"type": "color-background"}}]},
                {"matcher": {"id": "byName", "options": "Value #B"},
                 "properties": [{"id": "displayName", "value": "rate"}, {"id": "unit", "value": TOKS}]},
                {"matcher": {"id": "byName", "options": "Value #C"},
                 "properties": [{"id": "displayName", "value": "limit"}, {"id": "unit", "value": TOKS}]},
            ]),
        Panel(
            f"Share of time throttled per user (last {c.long['window']})",
            f"Share of the last {c.long['window']} in which the user had at least one throttled "
            "request (sampled once per export, every second). Healthy: near 0% for interactive "
            "users; a batch user at its limit shows high values, and above "
            f"{100 * c.long['share']:.0f}% for long the 'throttled continuously' alert fires "
            "(capacity or tier problem).",
            "percentunit",
            [Target(throttled_share_expr(c, dashboard=True), "{{user}}" + c.on_group(), "throttled")], w=24),
        *borrowing_panels(c),
        *replicas_per_user_panels(c),
        Row("Engine-side inter-token spacing (per user)"),
        Panel(
            "Inter-token spacing quantiles (engine-side): $user",
            "Time between consecutive output tokens of a request, taken in the engine-core "
            "process when the tokens became available (no HTTP buffering). The dashed line is "
            "the configured 1/limit. Healthy: a throttled user's spacing sits at or above its "
            "1/limit line (a user with n active streams: about n/limit), an unthrottled user's "
            "p99 stays low and does not rise when other users are throttled.",
            "s",
            [Target(quantile(0.5, spacing, "user"), "{{user}} p50", "users"),
             Target(quantile(0.9, spacing, "user"), "{{user}} p90", "users"),
             Target(quantile(0.99, spacing, "user"), "{{user}} p99", "users"),
             Target(f"1 / max by (user) ({limit})", "{{user}} 1/limit", "users")],
            repeat_user=True, overrides=[dashed(".*1/limit$")], log_scale=True, key="spacing", w=24),
        Panel(
            "Inter-token spacing heatmap (engine-side): $user",
            "Distribution of engine-side inter-token spacing over time (spacings per second in "
            "each bucket). The user's configured 1/limit is the dashed line on the quantile "
            "panel above. Healthy: one tight band; for a throttled user the band sits "
            "at about (active streams)/limit, never below 1/limit except zero-spacing tokens of "
            "one step.",
            "s",
            [Target(f"sum by (le) (rate({spacing}[$__rate_interval]))", "{{le}}", "data",
                    format="heatmap")],
            kind="heatmap", repeat_user=True, w=24),
        Row("Throttled requests holding KV cache"),
        Panel(
            "Throttled requests per user (resident, holding KV)",
            "Requests that were skipped in the last step because their user had no budget: "
            "they stay resident and keep their KV cache. Healthy: 0 for users below their "
            "limit; for a throttled user at most its number of open streams, and it drops to 0 "
            "when the user's load ends.",
            "short",
            [Target(f"sum by (user) ({c.sel('throttled_requests')})", "{{user}}", "throttled")],
            key="throttled"),
        Panel(
            "KV blocks held by throttled requests, per user",
            "KV cache blocks pinned by each user's throttled requests. Healthy: small next to "
            "the engine's block count (see the share panel); grows with long prompts of "
            "throttled users.",
            "short",
            [Target(f"sum by (user) ({c.sel('throttled_kv_blocks')})", "{{user}}", "throttled")],
            key="kv_blocks"),
        Panel(
            "KV cache: share held by throttled requests vs vLLM's KV usage",
            "Share (0-100%) of each engine's KV cache held by throttled requests, next to "
            "vLLM's own KV usage. Healthy: the throttled share is a small part of the usage "
            f"and below {100 * c['throttled_kv']['share']:.0f}% (alert threshold); when usage "
            "nears 100% throttled requests are preempted first.",
            "percentunit",
            [Target(f"max by ({c.by('engine')}) ({c.sel('throttled_kv_cache_ratio')})",
                    "throttled share, engine {{engine}}" + c.on_group(), "positive"),
             Target(f"max by ({c.by('engine')}) ({c.vsel('vllm:kv_cache_usage_perc')})",
                    "vLLM KV usage, engine {{engine}}" + c.on_group(), "data")],
            key="kv_share"),
        Panel(
            "Preemptions (vLLM) and tokens refunded because of preemption",
            "vLLM's preemptions per second beside the tokens the limiter gave back because the "
            "request they were charged for was preempted or not scheduled. Healthy: 0; "
            "preemptions mean the KV cache ran out (throttled requests are the preferred "
            "victims).",
            "suffix: /s",
            [Target(f"sum by ({c.by('engine')}) (rate({c.vsel('vllm:num_preemptions')}[$__rate_interval]))",
                    "preemptions/s, engine {{engine}}" + c.on_group(), "data"),
             Target(f"sum by (user, reason) (rate({c.sel('tokens_refunded')}[$__rate_interval]))",
                    "{{user}} refunded ({{reason}}) tok/s", "configured")]),
        Row("Charges, refunds, skips and throttle episodes"),
        Panel(
            "Tokens charged and refunded per user",
            "Output tokens charged per second when a sampling step is dispatched, and tokens "
            "refunded at the single refund point (charged but not dispatched). Healthy: refunds "
            "near 0 (they only happen under KV pressure); charges equal the tokens users "
            "receive.",
            TOKS,
            [Target(f"sum by (user) (rate({charged}[$__rate_interval]))", "{{user}} charged", "users"),
             Target(f"sum by (user) (rate({c.sel('tokens_refunded')}[$__rate_interval]))",
                    "{{user}} refunded", "configured")]),
        Panel(
            "Requests skipped per user (throttled request-steps per second)",
            "How many times per second a running request was skipped because its user had no "
            "budget (one per request per step). Healthy: 0 for users below their limit; for a "
            "throttled user it follows its open streams times the engine's step rate.",
            "suffix: skips/s",
            [Target(f"sum by (user) (rate({c.sel('requests_skipped')}[$__rate_interval]))",
                    "{{user}}", "throttled")]),
        *throttle_episode_panels(c),
        Row("vLLM's own latency (context: all users, measured by vLLM)"),
        Panel(
            "Time to first token (vLLM)",
            "vLLM's own time to first token, all users. Healthy: flat when some users are "
            "throttled (throttled requests give their place away); a rise while throttled "
            "requests hold much KV points at admission waiting for KV cache.",
            "s",
            [Target(quantile(0.5, c.vsel("vllm:time_to_first_token_seconds", "_bucket"), ""), "p50", "data"),
             Target(quantile(0.99, c.vsel("vllm:time_to_first_token_seconds", "_bucket"), ""), "p99", "data")]),
        Panel(
            "Inter-token latency (vLLM, all users)",
            "vLLM's own inter-token latency histogram over all users' requests, including "
            "throttled ones (their pauses show here as long latencies). Healthy: p50 near the "
            "engine step time; use the engine-side spacing per user above to judge one user.",
            "s",
            [Target(quantile(0.5, c.vsel("vllm:inter_token_latency_seconds", "_bucket"), ""), "p50", "data"),
             Target(quantile(0.99, c.vsel("vllm:inter_token_latency_seconds", "_bucket"), ""), "p99", "data")]),
        *prompt_panels(c),
    ]
    return Dashboard(
        "output-rate-users", "Output rate: users",
        "Per-user output-token rate limiting in vLLM's scheduler: rates against limits, "
        "engine-side token spacing, throttled requests holding KV cache.", items)


def borrowing_panels(c: Config) -> list[Panel]:
    """Borrowing (a limit with a ceiling): what each user got above its
    guaranteed rate, and the engines' share of borrowed tokens. The series
    exist only when some limit has a ceiling; empty otherwise."""
    borrowed = c.sel("tokens_borrowed")
    engine_borrowed = c.sel("engine_tokens_borrowed")
    engine_charged = c.sel("engine_tokens_charged")
    return [
        Panel(
            "Borrowed tokens/s per user (above its guaranteed rate)",
            "Tokens lent to each user per second: capacity nobody within its guaranteed rate "
            "used, given to users over their guaranteed rate and under their ceiling (limits "
            "written {rate: R, ceiling: C}). Not charged: the rate panel above shows what is "
            "charged against R, this one what came on top, at most C - R. Healthy: any value "
            "(it is idle capacity put to use); it drops to 0 the moment users within their "
            "guaranteed rates need the engine. Empty when no limit has a ceiling. Runbook: 'A "
            "user is above its rate'.",
            TOKS,
            [Target(f"sum by ({c.by('user')}) (rate({borrowed}[$__rate_interval]))",
                    "{{user}}" + c.on_group(), "data")], stack=True),
        Panel(
            "Share of output tokens that were borrowed",
            "Borrowed tokens over all tokens the engines dispatched (charged plus borrowed). "
            "Healthy: any value; near 0 while the engine is contended, high on an engine with "
            "idle capacity and users allowed to borrow it. Empty when no limit has a ceiling.",
            "percentunit",
            [Target(f"sum by ({c.by('model_name')}) (rate({engine_borrowed}[$__rate_interval])) / "
                    f"(sum by ({c.by('model_name')}) (rate({engine_charged}[$__rate_interval])) + "
                    f"sum by ({c.by('model_name')}) (rate({engine_borrowed}[$__rate_interval])))",
                    "{{model_name}}" + c.on_group(), "data")]),
    ]


def replicas_per_user_panels(c: Config) -> list[Panel]:
    """How many replicas charged each user (what the affinity alert counts);
    none when replicas are not told apart (no group labels)."""
    if not c.group_labels():
        return []
    a = c["affinity"]
    if a["enabled"]:
        healthy = ("Healthy: 1 on every row (this fleet routes each user to one replica); 2 or "
                   f"more (red) for longer than {a['for']} fires the affinity alert: the user gets "
                   "up to that many times its limit.")
    else:
        healthy = ("Healthy: with affinity routing (each user hashed to one replica), 1 on every "
                   "row; without it, users spread over several replicas and each gets up to that "
                   "many times its limit (the affinity alert is off: thresholds.yaml affinity).")
    return [Panel(
        f"Replicas serving each user (last {a['window']})",
        f"How many replicas (distinct {c.group_noun()}) charged each user output tokens in the last "
        f"{a['window']}, highest first; each replica has its own budget. The shared users "
        "(label-cap overflow, anonymous, unlisted: affinity.exclude_users) are left out: every "
        f"replica charges them. {healthy}",
        "short",
        [Target(f"sort_desc({replicas_per_user_expr(c, dashboard=True)})", "", "users",
                instant=True, format="table")],
        kind="table", w=24, sort_by="replicas",
        thresholds=[("green", None), ("red", 2)] if a["enabled"] else [],
        overrides=[{"matcher": {"id": "byName", "options": "Value"},
                    "properties": [{"id": "displayName", "value": "replicas"},
                                   *([{"id": "custom.cellOptions", "value": {"type": "color-background"}}]
                                     if a["enabled"] else [])]}])]


def throttle_episode_panels(c: Config) -> list[Panel]:
    """The throttle-episode histogram, when the metric table has it."""
    if "throttle_episode_seconds" not in BY_NAME:
        return []
    episodes = c.sel("throttle_episode_seconds", "_bucket")
    return [Panel(
        "Throttle episode duration per user",
        "How long a request was held to its user's limit in one go: from the first step it "
        "was skipped to its last dispatch before a step that did not skip it (or its end). A "
        "request pacing at its limit (a token, then skipped again) is one episode over all "
        "its pacing. Healthy: short episodes (a burst over the limit) or about a request's "
        "life for a user that keeps more streams open than its limit serves; episodes that "
        "grow mean a user's demand staying above its limit. The wait per token of a pacing "
        "request is in the spacing panels.",
        "s",
        [Target(quantile(0.5, episodes, "user"), "{{user}} p50", "throttled"),
         Target(quantile(0.99, episodes, "user"), "{{user}} p99", "throttled")])]


def prompt_panels(c: Config) -> list[Panel | Row]:
    """Each user's prompt work (docs/prompts.md): its share of the step
    time ("who makes the steps long", what the prompts alert judges), and
    its prompt tokens computed and put off."""
    p = c["prompt_share"]
    return [
        Row("Prompt work (who makes the steps long)"),
        Panel(
            "Who makes the steps long: share of step time per user's prompts",
            "Each user's part of its engine's step time taken by its prompt work (prefill "
            "chunks), per engine: each step's measured time split by the step-time model "
            "between the step's fixed cost, its decodes and each user's prompt tokens "
            "(OUTPUT_RATE_STEP_TIME, the JSON of `vllm-output-rate twin calibrate`; without it "
            "a built-in estimate). Every request in a step waits for the prompts in it. "
            f"Healthy: no user near {100 * p['share']:.0f}% while others are served; above it "
            f"for {p['for']} the prompts alert fires: give that user a prompt budget "
            "(prompt_rate). The label-cap overflow (__other__) is left out.",
            "percentunit",
            [Target(prompt_share_expr(c, dashboard=True),
                    "{{user}} engine {{engine}}" + c.on_group(), "data")]),
        Panel(
            "Prompt tokens/s per user: computed, and put off",
            "Prompt tokens each user's prefill chunks computed per second (prefix-cache hits "
            "are free), and the prompt tokens put off (dashed): a request's prompt counted once "
            "per reason when first put off, by its user's prompt budget (prompt_budget) or just "
            "in time (just_in_time: its user out of output budget, its prompt not computed "
            "before its first token may be sampled); the all-user totals are exact (no label "
            "cap). Healthy: put-off tokens only for users over a budget; a user's computed "
            "rate at most its prompt_rate.",
            TOKS,
            [Target(f"sum by ({c.by('user')}) "
                    f"(rate({c.sel('prompt_tokens_computed')}[$__rate_interval]))",
                    "{{user}}" + c.on_group() + " computed", "users"),
             Target(f"sum by ({c.by('user', 'reason')}) "
                    f"(rate({c.sel('prompt_tokens_deferred')}[$__rate_interval]))",
                    "{{user}}" + c.on_group() + " put off ({{reason}})", "configured"),
             Target(f"sum by ({c.by('model_name')}) "
                    f"(rate({c.sel('engine_prompt_tokens_computed')}[$__rate_interval]))",
                    "all users" + c.on_group() + " computed (exact)", "positive"),
             Target(f"sum by ({c.by('model_name', 'reason')}) "
                    f"(rate({c.sel('engine_prompt_tokens_deferred')}[$__rate_interval]))",
                    "all users" + c.on_group() + " put off ({{reason}}, exact)", "data")],
            overrides=[dashed(".*put off.*$", "orange")]),
    ]
