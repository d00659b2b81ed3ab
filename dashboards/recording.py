"""The recording rules (``prometheus/recording.rules.yaml``): each user's
rate, limit and rate / limit, its spacing quantiles, its share of the
throttled KV cache and whether it is throttled, for the dashboards' "at a
glance" figures and for queries over long ranges.

Named ``level:metric:operations`` as Prometheus' naming practice and the
monitoring mixins have it: the level the rule aggregates to (``model_user``,
``engine_user``), the metric with its ``vllm_output_rate_`` prefix and
without ``_total`` after ``rate()``, the operations (``rate5m``,
``ratio_rate5m``). The names of the release before are recorded too, from
the new ones, in a group of their own (``renamed_rules``): for one release,
removed in the next."""

from __future__ import annotations

from typing import Any

from vllm_output_rate.dashboards.alert import MODEL, series
from vllm_output_rate.dashboards.config import Config, m
from vllm_output_rate.dashboards.expressions import over_limit_ratio_expr
from vllm_output_rate.telemetry.metrics import PREFIX


def base_name(name: str) -> str:
    """A metric of the table as a recorded name holds it: with the prefix,
    without the ``_total`` of a counter (``rate()`` made it a rate)."""
    return PREFIX + m(name).name


def recording_rules(c: Config) -> list[dict[str, str]]:
    """Per model and user (``model_user:``) or engine and user (``engine_user:``),
    and per group: the records keep the group labels (one series per replica
    by default) and their names whatever the group labels are. Every rule
    reads the raw metrics through the fleet selector."""
    charged = base_name("tokens_charged")
    limit = m("user_limit_tokens_per_second").full_name
    share = m("throttled_kv_cache_ratio").full_name
    blocks = c.raw("throttled_kv_blocks")
    w = c.over["window"]
    user, engine = c.by("model_name", "user"), c.by("model_name", "engine")
    rules = [
        {"record": f"model_user:{charged}:rate{c.short}",
         "expr": f"sum by ({user}) (rate({c.raw('tokens_charged')}[{c.short}]))"},
        {"record": f"model_user:{charged}:rate{w}",
         "expr": f"sum by ({user}) (rate({c.raw('tokens_charged')}[{w}]))"},
        {"record": f"model_user:{limit}:max",
         "expr": f"max by ({user}) ({c.raw('user_limit_tokens_per_second')})"},
        # what the over-limit alert compares, read from the raw metrics through
        # the selector like every rule (not from the two records above)
        {"record": f"model_user:{charged}_per_limit:ratio_rate{w}",
         "expr": over_limit_ratio_expr(c, window=w)},
    ]
    for q in (0.5, 0.9, 0.99):
        rules.append({
            "record": f"model_user:{m('inter_token_seconds').full_name}:p{round(q * 100)}_{c.short}",
            "expr": f"histogram_quantile({q}, sum by ({c.by('model_name', 'user', 'le')})"
                    f" (rate({c.raw('inter_token_seconds', '_bucket')}[{c.short}])))"})
    rules += [
        # the user's blocks over all throttled blocks, times the engine's throttled share;
        # 0 when nothing is throttled on the engine. Matched on the group labels too:
        # every replica's engine is engine="0"
        {"record": f"engine_user:{share}:ratio",
         "expr": f"{blocks} / on ({engine}) group_left () ({c.raw('engine_throttled_kv_blocks')} > 0)"
                 f" * on ({engine}) group_left () {c.raw('throttled_kv_cache_ratio')}"
                 f" or {blocks} * 0"},
        {"record": f"model_user:{m('throttled_requests').full_name}:bool",
         "expr": f"max by ({user}) ({c.raw('throttled_requests')}) > bool 0"},
    ]
    return rules


def renamed_rules(c: Config) -> list[dict[str, str]]:
    """The recorded names of the release before (``_total`` after ``rate()``,
    a ratio without the metric prefix), each recorded from its new name:
    dashboards and queries of that release keep working for one release;
    removed in the next."""
    old, new = m("tokens_charged").full_name, base_name("tokens_charged")
    w = c.over["window"]
    renamed = {
        f"model_user:{old}:rate{c.short}": f"model_user:{new}:rate{c.short}",
        f"model_user:{old}:rate{w}": f"model_user:{new}:rate{w}",
        f"model_user:output_rate_limit_ratio:rate{w}": f"model_user:{new}_per_limit:ratio_rate{w}",
    }
    return [{"record": old, "expr": new} for old, new in renamed.items()]


def cases(c: Config) -> list[dict[str, Any]]:
    """``promtool test rules`` cases of the names (for the shipped windows,
    1m and 5m, typed out): each renamed record equals its new name, and has
    no series where the new name has none."""
    ratio, old_ratio = ("model_user:vllm_output_rate_tokens_charged_per_limit:ratio_rate5m",
                        "model_user:output_rate_limit_ratio:rate5m")
    rates = [(f"model_user:vllm_output_rate_tokens_charged:rate{w}",
              f"model_user:vllm_output_rate_tokens_charged_total:rate{w}") for w in ("1m", "5m")]
    labels = f'{{model_name="{MODEL}",user="user-a"}}'

    def samples(name: str, value: float, at: str = "20m", user: str = "user-a") -> dict[str, Any]:
        return {"expr": f'{name}{{user="{user}"}}', "eval_time": at,
                "exp_samples": [{"labels": name + labels, "value": value}] if value is not None else []}

    return [{
        "name": "recorded names: the new names, and for one release the old ones, of a user at 20 tok/s "
                "and its limit of 20; no ratio for a user without a limit under either name",
        "interval": "1m",
        "input_series": [
            series("tokens_charged", "0+1200x30", user="user-a"),
            series("user_limit_tokens_per_second", "20x30", user="user-a"),
            # the label-cap overflow: a rate, no limit of its own
            series("tokens_charged", "0+600x30", user="__other__"),
        ],
        "promql_expr_test": [
            *(samples(name, 20) for pair in rates for name in pair),
            samples(ratio, 1), samples(old_ratio, 1),
            samples(ratio, None, user="__other__"), samples(old_ratio, None, user="__other__"),
        ],
    }]
