"""The affinity alert: a user charged on more than one replica of a model,
for fleets whose gateway routes each user to one replica
(``thresholds.yaml`` ``affinity``); with its promtool cases. Off by
default: neither the rule nor its cases are in any generated file then."""

from __future__ import annotations

from typing import Any

from vllm_output_rate.dashboards.alert import MODEL, R1, R2, Alert, fires, name, quiet, series
from vllm_output_rate.dashboards.config import Config
from vllm_output_rate.dashboards.expressions import replicas_per_user_expr


def alerts(c: Config) -> list[Alert]:
    """A user charged on more than one replica of a model: in affinity mode
    (each user routed to one replica) every replica's limit is then no longer
    the user's fleet-wide limit. Counts replicas: aggregates over the group
    labels, like OutputRateLimitsDiffer."""
    a = c["affinity"]
    if not a["enabled"]:
        return []
    return [Alert(
        "OutputRateUserOnSeveralReplicas",
        f"{replicas_per_user_expr(c)} > 1",
        a["for"], c.severity("affinity"),
        "User {{ $labels.user }} of model {{ $labels.model_name }} is served by several replicas",
        "User {{ $labels.user }} of model {{ $labels.model_name }} was charged output tokens on "
        f"{{{{ $value }}}} replicas (distinct {c.group_noun()}) within the last {a['window']}, for at "
        f"least {a['for']}: each replica has its own budget, so the user gets up to "
        "{{ $value }} times its limit. The fleet is meant to route each user to one replica "
        "(affinity): the gateway's hash on the user header is not in force for this user.",
        fleet_wide=True)]


def cases(c: Config) -> list[dict[str, Any]]:
    """Its cases are all of replicas: ``fleet_cases``."""
    return []


def fleet_cases(c: Config) -> list[dict[str, Any]]:
    """The affinity alert (only emitted with ``affinity.enabled``; the
    defaults' window 10m and for 20m): a user charged on two replicas fires;
    users each on their own replica, the shared users on every replica, and
    a user moved once (or away and back while its replica restarted) do not.
    None while the alert is off."""
    if not c["affinity"]["enabled"]:
        return []
    several = "OutputRateUserOnSeveralReplicas"
    # what the alert counts, typed out: replicas that charged the user within 10m
    count = (f"count by (model_name, user) (count by (model_name, user, instance) "
             f"(increase({name('tokens_charged')}[10m]) > 0))")
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
                quiet(several, "15m"),  # not yet for 20m
                fires(c, several, "30m", {"severity": "warning", "model_name": MODEL, "user": "user-a"},
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
            "alert_rule_test": [quiet(several, "30m")],
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
            "alert_rule_test": [quiet(several, "19m"), quiet(several, "45m")],
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
            "alert_rule_test": [quiet(several, "20m"), quiet(several, "45m")],
        },
    ]
