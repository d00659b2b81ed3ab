"""Grafana-managed copies of the Prometheus alert rules.

``scripts/grafana_provision.py`` sends these to Grafana's alerting
provisioning API (``/api/v1/provisioning/alert-rules``). Each alert becomes
one Grafana rule with two steps: ``A``, the rule's PromQL expression as an
instant query on the Prometheus datasource (it returns series only while the
condition holds, valued as in the Prometheus alert), and ``B``, a threshold
``A > 0`` (every alert's value is positive when it fires; a test checks the
thresholds are). No data means OK, as with Prometheus. The annotations are
the same templates with ``$value`` spelled ``$values.A.Value``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from vllm_output_rate.dashboards.thresholds import seconds

HERE = Path(__file__).resolve().parent
ALERTS_FILE = HERE / "prometheus" / "alerts.rules.yaml"
RULE_GROUP = "output-rate"
UID_PREFIX = "output-rate-"


def rule_uid(alert: str) -> str:
    """OutputRateUserOverLimit -> output-rate-user-over-limit (<= 40 characters)."""
    words = re.findall(r"[A-Z]+(?![a-z])|[A-Z][a-z]*", alert.removeprefix("OutputRate"))
    uid = UID_PREFIX + "-".join(w.lower() for w in words)
    assert len(uid) <= 40, uid
    return uid


def _grafana_template(text: str) -> str:
    return re.sub(r"\$value\b", "$values.A.Value", text)


def group_interval_seconds(path: Path = ALERTS_FILE) -> int:
    (group,) = yaml.safe_load(path.read_text())["groups"]
    return int(seconds(group["interval"]))


def alert_rules(folder_uid: str, datasource_uid: str, path: Path = ALERTS_FILE,
                rules: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The Grafana provisioning API bodies of every alert in ``path`` (or in
    ``rules``, the rule file's content, when given)."""
    out = []
    if rules is None:
        rules = yaml.safe_load(path.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "alert" not in rule:
                continue
            out.append({
                "uid": rule_uid(rule["alert"]),
                "title": rule["alert"],
                "ruleGroup": RULE_GROUP,
                "folderUID": folder_uid,
                "orgID": 1,
                "condition": "B",
                "data": [
                    {"refId": "A", "queryType": "", "datasourceUid": datasource_uid,
                     "relativeTimeRange": {"from": 600, "to": 0},
                     "model": {"refId": "A", "expr": rule["expr"], "instant": True, "range": False,
                               "editorMode": "code", "legendFormat": ""}},
                    {"refId": "B", "queryType": "", "datasourceUid": "__expr__",
                     "relativeTimeRange": {"from": 0, "to": 0},
                     "model": {"refId": "B", "type": "threshold", "expression": "A",
                               "datasource": {"type": "__expr__", "uid": "__expr__"},
                               "conditions": [{"type": "query", "evaluator": {"type": "gt", "params": [0]},
                                               "operator": {"type": "and"},
                                               "query": {"params": ["A"]},
                                               "reducer": {"type": "last", "params": []}}]}},
                ],
                "noDataState": "OK",
                "execErrState": "Error",
                "for": rule.get("for", "0s"),
                "labels": dict(rule.get("labels", {})),
                "annotations": {k: _grafana_template(v) for k, v in rule.get("annotations", {}).items()},
                "isPaused": False,
            })
    return out


def dashboards() -> dict[str, dict[str, Any]]:
    """uid -> dashboard JSON, from the committed files."""
    out = {}
    for path in sorted(HERE.glob("*.json")):
        board = json.loads(path.read_text())
        out[board["uid"]] = board
    return out
