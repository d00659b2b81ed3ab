"""The Prometheus rule files and their promtool cases, from the alert group
modules and the recording rules:

- ``prometheus/recording.rules.yaml`` (``recording.py``): the recording
  rules, and in a group of its own the names of the release before
  recorded from the new ones (removed in the next release);
- ``prometheus/alerts.rules.yaml``: the alerts of every group, one rule
  group (``output-rate.alerts``); every alert keeps the group labels (fires
  once per replica by default) but the fleet-wide ones;
- ``prometheus/alerts.test.yaml``: ``promtool test rules`` cases, the
  groups' own (one engine, then two replicas).

Every ``runbook_url`` is ``thresholds.yaml``'s ``runbook_base_url`` and the
alert's anchor.
"""

from __future__ import annotations

from typing import Any

from vllm_output_rate.dashboards import (
    alerts_affinity,
    alerts_engine,
    alerts_limits,
    alerts_prompts,
    alerts_shared_store,
    alerts_telemetry,
    alerts_users,
)
from vllm_output_rate.dashboards.alert import Alert
from vllm_output_rate.dashboards.config import Config
from vllm_output_rate.dashboards import recording
from vllm_output_rate.dashboards.recording import recording_rules, renamed_rules

#: the rule group of the recorded names of the release before (removed in the next)
RENAMED_GROUP = "output-rate.recording.deprecated-names"
#: the alert groups, in the order of the rule file
ALERT_GROUPS = (alerts_users, alerts_engine, alerts_telemetry, alerts_limits,
                alerts_shared_store, alerts_affinity, alerts_prompts)
#: the same, in the order of their cases in the promtool file
CASE_GROUPS = (alerts_shared_store, alerts_users, alerts_engine, alerts_telemetry,
               alerts_limits, alerts_affinity, alerts_prompts)


def alerts(c: Config) -> list[Alert]:
    return [alert for group in ALERT_GROUPS for alert in group.alerts(c)]


def alert_rule(c: Config, a: Alert) -> dict[str, Any]:
    return {"alert": a.name, "expr": a.expr, "for": a.for_,
            "labels": {"severity": a.severity},
            "annotations": {"summary": a.summary, "description": a.description,
                            "runbook_url": c.runbook_url(a.name)}}


def rule_files(c: Config, made: list[Alert] | None = None) -> dict[str, dict[str, Any]]:
    """Relative path -> content of both rule files (``made``: the alerts,
    when not ``alerts(c)``)."""
    made = alerts(c) if made is None else made
    return {
        "prometheus/recording.rules.yaml": {"groups": [
            {"name": "output-rate.recording", "interval": c.interval, "rules": recording_rules(c)},
            # the names of the release before: removed in the next release
            {"name": RENAMED_GROUP, "interval": c.interval, "rules": renamed_rules(c)}]},
        "prometheus/alerts.rules.yaml": {"groups": [{
            "name": "output-rate.alerts", "interval": c.interval,
            "rules": [alert_rule(c, a) for a in made]}]},
    }


def test_file(c: Config) -> dict[str, Any]:
    """The promtool file: the recorded names' cases, then every alert
    group's cases with one engine, then with two replicas."""
    return {
        "rule_files": ["recording.rules.yaml", "alerts.rules.yaml"],
        "evaluation_interval": c.interval,
        # promtool evaluates the groups of one step in no set order unless
        # told: the old names read the new ones, and the alerts read both
        "group_eval_order": ["output-rate.recording", RENAMED_GROUP, "output-rate.alerts"],
        "tests": [*recording.cases(c),
                  *(case for group in CASE_GROUPS for case in group.cases(c)),
                  *(case for group in CASE_GROUPS for case in group.fleet_cases(c))],
    }
