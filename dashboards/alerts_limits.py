"""The limits' alerts: a changed limits file an engine could not put in
force, and engines of one model running different limits; with their
promtool cases."""

from __future__ import annotations

import hashlib
from typing import Any

from vllm_output_rate.dashboards.alert import MODEL, R1, R2, Alert, fires, name, quiet, series
from vllm_output_rate.dashboards.config import Config
from vllm_output_rate.dashboards.expressions import LIMITS_FAILED_MATCHER, limit_sets_expr


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



def alerts(c: Config) -> list[Alert]:
    at = c.where()
    reload, differ = c["limits_reload_failed"], c["limits_differ"]
    return [
        Alert(
            "OutputRateLimitsReloadFailed",
            f"sum by ({c.by('model_name', 'engine', 'result')})"
            f" (increase({c.raw('limits_reloads', extra=LIMITS_FAILED_MATCHER)}[{reload['window']}]))"
            f" > {reload['max_failures']}",
            reload["for"], c.severity("limits_reload_failed"),
            "Engine {{ $labels.engine }} of model {{ $labels.model_name }}" + at
            + " could not load its changed limits file",
            "Engine {{ $labels.engine }} of model {{ $labels.model_name }}" + at + " found its "
            "limits file changed but could not put it in force {{ $value | humanize }} time(s) in "
            f"the last {reload['window']} (result {{{{ $labels.result }}}}: invalid = refused by "
            "the checks, unreadable = could not be read). The limits in force stay the ones "
            "loaded before, older than the file; the engine log names the file, the key and the "
            "value."),
        Alert(
            "OutputRateLimitsDiffer",
            f"{limit_sets_expr(c)} > 1",
            differ["for"], c.severity("limits_differ"),
            "Engines of model {{ $labels.model_name }}" + c.in_fleet() + " run different limits",
            "{{ $value }} different sets of limits (SHA-256 of the limits in force) are in force "
            "on the engines of model {{ $labels.model_name }}" + c.in_fleet() + " for at "
            f"least {differ['for']}: a user gets another limit depending on the replica that "
            "serves it. Every replica of a model should run the same limits file.",
            fleet_wide=True),
    ]


def cases(c: Config) -> list[dict[str, Any]]:
    """One engine, or two of one replica."""
    failed = "OutputRateLimitsReloadFailed"
    differ = "OutputRateLimitsDiffer"
    return [
        {
            "name": "limits reload failed: a changed limits file refused at minute 10",
            "interval": "1m",
            "input_series": reloads({"loaded": "0 0 1x40", "invalid": "0x9 1x30"}),
            "alert_rule_test": [
                quiet(failed, "9m"),  # before the bad file
                fires(c, failed, "12m", {"severity": "warning", "model_name": MODEL, "engine": "0",
                                       "result": "invalid"},
                    "Engine 0 of model tiny could not load its changed limits file",
                    "Engine 0 of model tiny found its limits file changed but could not "
                    "put it in force 1 time(s) in the last 15m (result invalid: invalid = "
                    "refused by the checks, unreadable = could not be read). The limits in "
                    "force stay the ones loaded before, older than the file; the engine log "
                    "names the file, the key and the value."),
                quiet(failed, "30m"),  # counted once: gone a window later
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
            "alert_rule_test": [quiet(failed, "30m")],
        },
        {
            "name": "limits differ: two engines of a model with different limits files",
            "interval": "1m",
            "input_series": [
                limits_info(OLD_LIMITS, "1x40", engine="0"),
                limits_info(NEW_LIMITS, "1x40", engine="1"),
            ],
            "alert_rule_test": [
                quiet(differ, "8m"),  # not yet for 10m
                fires(c, differ, "20m", {"severity": "warning", "model_name": MODEL},
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
            "alert_rule_test": [quiet(differ, "30m")],
        },
    ]


def fleet_cases(c: Config) -> list[dict[str, Any]]:
    """Two replicas (the alert names the one that breaks the rule)."""
    failed = "OutputRateLimitsReloadFailed"
    differ = "OutputRateLimitsDiffer"
    return [
        {
            "name": "fleet, limits reload failed: an unreadable file on one replica fires for it",
            "interval": "1m",
            "input_series": [
                *reloads({"unreadable": "0x9 1x30"}, instance=R1),
                *reloads({"loaded": "0x9 1x30"}, instance=R2),
            ],
            "alert_rule_test": [
                fires(c, failed, "12m", {"severity": "warning", "model_name": MODEL, "engine": "0",
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
            "alert_rule_test": [quiet(failed, "30m")],
        },
        {
            "name": "fleet, limits differ: two replicas with different limits fire once for the model",
            "interval": "1m",
            "input_series": [
                limits_info(OLD_LIMITS, "1x40", instance=R1),
                limits_info(NEW_LIMITS, "1x40", instance=R2),
            ],
            "alert_rule_test": [
                quiet(differ, "8m"),  # not yet for 10m
                fires(c, differ, "20m", {"severity": "warning", "model_name": MODEL},
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
            "alert_rule_test": [quiet(differ, "11m"), quiet(differ, "30m")],
            "promql_expr_test": [{
                # one set of limits on both replicas after the change
                "expr": f"count by (model_name) (count by (model_name, sha256) ({name('limits_info')}))",
                "eval_time": "30m",
                "exp_samples": [{"labels": f'{{model_name="{MODEL}"}}', "value": 1}],
            }],
        },
    ]
