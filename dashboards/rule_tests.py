"""``promtool test rules`` cases for every alert: one where it fires (with the
expected labels and annotations) and at least one where it must not.

Series names come from the metric table; the expected annotations are typed
out here on purpose (they are what an SRE reads when paged). The generator
writes these cases to ``prometheus/alerts.test.yaml``.
"""

from __future__ import annotations

from typing import Any

from telemetry.metrics import BY_NAME

MODEL = "tiny"


def _name(short: str, suffix: str = "") -> str:
    return BY_NAME[short].full_name + suffix


def series(short: str, values: str, suffix: str = "", **labels: str) -> dict[str, str]:
    labels = {"model_name": MODEL, "engine": "0", **labels}
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{_name(short, suffix)}{{{body}}}", "values": values}


def histogram(short: str, bucket_increments: dict[str, int], minutes: int, **labels: str) -> list[dict[str, str]]:
    """A histogram whose buckets grow by the given counts per minute
    (``bucket_increments``: bound -> observations per minute in that bucket)."""
    from telemetry.metrics import BY_NAME

    bounds = [*map(repr, map(float, BY_NAME[short].buckets)), "+Inf"]
    out, running = [], 0
    for bound in bounds:
        running += bucket_increments.get(bound, 0)
        out.append(series(short, f"0+{running}x{minutes}", "_bucket", le=bound, **labels))
    out.append(series(short, f"0+{running}x{minutes}", "_count", **labels))
    out.append(series(short, f"0+{running * 0.001:g}x{minutes}", "_sum", **labels))
    return out


def _runbook(alert: str) -> str:
    from dashboards.generate import T

    return f"{T['runbook_base_url']}#{alert.lower()}"


def _alert(name: str, eval_time: str, firing: list[dict[str, Any]]) -> dict[str, Any]:
    return {"eval_time": eval_time, "alertname": name, "exp_alerts": firing}


def _fires(name: str, eval_time: str, labels: dict[str, str], summary: str,
           description: str) -> dict[str, Any]:
    """``name`` fires once at ``eval_time`` with these labels and texts
    (and its runbook link)."""
    return _alert(name, eval_time, [{
        "exp_labels": labels,
        "exp_annotations": {"summary": summary, "description": description,
                            "runbook_url": _runbook(name)}}])


def cases() -> list[dict[str, Any]]:
    user_limit = "user_limit_tokens_per_second"
    over = "OutputRateUserOverLimit"
    cont = "OutputRateUserThrottledContinuously"
    kv = "OutputRateThrottledKVCacheHigh"
    late = "OutputRateEngineWakesLate"
    drop = "OutputRateTelemetryDropping"
    stale = "OutputRateTelemetryStale"
    return [
        {
            "name": "over limit: one user served by two engines gets twice its limit",
            "interval": "1m",
            "input_series": [
                # 20 tok/s = 1200 tokens a minute on each engine
                series("tokens_charged", "0+1200x30", user="user-a", engine="0"),
                series("tokens_charged", "0+1200x30", user="user-a", engine="1"),
                series(user_limit, "20x30", user="user-a", engine="0"),
                series(user_limit, "20x30", user="user-a", engine="1"),
            ],
            "alert_rule_test": [
                _alert(over, "4m", []),  # not yet for 5m
                _fires(over, "15m", {"severity": "page", "model_name": MODEL, "user": "user-a"},
                    "User user-a gets more output tokens than its limit on model tiny",
                    "User user-a on model tiny was charged 200% of its configured "
                    "output-token limit over the last 5m, summed over all engines; "
                    "the limiter allows at most about 105.7% plus one token. Either "
                    "the limiter is broken or the user is served by more than one "
                    "engine (each engine has its own budget)."),
            ],
        },
        {
            "name": "over limit: users at, or just under the bound above, their limit do not fire",
            "interval": "1m",
            "input_series": [
                # exactly at the limit (a throttled user): 20 tok/s
                series("tokens_charged", "0+1200x30", user="user-a"),
                series(user_limit, "20x30", user="user-a"),
                # 5% above (rate() extrapolation, snapshot timing): inside the slack
                series("tokens_charged", "0+63x30", user="user-slow"),
                series(user_limit, "1x30", user="user-slow"),
                # the overflow label has no limit of its own: never compared
                series("tokens_charged", "0+60000x30", user="__other__"),
            ],
            "alert_rule_test": [_alert(over, "20m", [])],
            "promql_expr_test": [{
                "expr": 'model_user:output_rate_limit_ratio:rate5m{user="user-a"}',
                "eval_time": "20m",
                "exp_samples": [{"labels": f'model_user:output_rate_limit_ratio:rate5m{{model_name="{MODEL}",user="user-a"}}',
                                 "value": 1}],
            }],
        },
        {
            "name": "throttled continuously: a user throttled the whole time",
            "interval": "1m",
            "input_series": [
                series("throttled_requests", "3x60", user="user-a"),
                series("throttled_requests", "0x60", user="user-b"),
            ],
            "alert_rule_test": [
                _fires(cont, "50m", {"severity": "ticket", "model_name": MODEL, "user": "user-a"},
                    "User user-a is throttled almost all the time on model tiny",
                    "User user-a on model tiny had throttled requests 100% of the "
                    "last 30m (alert above 90%): its demand stays above its limit. "
                    "Its requests wait holding KV cache; raise its limit (tier) or "
                    "ask it to send less."),
            ],
        },
        {
            "name": "throttled continuously: half the time, or only since a few minutes, does not fire",
            "interval": "1m",
            "input_series": [
                series("throttled_requests", " ".join(["2 0"] * 30), user="user-a"),
                # a new user throttled from its first minute: 15 of the last 30 minutes
                series("throttled_requests", "_x40 4x15", user="user-new"),
            ],
            "alert_rule_test": [_alert(cont, "55m", [])],
        },
        {
            "name": "throttled KV: half the cache held by throttled requests",
            "interval": "1m",
            "input_series": [
                series("throttled_kv_cache_share", "0.5x40"),
                series("throttled_kv_blocks", "300x40", user="user-a"),
                series("throttled_kv_blocks", "100x40", user="user-b"),
                series("engine_throttled_kv_blocks", "400x40"),
            ],
            "alert_rule_test": [
                _alert(kv, "8m", []),  # not yet for 10m
                _fires(kv, "20m", {"severity": "ticket", "model_name": MODEL, "engine": "0"},
                    "Throttled requests hold much of the KV cache on engine 0 of model tiny",
                    "Throttled requests on engine 0 of model tiny held 50% of the KV "
                    "cache on average over the last 5m (alert above 30%). New "
                    "requests may wait for KV cache and throttled requests may be "
                    "preempted."),
            ],
            "promql_expr_test": [{
                "expr": "engine_user:output_rate_throttled_kv_cache_share:ratio",
                "eval_time": "20m",
                "exp_samples": [
                    {"labels": f'engine_user:output_rate_throttled_kv_cache_share:ratio{{engine="0",model_name="{MODEL}",user="user-a"}}',
                     "value": 0.375},
                    {"labels": f'engine_user:output_rate_throttled_kv_cache_share:ratio{{engine="0",model_name="{MODEL}",user="user-b"}}',
                     "value": 0.125},
                ],
            }],
        },
        {
            "name": "throttled KV: a small share, and nothing throttled, do not fire",
            "interval": "1m",
            "input_series": [
                series("throttled_kv_cache_share", "0.1x40"),
                series("throttled_kv_cache_share", "0x40", engine="1"),
                series("throttled_kv_blocks", "0x40", user="user-a", engine="1"),
                series("engine_throttled_kv_blocks", "0x40", engine="1"),
            ],
            "alert_rule_test": [_alert(kv, "30m", [])],
            "promql_expr_test": [{
                # nothing throttled: the per-user share is 0, not missing
                "expr": 'engine_user:output_rate_throttled_kv_cache_share:ratio{engine="1"}',
                "eval_time": "30m",
                "exp_samples": [
                    {"labels": f'engine_user:output_rate_throttled_kv_cache_share:ratio{{engine="1",model_name="{MODEL}",user="user-a"}}',
                     "value": 0}],
            }],
        },
        {
            "name": "wakes late: every idle wait 20-50 ms late",
            "interval": "1m",
            "input_series": histogram("wake_lateness_seconds", {"0.05": 600}, 40),
            "alert_rule_test": [
                _fires(late, "30m", {"severity": "ticket", "model_name": MODEL, "engine": "0"},
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
            "alert_rule_test": [_alert(late, "30m", [])],
        },
        {
            "name": "telemetry dropping: an export failure every minute",
            "interval": "1m",
            "input_series": [series("telemetry_dropped", "0+1x30", reason="export_failed")],
            "alert_rule_test": [
                _fires(drop, "20m", {"severity": "ticket", "model_name": MODEL, "engine": "0",
                                     "reason": "export_failed"},
                    "Output-rate telemetry of engine 0 of model tiny is dropping data",
                    "Engine 0 of model tiny dropped 10 telemetry snapshot(s) "
                    "(reason export_failed) in the last 10m: the output_rate_ "
                    "metrics on /metrics are stale and the dashboards miss data."),
            ],
        },
        {
            "name": "telemetry dropping: no drops, and an old drop, do not fire",
            "interval": "1m",
            "input_series": [
                series("telemetry_dropped", "0x40", reason="export_failed"),
                series("telemetry_dropped", "0 1 1x40", reason="export_failed", engine="1"),
            ],
            "alert_rule_test": [_alert(drop, "30m", [])],
        },
        {
            "name": "telemetry stale: snapshots stop moving at minute 5",
            "interval": "1m",
            # the snapshot time follows time() (value = seconds since 0) until
            # minute 5, then stays there
            "input_series": [series("telemetry_snapshot_timestamp_seconds", "0+60x5 300x30")],
            "alert_rule_test": [
                _alert(stale, "8m", []),  # stale, but not yet for 5m
                _fires(stale, "20m", {"severity": "ticket", "model_name": MODEL, "engine": "0"},
                    "Output-rate telemetry of engine 0 of model tiny is stale",
                    "The newest output-rate snapshot of engine 0 (model tiny) "
                    "is 15m 0s old (alert above 60s; it is written every "
                    "second): the engine core's exporter or the engine core "
                    "itself is stuck, and the output_rate_ metrics show old "
                    "values."),
            ],
        },
        {
            "name": "telemetry stale: snapshots that keep up do not fire",
            "interval": "1m",
            "input_series": [series("telemetry_snapshot_timestamp_seconds", "0+60x40")],
            "alert_rule_test": [_alert(stale, "30m", [])],
        },
    ]


def test_file() -> dict[str, Any]:
    from dashboards.generate import T

    return {
        "rule_files": ["recording.rules.yaml", "alerts.rules.yaml"],
        "evaluation_interval": T["evaluation_interval"],
        "tests": cases(),
    }
