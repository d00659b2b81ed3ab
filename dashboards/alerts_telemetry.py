"""The telemetry's alerts: snapshots that stop moving, and snapshots that
fail to export; with their promtool cases."""

from __future__ import annotations

from typing import Any

from vllm_output_rate.dashboards.alert import MODEL, R1, R2, Alert, fires, quiet, series
from vllm_output_rate.dashboards.config import Config


def alerts(c: Config) -> list[Alert]:
    at = c.where()
    stale, drop = c["telemetry_stale"], c["telemetry_dropped"]
    engine = c.by("model_name", "engine")
    return [
        Alert(
            "OutputRateTelemetryStale",
            f"time() - max by ({engine}) ({c.raw('telemetry_snapshot_timestamp_seconds')})"
            f" > {stale['seconds']}",
            stale["for"], c.severity("telemetry_stale"),
            "Output-rate telemetry of engine {{ $labels.engine }} of model {{ $labels.model_name }}" + at
            + " is stale",
            "The newest output-rate snapshot of engine {{ $labels.engine }} (model "
            "{{ $labels.model_name }})" + at + " is {{ $value | humanizeDuration }} old (alert above "
            f"{stale['seconds']}s; it is written every second): the engine core's exporter or the "
            "engine core itself is stuck, and the output_rate_ metrics show old values."),
        Alert(
            "OutputRateTelemetryDropping",
            f"sum by ({c.by('model_name', 'engine', 'reason')}) (increase({c.raw('telemetry_dropped')}[{drop['window']}]))"
            f" > {drop['max_drops']}",
            drop["for"], c.severity("telemetry_dropped"),
            "Output-rate telemetry of engine {{ $labels.engine }} of model {{ $labels.model_name }}" + at
            + " is dropping data",
            "Engine {{ $labels.engine }} of model {{ $labels.model_name }}" + at + " dropped "
            "{{ $value | humanize }} telemetry snapshot(s) (reason {{ $labels.reason }}) in the last "
            f"{drop['window']}: the output_rate_ metrics on /metrics are stale and the dashboards "
            "miss data."),
    ]


def cases(c: Config) -> list[dict[str, Any]]:
    """One engine, or two of one replica."""
    drop = "OutputRateTelemetryDropping"
    stale = "OutputRateTelemetryStale"
    return [
        {
            "name": "telemetry dropping: an export failure every minute",
            "interval": "1m",
            "input_series": [series("telemetry_dropped", "0+1x30", reason="export_failed")],
            "alert_rule_test": [
                fires(c, drop, "20m", {"severity": "warning", "model_name": MODEL, "engine": "0",
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
            "alert_rule_test": [quiet(drop, "30m")],
        },
        {
            "name": "telemetry stale: snapshots stop moving at minute 5",
            "interval": "1m",
            # the snapshot time follows time() (value = seconds since 0) until
            # minute 5, then stays there
            "input_series": [series("telemetry_snapshot_timestamp_seconds", "0+60x5 300x30")],
            "alert_rule_test": [
                quiet(stale, "8m"),  # stale, but not yet for 5m
                fires(c, stale, "20m", {"severity": "warning", "model_name": MODEL, "engine": "0"},
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
            "alert_rule_test": [quiet(stale, "30m")],
        },
    ]


def fleet_cases(c: Config) -> list[dict[str, Any]]:
    """Two replicas (the alert names the one that breaks the rule)."""
    drop = "OutputRateTelemetryDropping"
    stale = "OutputRateTelemetryStale"
    return [
        {
            "name": "fleet, telemetry dropping: drops on one replica fire for it",
            "interval": "1m",
            "input_series": [
                series("telemetry_dropped", "0+1x30", reason="export_failed", instance=R1),
                series("telemetry_dropped", "0x30", reason="export_failed", instance=R2),
            ],
            "alert_rule_test": [
                fires(c, drop, "20m", {"severity": "warning", "model_name": MODEL, "engine": "0",
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
            "alert_rule_test": [quiet(drop, "30m")],
        },
        {
            "name": "fleet, telemetry stale: one replica stops while the other keeps up, fires for it",
            "interval": "1m",
            "input_series": [
                series("telemetry_snapshot_timestamp_seconds", "0+60x5 300x30", instance=R1),
                series("telemetry_snapshot_timestamp_seconds", "0+60x40", instance=R2),
            ],
            "alert_rule_test": [
                fires(c, stale, "20m", {"severity": "warning", "model_name": MODEL, "engine": "0",
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
            "alert_rule_test": [quiet(stale, "30m")],
        },
    ]
