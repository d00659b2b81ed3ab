"""The recording rules (``prometheus/recording.rules.yaml``): each user's
rate, limit and rate / limit, its spacing quantiles, its share of the
throttled KV cache and whether it is throttled, for the dashboards' "at a
glance" figures and for queries over long ranges."""

from __future__ import annotations

from vllm_output_rate.dashboards.config import Config, m
from vllm_output_rate.dashboards.expressions import over_limit_ratio_expr


def recording_rules(c: Config) -> list[dict[str, str]]:
    """Per model and user (``model_user:``) or engine and user (``engine_user:``),
    and per group: the records keep the group labels (one series per replica
    by default) and their names whatever the group labels are. Every rule
    reads the raw metrics through the fleet selector."""
    charged = m("tokens_charged").full_name
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
        {"record": f"model_user:output_rate_limit_ratio:rate{w}",
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
