"""The shared-budget alert (``--output-rate-shared-state``): an engine in
fallback because its store does not answer; with its promtool cases."""

from __future__ import annotations

from typing import Any

from vllm_output_rate.dashboards.alert import MODEL, R1, R2, Alert, fires, quiet, series
from vllm_output_rate.dashboards.config import Config
from vllm_output_rate.dashboards.expressions import STORE_FAILED


def alerts(c: Config) -> list[Alert]:
    at = c.where()
    engine = c.by("model_name", "engine")
    return [
        Alert(
            "OutputRateSharedStoreUnreachable",
            f"sum by ({engine}) (increase({c.raw('shared_store_calls', extra=STORE_FAILED)}"
            f"[{c['shared_store']['window']}]))"
            f" and on ({engine}) max by ({engine}) ({c.raw('shared_store_fallback')}) > 0",
            c["shared_store"]["for"], c.severity("shared_store"),
            "Engine {{ $labels.engine }} of model {{ $labels.model_name }}" + at
            + " cannot reach its shared budget store",
            "Engine {{ $labels.engine }} of model {{ $labels.model_name }}" + at + " has been in "
            f"fallback for at least {c['shared_store']['for']} ({{{{ $value | humanize }}}} failed "
            f"calls to the store in the last {c['shared_store']['window']}): its calls to the "
            "shared budget store (--output-rate-shared-state) fail or time out, so it "
            "serves each user at its limit divided by the engines last seen sharing that user. "
            "Limits still hold; users get less than their limit until the store answers again "
            "(shared budgets then resume by themselves)."),
    ]


def cases(c: Config) -> list[dict[str, Any]]:
    """One engine, or two of one replica."""
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
                quiet(store, "5m"),
                quiet(store, "7m"),  # in fallback, not yet for 2m
                fires(c, store, "9m", {"severity": "warning", "model_name": MODEL, "engine": "0"},
                    "Engine 0 of model tiny cannot reach its shared budget store",
                    "Engine 0 of model tiny has been in fallback for at least 2m (1.2k failed "
                    "calls to the store in the last 2m): its calls to the shared budget store "
                    "(--output-rate-shared-state) fail or time out, so it serves each user at its "
                    "limit divided by the engines last seen sharing that user. Limits still hold; "
                    "users get less than their limit until the store answers again (shared "
                    "budgets then resume by themselves)."),
                quiet(store, "20m"),  # back
            ],
        },
    ]


def fleet_cases(c: Config) -> list[dict[str, Any]]:
    """Two replicas (the alert names the one that breaks the rule)."""
    store = "OutputRateSharedStoreUnreachable"
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
                fires(c, store, "10m", {"severity": "warning", "model_name": MODEL, "engine": "0",
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
    ]
