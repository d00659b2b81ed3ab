"""The PromQL the dashboards and the rules share (a panel shows what an
alert judges): each a function of the config, with ``dashboard=True`` the
panel's form (the dashboard's variables) and otherwise the rule's (the
fleet selector only)."""

from __future__ import annotations

from vllm_output_rate.dashboards.config import Config
from vllm_output_rate.dashboards.thresholds import seconds
from vllm_output_rate.limits_watch import RESULTS as LIMITS_RESULTS

#: results of a look at the limits file that left older limits in force
LIMITS_FAILED = ("invalid", "unreadable")
assert set(LIMITS_FAILED) < set(LIMITS_RESULTS), LIMITS_RESULTS
LIMITS_FAILED_MATCHER = f'result=~"{"|".join(LIMITS_FAILED)}"'
#: failed calls of the lease thread to the shared budget store
STORE_FAILED = 'result="failed"'
#: (and the calls, or budget entries, in calls answered)
STORE_OK = 'result="ok"'


def limit_sets_expr(c: Config, dashboard: bool = False) -> str:
    """How many distinct SHA-256 of the limits in force each fleet (a model,
    split by ``limits_differ.same_by``) runs: over its replicas, not per
    group (replicas are what is compared)."""
    info = c.sel("limits_info", engine=False) if dashboard else c.raw("limits_info")
    return f"count by ({c.fleet_by()}) (count by ({c.fleet_by()}, sha256) ({info}))"


def replicas_per_user_expr(c: Config, dashboard: bool = False) -> str:
    """How many replicas (distinct values of the group labels) charged each
    user of a model within ``affinity.window``, but the shared users: the
    affinity alert's count (replicas are what is counted, not a grouping)."""
    a = c["affinity"]
    regex = a["exclude_users"].replace("\\", "\\\\").replace('"', '\\"')
    exclude = f'user!~"{regex}"'
    charged = (c.sel("tokens_charged", extra=exclude, engine=False) if dashboard
               else c.raw("tokens_charged", extra=exclude))
    return (f"count by (model_name, user) (count by ({c.by('model_name', 'user')})"
            f" (increase({charged}[{a['window']}]) > 0))")


def over_limit_factor(c: Config, window: str | None = None) -> float:
    """The rate / limit the limiter can reach over ``window``, without the +1 token."""
    over = c.over
    window_s = seconds(window or over["window"])
    return 1 + over["slack"] + (over["burst_seconds"] + over["jitter_seconds"]) / window_s


def over_limit_ratio_expr(c: Config, dashboard: bool = False, window: str | None = None,
                          limit_scale: float = 1.0) -> str:
    """Each user's rate summed over the engines of one group (one replica by
    default, never over replicas: each has its own budget), over its limit."""
    window = window or c.over["window"]
    charged = c.sel("tokens_charged", engine=False) if dashboard else c.raw("tokens_charged")
    return (f"sum by ({c.by('model_name', 'user')}) (rate({charged}[{window}]))"
            f" / on ({c.by('model_name', 'user')}) {_limit_expr(c, dashboard, limit_scale)}")


def _limit_expr(c: Config, dashboard: bool = False, limit_scale: float = 1.0) -> str:
    limit = (c.sel("user_limit_tokens_per_second", engine=False) if dashboard
             else c.raw("user_limit_tokens_per_second"))
    out = f"max by ({c.by('model_name', 'user')}) ({limit})"
    return out if limit_scale == 1.0 else f"({out} * {limit_scale:g})"


def over_limit_expr(c: Config, window: str | None = None, limit_scale: float = 1.0) -> str:
    """The over-limit alert's expression: rate / limit above the GCRA bound
    ``(W + burst + jitter) * limit + 1`` tokens in W, with relative slack.

    ``limit_scale`` < 1 pretends the limits were lower (the integration test's
    positive control: a working limiter then looks over its limit)."""
    over = c.over
    window = window or over["window"]
    window_s = seconds(window)
    bound = (f"(1 + {over['slack']} + ({over['burst_seconds']} + {over['jitter_seconds']})"
             f" / {window_s:g})")
    return (f"{over_limit_ratio_expr(c, window=window, limit_scale=limit_scale)}"
            f" > on ({c.by('model_name', 'user')})"
            f" ({bound} + 1 / ({window_s:g} * {_limit_expr(c, limit_scale=limit_scale)}))")


def throttled_kv_share_expr(c: Config) -> str:
    """The throttled-KV alert's expression without its threshold (one series
    per engine of each group)."""
    kv = c["throttled_kv"]
    return (f"max by ({c.by('model_name', 'engine')})"
            f" (avg_over_time({c.raw('throttled_kv_cache_ratio')}[{kv['window']}]))")


def throttled_share_expr(c: Config, dashboard: bool = False) -> str:
    """Share of the whole window (not of the samples present: a user seen for
    a minute is not 'throttled for 30 minutes') with a throttled request, per
    group (a user throttled on one replica, then on another, is not throttled
    continuously on either)."""
    throttled = c.sel("throttled_requests") if dashboard else c.raw("throttled_requests")
    grouping = c.by("user") if dashboard else c.by("model_name", "user")
    step = 15
    window = c.long["window"]
    points = seconds(window) / step
    # clamp: the subquery holds points + 1 samples when both ends are aligned
    return (f"clamp_max(sum_over_time((max by ({grouping}) ({throttled}) > bool 0)"
            f"[{window}:{step}s]) / {points:g}, 1)")


def prompt_share_expr(c: Config, dashboard: bool = False) -> str:
    """Each user's share of an engine's step time taken by its prompt work
    (``prompt_step_seconds`` over ``engine_step_seconds``), per engine of
    each group; the label-cap overflow is many users, not one: left out."""
    window = "$__rate_interval" if dashboard else c["prompt_share"]["window"]
    one = 'user!="__other__"'
    prompt = (c.sel("prompt_step_seconds", extra=one) if dashboard
              else c.raw("prompt_step_seconds", extra=one))
    steps = c.sel("engine_step_seconds") if dashboard else c.raw("engine_step_seconds")
    engine = c.by("model_name", "engine")
    return (f"sum by ({c.by('model_name', 'engine', 'user')}) (rate({prompt}[{window}]))"
            f" / on ({engine}) group_left sum by ({engine}) (rate({steps}[{window}]))")


def others_tokens_expr(c: Config) -> str:
    """Per engine of each group and user: the output tokens per second the
    engine charged the other users (what a user's long steps slow down)."""
    window = c["prompt_share"]["window"]
    engine = c.by("model_name", "engine")
    return (f"sum by ({engine}) (rate({c.raw('engine_tokens_charged')}[{window}]))"
            f" - on ({engine}) group_right"
            f" sum by ({c.by('model_name', 'engine', 'user')}) (rate({c.raw('tokens_charged')}[{window}]))")
