"""Grafana's file provisioning of the dashboards and of the Grafana-managed
copies of the alerts (``provisioning/*.yaml``), and the folder both this
and ``scripts/grafana_provision.py`` put them in."""

from __future__ import annotations

from typing import Any

from vllm_output_rate.dashboards import grafana
from vllm_output_rate.dashboards.config import Config

#: The Grafana folder both the file provisioning and scripts/grafana_provision.py use.
FOLDER_UID = "output-rate"
FOLDER_TITLE = "Output rate"
#: Where dashboards/*.json are mounted for Grafana's file provisioning.
PROVISIONING_PATH = "/var/lib/grafana/dashboards/output-rate"
#: environment variable Grafana expands in the alerting provisioning file
DATASOURCE_ENV = "OUTPUT_RATE_PROMETHEUS_UID"


def alerting_provisioning(c: Config, alert_rules: dict[str, Any]) -> dict[str, Any]:
    """Grafana file provisioning of the alert rules (copy into
    ``/etc/grafana/provisioning/alerting/``; set ``OUTPUT_RATE_PROMETHEUS_UID``
    to the uid of the Prometheus datasource). The same rules as
    ``scripts/grafana_provision.py`` creates; use one or the other. Annotations
    are not expanded by Grafana's provisioning, so their templates stay as is.

    ``alert_rules``: the alert rule file's content this run makes (not the
    file on disk, which may be the previous generation's)."""
    rules = []
    for rule in grafana.alert_rules(FOLDER_UID, "${" + DATASOURCE_ENV + "}", rules=alert_rules):
        rule = {k: v for k, v in rule.items() if k not in ("ruleGroup", "folderUID", "orgID")}
        rules.append(rule)
    return {"apiVersion": 1, "groups": [{
        "orgId": 1, "name": grafana.RULE_GROUP, "folder": FOLDER_TITLE,
        "interval": c.interval, "rules": rules}]}


def provisioning() -> dict[str, Any]:
    """Grafana file provisioning of the dashboards (copy into
    ``/etc/grafana/provisioning/dashboards/`` and mount this folder's JSON
    files at ``PROVISIONING_PATH``)."""
    return {"apiVersion": 1, "providers": [{
        "name": "output-rate", "orgId": 1, "type": "file",
        "folder": FOLDER_TITLE, "folderUid": FOLDER_UID,
        "disableDeletion": False, "allowUiUpdates": False, "updateIntervalSeconds": 60,
        "options": {"path": PROVISIONING_PATH, "foldersFromFilesStructure": False},
    }]}
