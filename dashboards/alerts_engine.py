"""The engines' alerts: throttled requests holding much of the KV cache,
and an engine loop that wakes late for the budget it waits for; with their
promtool cases."""

from __future__ import annotations

from typing import Any

from vllm_output_rate.dashboards.alert import MODEL, R1, R2, Alert, fires, histogram, quiet, series
from vllm_output_rate.dashboards.config import Config, quantile
from vllm_output_rate.dashboards.expressions import throttled_kv_share_expr


def alerts(c: Config) -> list[Alert]:
    at = c.where()
    kv, late = c["throttled_kv"], c["wake_lateness"]
    engine = c.by("model_name", "engine")
    return [
        Alert(
            "OutputRateThrottledKVCacheHigh",
            f"{throttled_kv_share_expr(c)} > {kv['share']}",
            kv["for"], c.severity("throttled_kv"),
            "Throttled requests hold much of the KV cache on engine {{ $labels.engine }} of model "
            "{{ $labels.model_name }}" + at,
            "Throttled requests on engine {{ $labels.engine }} of model {{ $labels.model_name }}" + at + " "
            f"held {{{{ $value | humanizePercentage }}}} of the KV cache on average over the last "
            f"{kv['window']} (alert above {100 * kv['share']:.0f}%). New requests may wait for KV "
            "cache and throttled requests may be preempted."),
        Alert(
            "OutputRateEngineWakesLate",
            f"{quantile(late['quantile'], c.raw('wake_lateness_seconds', '_bucket'), engine, late['window'])}"
            f" > {late['seconds']} and on ({engine})"
            f" sum by ({engine}) (rate({c.raw('wake_lateness_seconds', '_count')}[{late['window']}]))"
            f" > {late['min_waits_per_second']}",
            late["for"], c.severity("wake_lateness"),
            "The engine loop of engine {{ $labels.engine }} of model {{ $labels.model_name }}" + at
            + " wakes late",
            "The engine loop of engine {{ $labels.engine }} (model {{ $labels.model_name }})" + at + " woke "
            f"{{{{ $value | humanizeDuration }}}} after the budget time it waited for, at the "
            f"{100 * late['quantile']:g}th percentile over the last {late['window']} (alert above "
            f"{1000 * late['seconds']:g}ms): throttled users get less than their limit."),
    ]


def cases(c: Config) -> list[dict[str, Any]]:
    """One engine, or two of one replica."""
    kv = "OutputRateThrottledKVCacheHigh"
    late = "OutputRateEngineWakesLate"
    return [
        {
            "name": "throttled KV: half the cache held by throttled requests",
            "interval": "1m",
            "input_series": [
                series("throttled_kv_cache_ratio", "0.5x40"),
                series("throttled_kv_blocks", "300x40", user="user-a"),
                series("throttled_kv_blocks", "100x40", user="user-b"),
                series("engine_throttled_kv_blocks", "400x40"),
            ],
            "alert_rule_test": [
                quiet(kv, "8m"),  # not yet for 10m
                fires(c, kv, "20m", {"severity": "warning", "model_name": MODEL, "engine": "0"},
                    "Throttled requests hold much of the KV cache on engine 0 of model tiny",
                    "Throttled requests on engine 0 of model tiny held 50% of the KV "
                    "cache on average over the last 5m (alert above 30%). New "
                    "requests may wait for KV cache and throttled requests may be "
                    "preempted."),
            ],
            "promql_expr_test": [{
                "expr": "engine_user:vllm_output_rate_throttled_kv_cache_ratio:ratio",
                "eval_time": "20m",
                "exp_samples": [
                    {"labels": f'engine_user:vllm_output_rate_throttled_kv_cache_ratio:ratio{{engine="0",model_name="{MODEL}",user="user-a"}}',
                     "value": 0.375},
                    {"labels": f'engine_user:vllm_output_rate_throttled_kv_cache_ratio:ratio{{engine="0",model_name="{MODEL}",user="user-b"}}',
                     "value": 0.125},
                ],
            }],
        },
        {
            "name": "throttled KV: a small share, and nothing throttled, do not fire",
            "interval": "1m",
            "input_series": [
                series("throttled_kv_cache_ratio", "0.1x40"),
                series("throttled_kv_cache_ratio", "0x40", engine="1"),
                series("throttled_kv_blocks", "0x40", user="user-a", engine="1"),
                series("engine_throttled_kv_blocks", "0x40", engine="1"),
            ],
            "alert_rule_test": [quiet(kv, "30m")],
            "promql_expr_test": [{
                # nothing throttled: the per-user share is 0, not missing
                "expr": 'engine_user:vllm_output_rate_throttled_kv_cache_ratio:ratio{engine="1"}',
                "eval_time": "30m",
                "exp_samples": [
                    {"labels": f'engine_user:vllm_output_rate_throttled_kv_cache_ratio:ratio{{engine="1",model_name="{MODEL}",user="user-a"}}',
                     "value": 0}],
            }],
        },
        {
            "name": "wakes late: every idle wait 20-50 ms late",
            "interval": "1m",
            "input_series": histogram("wake_lateness_seconds", {"0.05": 600}, 40),
            "alert_rule_test": [
                fires(c, late, "30m", {"severity": "warning", "model_name": MODEL, "engine": "0"},
                    "The engine loop of engine 0 of model tiny wakes late",
                    "The engine loop of engine 0 (model tiny) woke 49.7ms after "
                    "the budget time it waited for, at the 99th percentile over "
                    "the last 5m (alert above 10ms): throttled users get less "
                    "than their limit."),
            ],
        },
        {
            "name": "wakes late: on-time wake-ups, and rare late ones, do not fire",
            "interval": "1m",
            "input_series": [
                *histogram("wake_lateness_seconds", {"0.0005": 590, "0.002": 10}, 40),
                # late, but one wait a minute: too few to judge
                *histogram("wake_lateness_seconds", {"0.25": 1}, 40, engine="1"),
            ],
            "alert_rule_test": [quiet(late, "30m")],
        },
    ]


def fleet_cases(c: Config) -> list[dict[str, Any]]:
    """Two replicas (the alert names the one that breaks the rule)."""
    kv = "OutputRateThrottledKVCacheHigh"
    late = "OutputRateEngineWakesLate"
    share = "engine_user:vllm_output_rate_throttled_kv_cache_ratio:ratio"
    return [
        {
            "name": "fleet, throttled KV: half the cache on one replica fires for it",
            "interval": "1m",
            "input_series": [
                series("throttled_kv_cache_ratio", "0.5x40", instance=R1),
                series("throttled_kv_blocks", "300x40", user="user-a", instance=R1),
                series("throttled_kv_blocks", "100x40", user="user-b", instance=R1),
                series("engine_throttled_kv_blocks", "400x40", instance=R1),
                series("throttled_kv_cache_ratio", "0.1x40", instance=R2),
                series("throttled_kv_blocks", "20x40", user="user-a", instance=R2),
                series("engine_throttled_kv_blocks", "20x40", instance=R2),
            ],
            "alert_rule_test": [
                fires(c, kv, "20m", {"severity": "warning", "model_name": MODEL, "engine": "0",
                                   "instance": R1},
                    f"Throttled requests hold much of the KV cache on engine 0 of model tiny on instance {R1}",
                    f"Throttled requests on engine 0 of model tiny on instance {R1} held 50% of "
                    "the KV cache on average over the last 5m (alert above 30%). New requests "
                    "may wait for KV cache and throttled requests may be preempted."),
            ],
            "promql_expr_test": [{
                # each replica's engine "0" matched with its own blocks and share
                "expr": share,
                "eval_time": "20m",
                "exp_samples": [
                    {"labels": f'{share}{{engine="0",instance="{r}",model_name="{MODEL}",user="{u}"}}',
                     "value": v}
                    for r, u, v in ((R1, "user-a", 0.375), (R1, "user-b", 0.125), (R2, "user-a", 0.1))],
            }],
        },
        {
            "name": "fleet, throttled KV: a share below the threshold on each replica does not fire",
            "interval": "1m",
            "input_series": [
                series("throttled_kv_cache_ratio", "0.2x40", instance=R1),
                series("throttled_kv_cache_ratio", "0.25x40", instance=R2),
            ],
            "alert_rule_test": [quiet(kv, "30m")],
        },
        {
            "name": "fleet, wakes late: one replica late, the other on time, fires for the late one",
            "interval": "1m",
            "input_series": [
                *histogram("wake_lateness_seconds", {"0.05": 600}, 40, instance=R1),
                *histogram("wake_lateness_seconds", {"0.0005": 600}, 40, instance=R2),
            ],
            "alert_rule_test": [
                fires(c, late, "30m", {"severity": "warning", "model_name": MODEL, "engine": "0",
                                     "instance": R1},
                    f"The engine loop of engine 0 of model tiny on instance {R1} wakes late",
                    f"The engine loop of engine 0 (model tiny) on instance {R1} woke 49.7ms "
                    "after the budget time it waited for, at the 99th percentile over the "
                    "last 5m (alert above 10ms): throttled users get less than their limit."),
            ],
        },
        {
            "name": "fleet, wakes late: both replicas on time does not fire",
            "interval": "1m",
            "input_series": [
                *histogram("wake_lateness_seconds", {"0.0005": 590, "0.002": 10}, 40, instance=R1),
                *histogram("wake_lateness_seconds", {"0.0005": 600}, 40, instance=R2),
            ],
            "alert_rule_test": [quiet(late, "30m")],
        },
    ]
