"""``promtool test rules`` cases for every alert: one where it fires (with the
expected labels and annotations) and at least one where it must not; and
for every alert the same with two replicas (two scrape targets, both
reporting ``engine="0"``): it fires for the replica that breaks the rule,
with its ``instance``, and stays quiet while each replica keeps it. The
affinity alert's cases (a user on several replicas) are written only when
``thresholds.yaml`` enables it, as its rule is.

Series names come from the metric table; the expected annotations are typed
out here on purpose (they are what an SRE reads when paged). The generator
writes these cases to ``prometheus/alerts.test.yaml``.
"""

from __future__ import annotations

import hashlib
from typing import Any

from vllm_output_rate.dashboards.thresholds import T
from vllm_output_rate.telemetry.metrics import BY_NAME

MODEL = "tiny"
#: two replicas of the model (the cases are for the default group labels, [instance])
R1, R2 = "10.0.0.1:8000", "10.0.0.2:8000"
#: SHA-256 of two limits files (what vllm_output_rate_limits_info carries)
OLD_LIMITS = hashlib.sha256(b"default: 50\nusers: {alice: 200}\n").hexdigest()
NEW_LIMITS = hashlib.sha256(b"default: 50\nusers: {alice: 100}\n").hexdigest()
LIMITS_FILE = "/etc/vllm-output-rate/limits.yaml"


def reloads(values: dict[str, str], **labels: str) -> list[dict[str, str]]:
    """The reload counter, one series per result (the engine exports all
    four from its start); ``values``: result -> series values, 0 if absent."""
    return [series("limits_reloads", values.get(result, "0x40"), result=result, **labels)
            for result in ("loaded", "unchanged", "invalid", "unreadable")]


def limits_info(digest: str, values: str, **labels: str) -> dict[str, str]:
    return series("limits_info", values, sha256=digest, source=LIMITS_FILE, **labels)


def _name(short: str, suffix: str = "") -> str:
    return BY_NAME[short].full_name + suffix


def series(short: str, values: str, suffix: str = "", **labels: str) -> dict[str, str]:
    labels = {"model_name": MODEL, "engine": "0", **labels}
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{_name(short, suffix)}{{{body}}}", "values": values}


def histogram(short: str, bucket_increments: dict[str, int], minutes: int, **labels: str) -> list[dict[str, str]]:
    """A histogram whose buckets grow by the given counts per minute
    (``bucket_increments``: bound -> observations per minute in that bucket)."""
    bounds = [*map(repr, map(float, BY_NAME[short].buckets)), "+Inf"]
    out, running = [], 0
    for bound in bounds:
        running += bucket_increments.get(bound, 0)
        out.append(series(short, f"0+{running}x{minutes}", "_bucket", le=bound, **labels))
    out.append(series(short, f"0+{running}x{minutes}", "_count", **labels))
    out.append(series(short, f"0+{running * 0.001:g}x{minutes}", "_sum", **labels))
    return out


def _runbook(alert: str) -> str:
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
    failed = "OutputRateLimitsReloadFailed"
    differ = "OutputRateLimitsDiffer"
    store = "OutputRateSharedStoreUnreachable"
    return [
        {
            "name": "shared store: an engine in fallback for more than 2m fires; a 1m blip does not",
            "interval": "1m",
            "input_series": [
                # engine 0: fallback from minute 6 to 15, 600 failed calls a minute (one a tick)
                series("shared_store_fallback", "0x5 1x10 0x10", engine="0"),
                series("shared_store_calls", "0x5 0+600x10 6000x10", result="failed", engine="0"),
                # engine 1: one minute of it
                series("shared_store_fallback", "0x5 1 0x20", engine="1"),
                series("shared_store_calls", "0x5 0+600x1 600x20", result="failed", engine="1"),
            ],
            "alert_rule_test": [
                _alert(store, "5m", []),
                _alert(store, "7m", []),  # in fallback, not yet for 2m
                _fires(store, "9m", {"severity": "ticket", "model_name": MODEL, "engine": "0"},
                    "Engine 0 of model tiny cannot reach its shared budget store",
                    "Engine 0 of model tiny has been in fallback for at least 2m (1.2k failed "
                    "calls to the store in the last 2m): its calls to the shared budget store "
                    "(--output-rate-shared-state) fail or time out, so it serves each user at its "
                    "limit divided by the engines last seen sharing that user. Limits still hold; "
                    "users get less than their limit until the store answers again (shared "
                    "budgets then resume by themselves)."),
                _alert(store, "20m", []),  # back
            ],
        },
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
                    "output-token limit over the last 5m, summed over the engines of one instance; "
                    "the limiter allows at most about 105.7% plus one token. Either "
                    "the limiter is broken or the user is served by more than one "
                    "engine (each engine has its own budget). Tokens borrowed above a "
                    "guaranteed rate (a limit with a ceiling) are not charged and never "
                    "count here: see the runbook's 'A user is above its rate'."),
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
                series("throttled_kv_cache_ratio", "0.5x40"),
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
            "alert_rule_test": [_alert(kv, "30m", [])],
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
        {
            "name": "limits reload failed: a changed limits file refused at minute 10",
            "interval": "1m",
            "input_series": reloads({"loaded": "0 0 1x40", "invalid": "0x9 1x30"}),
            "alert_rule_test": [
                _alert(failed, "9m", []),  # before the bad file
                _fires(failed, "12m", {"severity": "ticket", "model_name": MODEL, "engine": "0",
                                       "result": "invalid"},
                    "Engine 0 of model tiny could not load its changed limits file",
                    "Engine 0 of model tiny found its limits file changed but could not "
                    "put it in force 1 time(s) in the last 15m (result invalid: invalid = "
                    "refused by the checks, unreadable = could not be read). The limits in "
                    "force stay the ones loaded before, older than the file; the engine log "
                    "names the file, the key and the value."),
                _alert(failed, "30m", []),  # counted once: gone a window later
            ],
        },
        {
            "name": "limits reload failed: loaded and unchanged reloads, and an old failure, do not fire",
            "interval": "1m",
            "input_series": [
                *reloads({"loaded": "0+1x40", "unchanged": "0 0 1 1 2 2 3x40"}),
                # an unreadable file at minute 2 (fixed since: loaded)
                *reloads({"loaded": "0 0 0 1x40", "unreadable": "0 0 1x40"}, engine="1"),
            ],
            "alert_rule_test": [_alert(failed, "30m", [])],
        },
        {
            "name": "limits differ: two engines of a model with different limits files",
            "interval": "1m",
            "input_series": [
                limits_info(OLD_LIMITS, "1x40", engine="0"),
                limits_info(NEW_LIMITS, "1x40", engine="1"),
            ],
            "alert_rule_test": [
                _alert(differ, "8m", []),  # not yet for 10m
                _fires(differ, "20m", {"severity": "ticket", "model_name": MODEL},
                    "Engines of model tiny run different limits",
                    "2 different sets of limits (SHA-256 of the limits in force) are in "
                    "force on the engines of model tiny for at least 10m: a user gets "
                    "another limit depending on the replica that serves it. Every replica "
                    "of a model should run the same limits file."),
            ],
        },
        {
            "name": "limits differ: one engine changing its limits, and two engines with the same, do not fire",
            "interval": "1m",
            "input_series": [
                # engine 0 reloads at minute 10: the old digest's series ends there
                limits_info(OLD_LIMITS, "1x9 stale", engine="0"),
                limits_info(NEW_LIMITS, "_x10 1x30", engine="0"),
                # another model, two engines, the same file
                limits_info(OLD_LIMITS, "1x40", model_name="other", engine="0"),
                limits_info(OLD_LIMITS, "1x40", model_name="other", engine="1"),
            ],
            "alert_rule_test": [_alert(differ, "30m", [])],
        },
    ]


def fleet_cases() -> list[dict[str, Any]]:
    """Each alert with two replicas: one breaks the rule (the alert names its
    instance), or each keeps it (quiet, where an aggregation over replicas
    would have summed them or hidden one behind the other)."""
    user_limit = "user_limit_tokens_per_second"
    over = "OutputRateUserOverLimit"
    cont = "OutputRateUserThrottledContinuously"
    kv = "OutputRateThrottledKVCacheHigh"
    late = "OutputRateEngineWakesLate"
    drop = "OutputRateTelemetryDropping"
    stale = "OutputRateTelemetryStale"
    failed = "OutputRateLimitsReloadFailed"
    differ = "OutputRateLimitsDiffer"
    store = "OutputRateSharedStoreUnreachable"
    ratio = "model_user:output_rate_limit_ratio:rate5m"
    share = "engine_user:vllm_output_rate_throttled_kv_cache_ratio:ratio"
    at_limit_share = [  # user-a at 0.9 of its 20 tok/s (1080 tokens a minute) on both replicas
        s for r in (R1, R2)
        for s in (series("tokens_charged", "0+1080x30", user="user-a", instance=r),
                  series(user_limit, "20x30", user="user-a", instance=r))]
    return [
        {
            "name": "fleet, shared store: the replica in fallback fires, named; the other does not",
            "interval": "1m",
            "input_series": [
                series("shared_store_fallback", "1x20", instance=R1),
                series("shared_store_calls", "0+600x20", result="failed", instance=R1),
                series("shared_store_fallback", "0x20", instance=R2),
                series("shared_store_calls", "0x20", result="failed", instance=R2),
            ],
            "alert_rule_test": [
                _fires(store, "10m", {"severity": "ticket", "model_name": MODEL, "engine": "0",
                                      "instance": R1},
                    f"Engine 0 of model tiny on instance {R1} cannot reach its shared budget store",
                    f"Engine 0 of model tiny on instance {R1} has been in fallback for at least "
                    "2m (1.2k failed calls to the store in the last 2m): its calls to the shared "
                    "budget store (--output-rate-shared-state) fail or time out, so it serves "
                    "each user at its limit divided by the engines last seen sharing that user. "
                    "Limits still hold; users get less than their limit until the store answers "
                    "again (shared budgets then resume by themselves)."),
            ],
        },
        {
            "name": "fleet, over limit: a user at 0.9x its limit on each of two replicas does not fire",
            "interval": "1m",
            "input_series": at_limit_share,
            "alert_rule_test": [_alert(over, "20m", [])],
            "promql_expr_test": [{
                "expr": f'{ratio}{{user="user-a"}}',
                "eval_time": "20m",
                "exp_samples": [
                    {"labels": f'{ratio}{{instance="{r}",model_name="{MODEL}",user="user-a"}}', "value": 0.9}
                    for r in (R1, R2)],
            }],
        },
        {
            "name": "fleet, over limit: a user over its limit on one replica fires for that replica",
            "interval": "1m",
            "input_series": [
                *at_limit_share,
                # user-b: 30 tok/s on replica 1, 10 tok/s on replica 2, limit 20 on both
                series("tokens_charged", "0+1800x30", user="user-b", instance=R1),
                series("tokens_charged", "0+600x30", user="user-b", instance=R2),
                series(user_limit, "20x30", user="user-b", instance=R1),
                series(user_limit, "20x30", user="user-b", instance=R2),
            ],
            "alert_rule_test": [
                _alert(over, "4m", []),  # not yet for 5m
                _fires(over, "15m", {"severity": "page", "model_name": MODEL, "user": "user-b",
                                     "instance": R1},
                    f"User user-b gets more output tokens than its limit on model tiny on instance {R1}",
                    f"User user-b on model tiny on instance {R1} was charged 150% of its "
                    "configured output-token limit over the last 5m, summed over the "
                    "engines of one instance; the limiter allows at most about 105.7% "
                    "plus one token. Either the limiter is broken or the user is served "
                    "by more than one engine (each engine has its own budget). Tokens "
                    "borrowed above a guaranteed rate (a limit with a ceiling) are not "
                    "charged and never count here: see the runbook's 'A user is above its "
                    "rate'."),
            ],
        },
        {
            "name": "fleet, throttled continuously: throttled the whole time on one replica fires for it",
            "interval": "1m",
            "input_series": [
                series("throttled_requests", "3x60", user="user-a", instance=R1),
                series("throttled_requests", "0x60", user="user-a", instance=R2),
            ],
            "alert_rule_test": [
                _fires(cont, "50m", {"severity": "ticket", "model_name": MODEL, "user": "user-a",
                                     "instance": R1},
                    f"User user-a is throttled almost all the time on model tiny on instance {R1}",
                    f"User user-a on model tiny on instance {R1} had throttled requests 100% "
                    "of the last 30m (alert above 90%): its demand stays above its limit. "
                    "Its requests wait holding KV cache; raise its limit (tier) or ask it "
                    "to send less."),
            ],
        },
        {
            "name": "fleet, throttled continuously: half the time on each of two replicas does not fire",
            "interval": "1m",
            "input_series": [
                # replica 1 in the even minutes, replica 2 in the odd ones
                series("throttled_requests", " ".join(["2 0"] * 30), user="user-a", instance=R1),
                series("throttled_requests", " ".join(["0 2"] * 30), user="user-a", instance=R2),
            ],
            "alert_rule_test": [_alert(cont, "55m", [])],
        },
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
                _fires(kv, "20m", {"severity": "ticket", "model_name": MODEL, "engine": "0",
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
            "alert_rule_test": [_alert(kv, "30m", [])],
        },
        {
            "name": "fleet, wakes late: one replica late, the other on time, fires for the late one",
            "interval": "1m",
            "input_series": [
                *histogram("wake_lateness_seconds", {"0.05": 600}, 40, instance=R1),
                *histogram("wake_lateness_seconds", {"0.0005": 600}, 40, instance=R2),
            ],
            "alert_rule_test": [
                _fires(late, "30m", {"severity": "ticket", "model_name": MODEL, "engine": "0",
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
            "alert_rule_test": [_alert(late, "30m", [])],
        },
        {
            "name": "fleet, telemetry dropping: drops on one replica fire for it",
            "interval": "1m",
            "input_series": [
                series("telemetry_dropped", "0+1x30", reason="export_failed", instance=R1),
                series("telemetry_dropped", "0x30", reason="export_failed", instance=R2),
            ],
            "alert_rule_test": [
                _fires(drop, "20m", {"severity": "ticket", "model_name": MODEL, "engine": "0",
                                     "reason": "export_failed", "instance": R1},
                    f"Output-rate telemetry of engine 0 of model tiny on instance {R1} is dropping data",
                    f"Engine 0 of model tiny on instance {R1} dropped 10 telemetry snapshot(s) "
                    "(reason export_failed) in the last 10m: the output_rate_ metrics on "
                    "/metrics are stale and the dashboards miss data."),
            ],
        },
        {
            "name": "fleet, telemetry dropping: no recent drops on either replica does not fire",
            "interval": "1m",
            "input_series": [
                series("telemetry_dropped", "0x40", reason="export_failed", instance=R1),
                series("telemetry_dropped", "0 1 1x40", reason="export_failed", instance=R2),
            ],
            "alert_rule_test": [_alert(drop, "30m", [])],
        },
        {
            "name": "fleet, telemetry stale: one replica stops while the other keeps up, fires for it",
            "interval": "1m",
            "input_series": [
                series("telemetry_snapshot_timestamp_seconds", "0+60x5 300x30", instance=R1),
                series("telemetry_snapshot_timestamp_seconds", "0+60x40", instance=R2),
            ],
            "alert_rule_test": [
                _fires(stale, "20m", {"severity": "ticket", "model_name": MODEL, "engine": "0",
                                      "instance": R1},
                    f"Output-rate telemetry of engine 0 of model tiny on instance {R1} is stale",
                    f"The newest output-rate snapshot of engine 0 (model tiny) on instance {R1} "
                    "is 15m 0s old (alert above 60s; it is written every second): the engine "
                    "core's exporter or the engine core itself is stuck, and the output_rate_ "
                    "metrics show old values."),
            ],
        },
        {
            "name": "fleet, telemetry stale: both replicas keeping up does not fire",
            "interval": "1m",
            "input_series": [
                series("telemetry_snapshot_timestamp_seconds", "0+60x40", instance=R1),
                series("telemetry_snapshot_timestamp_seconds", "0+60x40", instance=R2),
            ],
            "alert_rule_test": [_alert(stale, "30m", [])],
        },
        {
            "name": "fleet, limits reload failed: an unreadable file on one replica fires for it",
            "interval": "1m",
            "input_series": [
                *reloads({"unreadable": "0x9 1x30"}, instance=R1),
                *reloads({"loaded": "0x9 1x30"}, instance=R2),
            ],
            "alert_rule_test": [
                _fires(failed, "12m", {"severity": "ticket", "model_name": MODEL, "engine": "0",
                                       "result": "unreadable", "instance": R1},
                    f"Engine 0 of model tiny on instance {R1} could not load its changed limits file",
                    f"Engine 0 of model tiny on instance {R1} found its limits file changed "
                    "but could not put it in force 1 time(s) in the last 15m (result "
                    "unreadable: invalid = refused by the checks, unreadable = could not be "
                    "read). The limits in force stay the ones loaded before, older than the "
                    "file; the engine log names the file, the key and the value."),
            ],
        },
        {
            "name": "fleet, limits reload failed: only loaded and unchanged on both replicas does not fire",
            "interval": "1m",
            "input_series": [
                *reloads({"loaded": "0x9 1x30", "unchanged": "0x19 1x20"}, instance=R1),
                *reloads({"loaded": "0x9 1x30", "unchanged": "0x19 1x20"}, instance=R2),
            ],
            "alert_rule_test": [_alert(failed, "30m", [])],
        },
        {
            "name": "fleet, limits differ: two replicas with different limits fire once for the model",
            "interval": "1m",
            "input_series": [
                limits_info(OLD_LIMITS, "1x40", instance=R1),
                limits_info(NEW_LIMITS, "1x40", instance=R2),
            ],
            "alert_rule_test": [
                _alert(differ, "8m", []),  # not yet for 10m
                _fires(differ, "20m", {"severity": "ticket", "model_name": MODEL},
                    "Engines of model tiny run different limits",
                    "2 different sets of limits (SHA-256 of the limits in force) are in "
                    "force on the engines of model tiny for at least 10m: a user gets "
                    "another limit depending on the replica that serves it. Every replica "
                    "of a model should run the same limits file."),
            ],
        },
        {
            "name": "fleet, limits differ: identical limits on two replicas, and a change reaching them 2 minutes apart, do not fire",
            "interval": "1m",
            "input_series": [
                # a ConfigMap change: replica 2 loads it at minute 10, replica 1 at minute 12
                limits_info(OLD_LIMITS, "1x11 stale", instance=R1),
                limits_info(NEW_LIMITS, "_x12 1x28", instance=R1),
                limits_info(OLD_LIMITS, "1x9 stale", instance=R2),
                limits_info(NEW_LIMITS, "_x10 1x30", instance=R2),
            ],
            "alert_rule_test": [_alert(differ, "11m", []), _alert(differ, "30m", [])],
            "promql_expr_test": [{
                # one set of limits on both replicas after the change
                "expr": f"count by (model_name) (count by (model_name, sha256) ({_name('limits_info')}))",
                "eval_time": "30m",
                "exp_samples": [{"labels": f'{{model_name="{MODEL}"}}', "value": 1}],
            }],
        },
    ]


def affinity_cases() -> list[dict[str, Any]]:
    """The affinity alert (only emitted with ``affinity.enabled``; the
    defaults' window 10m and for 20m): a user charged on two replicas fires;
    users each on their own replica, the shared users on every replica, and
    a user moved once (or away and back while its replica restarted) do not."""
    several = "OutputRateUserOnSeveralReplicas"
    # what the alert counts, typed out: replicas that charged the user within 10m
    count = (f"count by (model_name, user) (count by (model_name, user, instance) "
             f"(increase({_name('tokens_charged')}[10m]) > 0))")
    return [
        {
            "name": "affinity: a user charged on two replicas fires once for the user",
            "interval": "1m",
            "input_series": [
                # user-a sent to both replicas (routing broken), user-b to one
                series("tokens_charged", "0+600x40", user="user-a", instance=R1),
                series("tokens_charged", "0+600x40", user="user-a", instance=R2),
                series("tokens_charged", "0+600x40", user="user-b", instance=R1),
            ],
            "alert_rule_test": [
                _alert(several, "15m", []),  # not yet for 20m
                _fires(several, "30m", {"severity": "ticket", "model_name": MODEL, "user": "user-a"},
                    "User user-a of model tiny is served by several replicas",
                    "User user-a of model tiny was charged output tokens on 2 replicas (distinct "
                    "instance) within the last 10m, for at least 20m: each replica has its own "
                    "budget, so the user gets up to 2 times its limit. The fleet is meant to "
                    "route each user to one replica (affinity): the gateway's hash on the user "
                    "header is not in force for this user."),
            ],
        },
        {
            "name": "affinity: each user on its own replica, the shared users and data-parallel engines on both, do not fire",
            "interval": "1m",
            "input_series": [
                series("tokens_charged", "0+600x40", user="user-a", instance=R1),
                series("tokens_charged", "0+600x40", user="user-b", instance=R2),
                # two engines of one replica are one replica
                series("tokens_charged", "0+600x40", user="user-c", instance=R1, engine="0"),
                series("tokens_charged", "0+600x40", user="user-c", instance=R1, engine="1"),
                # charged on every replica: the label-cap overflow, no user, the shared unlisted budget
                *(series("tokens_charged", "0+6000x40", user=shared, instance=r)
                  for shared in ("__other__", "__anonymous__", "__unlisted__") for r in (R1, R2)),
            ],
            "alert_rule_test": [_alert(several, "30m", [])],
        },
        {
            "name": "affinity: a user moved once to another replica does not fire after its old replica leaves the window",
            "interval": "1m",
            "input_series": [
                # a replica added at minute 11: user-a hashes to replica 2 from then on
                series("tokens_charged", "0+600x10 6000x30", user="user-a", instance=R1),
                series("tokens_charged", "_x11 600+600x29", user="user-a", instance=R2),
            ],
            # pending at minute 19 (on both replicas since minute 12), never firing
            "alert_rule_test": [_alert(several, "19m", []), _alert(several, "45m", [])],
            "promql_expr_test": [
                # on both replicas for about one window (shorter than for: 20m) ...
                {"expr": count, "eval_time": "15m",
                 "exp_samples": [{"labels": f'{{model_name="{MODEL}",user="user-a"}}', "value": 2}]},
                # ... then only on the new one
                {"expr": count, "eval_time": "25m",
                 "exp_samples": [{"labels": f'{{model_name="{MODEL}",user="user-a"}}', "value": 1}]},
            ],
        },
        {
            "name": "affinity: a user sent elsewhere while its replica restarted (3 minutes) and back does not fire",
            "interval": "1m",
            "input_series": [
                # replica 1 down in minutes 11-13, its counters start again at minute 14
                series("tokens_charged", "0+600x10 _x3 600+600x26", user="user-a", instance=R1),
                series("tokens_charged", "_x11 600+600x2 1800x26", user="user-a", instance=R2),
            ],
            "alert_rule_test": [_alert(several, "20m", []), _alert(several, "45m", [])],
        },
    ]


def test_file() -> dict[str, Any]:
    affinity = affinity_cases() if T["affinity"]["enabled"] else []
    return {
        "rule_files": ["recording.rules.yaml", "alerts.rules.yaml"],
        "evaluation_interval": T["evaluation_interval"],
        "tests": [*cases(), *fleet_cases(), *affinity],
    }
