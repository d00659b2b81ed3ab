#!/usr/bin/env python
"""Create or update the output-rate folder, dashboards and alert rules in a Grafana.

    python -m vllm_output_rate.tools.grafana_provision --url https://grafana.example:3000 --token "$GRAFANA_TOKEN"

Idempotent: everything is read first and written only when it differs, so a
second run changes nothing. Dashboards are always saved into the folder (a
dashboard someone moved elsewhere is moved back). The alert rules are the
Prometheus rules in ``dashboards/prometheus/alerts.rules.yaml`` as
Grafana-managed rules (``dashboards/grafana.py``) in the rule group
``output-rate`` of the same folder, querying the Prometheus datasource given
by ``--datasource-uid`` (default: Grafana's default Prometheus datasource).
Rules of that group that are no longer in the file are deleted.

The token needs the permissions to write folders, dashboards and alert rules
(an Editor service account token, or Admin for folder creation).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException

from vllm_output_rate.dashboards import grafana as g
from vllm_output_rate.dashboards.provisioning import FOLDER_TITLE, FOLDER_UID
from vllm_output_rate.tools.common.help_text import PlainHelpFormatter, description_and_epilog

#: keys Grafana sets itself on a stored dashboard
SERVER_KEYS = {"id", "version"}


def is_subset(want: Any, have: Any) -> bool:
    """Every key and value of ``want`` is in ``have`` (Grafana adds fields of its own)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(k in have and is_subset(v, have[k]) for k, v in want.items())
    if isinstance(want, list):
        return (isinstance(have, list) and len(want) == len(have)
                and all(is_subset(a, b) for a, b in zip(want, have)))
    if isinstance(want, float) or isinstance(have, float):
        return isinstance(have, (int, float)) and not isinstance(have, bool) and float(want) == float(have)
    return want == have


def _get(call, *args) -> Any:
    """The object, or None when Grafana answers 404."""
    try:
        return call(*args)
    except GrafanaClientError as exc:
        if exc.status_code == 404:
            return None
        raise


class Provisioner:
    def __init__(self, api: GrafanaApi, folder_uid: str, folder_title: str, log=print) -> None:
        self.api = api
        self.folder_uid = folder_uid
        self.folder_title = folder_title
        self.log = log
        self.changes: list[str] = []

    def _changed(self, what: str) -> None:
        self.changes.append(what)
        self.log(what)

    def folder(self) -> None:
        have = _get(self.api.folder.get_folder, self.folder_uid)
        if have is None:
            self.api.folder.create_folder(self.folder_title, uid=self.folder_uid)
            self._changed(f"folder {self.folder_uid!r}: created")
        elif have.get("title") != self.folder_title:
            self.api.folder.update_folder(self.folder_uid, title=self.folder_title,
                                          version=have.get("version"), overwrite=True)
            self._changed(f"folder {self.folder_uid!r}: renamed to {self.folder_title!r}")
        else:
            self.log(f"folder {self.folder_uid!r}: unchanged")

    def dashboards(self) -> None:
        for uid, board in g.dashboards().items():
            want = {k: v for k, v in board.items() if k not in SERVER_KEYS}
            have = _get(self.api.dashboard.get_dashboard, uid)
            if have is not None:
                stored = {k: v for k, v in have.get("dashboard", {}).items() if k not in SERVER_KEYS}
                in_folder = have.get("meta", {}).get("folderUid") == self.folder_uid
                if in_folder and is_subset(want, stored):
                    self.log(f"dashboard {uid!r}: unchanged")
                    continue
            self.api.dashboard.update_dashboard({
                "dashboard": {**want, "id": None}, "folderUid": self.folder_uid, "overwrite": True,
                "message": "scripts/grafana_provision.py"})
            self._changed(f"dashboard {uid!r}: " + ("created" if have is None else "updated"))

    def datasource_uid(self) -> str:
        sources = [d for d in self.api.datasource.list_datasources() if d.get("type") == "prometheus"]
        if not sources:
            raise SystemExit("no Prometheus datasource in this Grafana: pass --datasource-uid")
        sources.sort(key=lambda d: not d.get("isDefault"))
        return sources[0]["uid"]

    def alert_rules(self, datasource_uid: str) -> None:
        rules = g.alert_rules(self.folder_uid, datasource_uid)
        prov = self.api.alertingprovisioning
        for rule in rules:
            have = _get(prov.get_alertrule, rule["uid"])
            if have is None:
                prov.create_alertrule(rule)
                self._changed(f"alert rule {rule['uid']!r}: created")
            elif not is_subset(rule, have):
                prov.update_alertrule(rule["uid"], rule)
                self._changed(f"alert rule {rule['uid']!r}: updated")
            else:
                self.log(f"alert rule {rule['uid']!r}: unchanged")
        group = _get(prov.get_rule_group, self.folder_uid, g.RULE_GROUP) or {}
        wanted = {r["uid"] for r in rules}
        for rule in group.get("rules", ()):
            if rule.get("uid", "").startswith(g.UID_PREFIX) and rule["uid"] not in wanted:
                prov.delete_alertrule(rule["uid"])
                self._changed(f"alert rule {rule['uid']!r}: deleted (no longer in the rule file)")
        interval = g.group_interval_seconds()
        group = _get(prov.get_rule_group, self.folder_uid, g.RULE_GROUP) or {}
        if group.get("interval") != interval:
            body = {"title": g.RULE_GROUP, "folderUid": self.folder_uid, "interval": interval,
                    "rules": group.get("rules", [])}
            prov.update_rule_group(self.folder_uid, g.RULE_GROUP, body)
            self._changed(f"rule group {g.RULE_GROUP!r}: evaluation interval {interval}s")

    def run(self, datasource_uid: str | None = None) -> list[str]:
        self.folder()
        self.dashboards()
        self.alert_rules(datasource_uid or self.datasource_uid())
        return self.changes


def main(argv: list[str] | None = None) -> int:
    description, epilog = description_and_epilog(__doc__)
    parser = argparse.ArgumentParser(description=description, epilog=epilog,
                                     formatter_class=PlainHelpFormatter)
    parser.add_argument("--url", required=True, help="Grafana base URL")
    parser.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"),
                        help="API / service account token (default: $GRAFANA_TOKEN)")
    parser.add_argument("--folder", default=FOLDER_TITLE, help="folder title")
    parser.add_argument("--folder-uid", default=FOLDER_UID, help="folder uid (stable: links use it)")
    parser.add_argument("--datasource-uid", help="Prometheus datasource the alert rules query")
    args = parser.parse_args(argv)
    if not args.token:
        parser.error("give --token or set GRAFANA_TOKEN")
    api = GrafanaApi.from_url(args.url, credential=args.token)
    try:
        changes = Provisioner(api, args.folder_uid, args.folder).run(args.datasource_uid)
    except GrafanaException as exc:
        print(f"grafana_provision: Grafana answered {exc.status_code}: {exc.message}", file=sys.stderr)
        return 1
    except OSError as exc:  # connection refused, DNS, TLS (the HTTP client's errors are OSErrors)
        print(f"grafana_provision: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    print(f"{len(changes)} change(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
