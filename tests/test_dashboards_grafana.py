"""scripts/grafana_provision.py against a small fake Grafana HTTP API.

There is no Grafana server here; the fake implements the endpoints the
script uses (folders, dashboards/db, dashboards/uid, datasources, search,
alerting provisioning) with Grafana's status codes, stores what it is sent
(adding the fields Grafana adds) and records every write.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
from vllm_output_rate.dashboards import grafana as g
from vllm_output_rate.dashboards import rules as rule_gen
from vllm_output_rate.dashboards.config import Config
from vllm_output_rate.dashboards.provisioning import DATASOURCE_ENV, FOLDER_TITLE, FOLDER_UID
from vllm_output_rate.dashboards.thresholds import seconds

TOKEN = "test-token"
SCRIPT = ["-m", "vllm_output_rate.tools.grafana_provision"]
#: thresholds.yaml, as the generator reads it
CONFIG = Config.load()


class FakeGrafana:
    def __init__(self) -> None:
        self.folders: dict[str, dict[str, Any]] = {"general-ish": {"uid": "general-ish", "title": "Elsewhere", "version": 1}}
        self.dashboards: dict[str, dict[str, Any]] = {}
        self.rules: dict[str, dict[str, Any]] = {}
        self.groups: dict[tuple[str, str], int] = {}
        self.datasources = [
            {"id": 1, "uid": "loki-1", "type": "loki", "name": "Loki", "isDefault": True},
            {"id": 2, "uid": "prom-secondary", "type": "prometheus", "name": "Other", "isDefault": False},
            {"id": 3, "uid": "prom-main", "type": "prometheus", "name": "Prometheus", "isDefault": False},
        ]
        self.writes: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self._ids = 100
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self, method: str) -> None:
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._send(401, {"message": "Unauthorized"})
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                path = self.path.split("?")[0]
                with fake.lock:
                    if method != "GET":
                        fake.writes.append((method, path))
                    status, payload = fake.route(method, path, body)
                self._send(status, payload)

            def _send(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_PUT(self) -> None:
                self._handle("PUT")

            def do_DELETE(self) -> None:
                self._handle("DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _id(self) -> int:
        self._ids += 1
        return self._ids

    def route(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        not_found = (404, {"message": "not found"})
        if m := re.fullmatch(r"/api/folders/([\w-]+)", path):
            uid = m.group(1)
            if method == "GET":
                return (200, self.folders[uid]) if uid in self.folders else not_found
            if method == "PUT":
                if uid not in self.folders:
                    return not_found
                folder = self.folders[uid]
                folder.update(title=body["title"], version=folder["version"] + 1)
                return 200, folder
        if path == "/api/folders" and method == "POST":
            uid = body.get("uid")
            if not body.get("title") or uid in self.folders:
                return 409, {"message": "exists"}
            self.folders[uid] = {"uid": uid, "title": body["title"], "version": 1, "id": self._id()}
            return 200, self.folders[uid]
        if m := re.fullmatch(r"/api/dashboards/uid/([\w-]+)", path):
            stored = self.dashboards.get(m.group(1))
            return (200, copy.deepcopy(stored)) if stored else not_found
        if path == "/api/dashboards/db" and method == "POST":
            board = copy.deepcopy(body["dashboard"])
            folder = body.get("folderUid")
            if not board.get("uid") or not board.get("title"):
                return 400, {"message": "uid and title required"}
            if folder not in self.folders:
                return 400, {"message": "folder not found"}
            old = self.dashboards.get(board["uid"])
            if old and not body.get("overwrite"):
                return 412, {"message": "version-mismatch"}
            board["id"] = old["dashboard"]["id"] if old else self._id()
            board["version"] = (old["dashboard"]["version"] + 1) if old else 1
            self.dashboards[board["uid"]] = {"dashboard": board,
                                             "meta": {"folderUid": folder, "folderTitle": self.folders[folder]["title"]}}
            return 200, {"status": "success", "uid": board["uid"], "version": board["version"]}
        if path == "/api/datasources":
            return 200, self.datasources
        if path == "/api/search":
            return 200, [{"uid": uid, "type": "dash-db", "title": d["dashboard"]["title"],
                          "folderUid": d["meta"]["folderUid"]} for uid, d in self.dashboards.items()]
        if path == "/api/v1/provisioning/alert-rules" and method == "POST":
            return self._store_rule(body, created=True)
        if m := re.fullmatch(r"/api/v1/provisioning/alert-rules/([\w-]+)", path):
            uid = m.group(1)
            if method == "GET":
                return (200, copy.deepcopy(self.rules[uid])) if uid in self.rules else not_found
            if method == "PUT":
                if uid not in self.rules or body.get("uid", uid) != uid:
                    return not_found
                return self._store_rule(body, created=False)
            if method == "DELETE":
                return (204, {}) if self.rules.pop(uid, None) else not_found
        if m := re.fullmatch(r"/api/v1/provisioning/folder/([\w-]+)/rule-groups/([\w-]+)", path):
            key = (m.group(1), m.group(2))
            if key not in self.groups:
                return not_found
            if method == "PUT":
                self.groups[key] = int(body["interval"])
            rules = [copy.deepcopy(r) for r in self.rules.values()
                     if (r["folderUID"], r["ruleGroup"]) == key]
            return 200, {"title": key[1], "folderUid": key[0], "interval": self.groups[key], "rules": rules}
        return 404, {"message": f"no route {method} {path}"}

    def _store_rule(self, body: dict[str, Any], created: bool) -> tuple[int, Any]:
        required = {"uid", "title", "ruleGroup", "folderUID", "condition", "data", "for",
                    "noDataState", "execErrState"}
        if missing := required - set(body):
            return 400, {"message": f"missing {sorted(missing)}"}
        if body["folderUID"] not in self.folders:
            return 400, {"message": "folder not found"}
        if body["condition"] not in {d["refId"] for d in body["data"]}:
            return 400, {"message": "condition is not a query"}
        if created and body["uid"] in self.rules:
            return 409, {"message": "exists"}
        rule = copy.deepcopy(body)
        rule.update(id=self.rules.get(body["uid"], {}).get("id") or self._id(),
                    updated="2026-11-30T00:00:00Z", provenance="api")
        self.rules[body["uid"]] = rule
        self.groups.setdefault((body["folderUID"], body["ruleGroup"]), 60)
        return (201 if created else 200), rule


@pytest.fixture()
def grafana():
    fake = FakeGrafana()
    fake.thread.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def provision(fake: FakeGrafana, *extra: str, token: str = TOKEN) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *SCRIPT, "--url", fake.url, "--token", token, *extra],
                          capture_output=True, text=True, timeout=120)


def test_first_run_creates_folder_dashboards_and_rules(grafana):
    proc = provision(grafana)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert grafana.folders[FOLDER_UID]["title"] == FOLDER_TITLE
    boards = g.dashboards()
    assert set(grafana.dashboards) == set(boards) == {"output-rate-users", "output-rate-engine"}
    for uid, stored in grafana.dashboards.items():
        assert stored["meta"]["folderUid"] == FOLDER_UID
        assert stored["dashboard"]["panels"] == boards[uid]["panels"]
    alert_names = {a.name for a in rule_gen.alerts(CONFIG)}
    assert {r["title"] for r in grafana.rules.values()} == alert_names
    for rule in grafana.rules.values():
        assert rule["folderUID"] == FOLDER_UID and rule["ruleGroup"] == g.RULE_GROUP
        # the default Prometheus datasource (none is default: the first Prometheus one)
        assert rule["data"][0]["datasourceUid"] in {"prom-secondary", "prom-main"}
    assert grafana.groups[(FOLDER_UID, g.RULE_GROUP)] == seconds(CONFIG["evaluation_interval"])


def test_second_run_changes_nothing(grafana):
    first = provision(grafana, "--datasource-uid", "prom-main")
    assert first.returncode == 0, first.stderr
    assert len(grafana.writes) >= 1 + 2 + 5 + 1
    before = copy.deepcopy((grafana.folders, grafana.dashboards, grafana.rules, grafana.groups))
    grafana.writes.clear()
    second = provision(grafana, "--datasource-uid", "prom-main")
    assert second.returncode == 0, second.stderr
    assert grafana.writes == [], grafana.writes
    assert "0 change(s)" in second.stdout
    assert (grafana.folders, grafana.dashboards, grafana.rules, grafana.groups) == before


def test_drift_is_repaired_and_only_drift_is_written(grafana):
    assert provision(grafana, "--datasource-uid", "prom-main").returncode == 0
    # someone moved a dashboard out of the folder, edited a rule, renamed the
    # folder, and an old rule of ours is still in the group
    grafana.dashboards["output-rate-engine"]["meta"]["folderUid"] = "general-ish"
    over = g.rule_uid("OutputRateUserOverLimit")
    grafana.rules[over]["for"] = "1h"
    grafana.folders[FOLDER_UID]["title"] = "renamed"
    stale = copy.deepcopy(grafana.rules[over])
    stale.update(uid=g.UID_PREFIX + "retired", title="OutputRateRetired")
    grafana.rules[stale["uid"]] = stale
    foreign = copy.deepcopy(stale)
    foreign.update(uid="someone-elses-rule", title="NotOurs")
    grafana.rules[foreign["uid"]] = foreign
    grafana.writes.clear()
    proc = provision(grafana, "--datasource-uid", "prom-main")
    assert proc.returncode == 0, proc.stderr
    assert sorted(grafana.writes) == sorted([
        ("PUT", f"/api/folders/{FOLDER_UID}"),
        ("POST", "/api/dashboards/db"),
        ("PUT", f"/api/v1/provisioning/alert-rules/{over}"),
        ("DELETE", f"/api/v1/provisioning/alert-rules/{g.UID_PREFIX}retired"),
    ])
    assert grafana.dashboards["output-rate-engine"]["meta"]["folderUid"] == FOLDER_UID
    assert grafana.rules[over]["for"] == CONFIG.over["for"]
    assert "someone-elses-rule" in grafana.rules
    assert grafana.folders[FOLDER_UID]["title"] == FOLDER_TITLE


def test_custom_folder_and_bad_token(grafana):
    proc = provision(grafana, "--folder", "SRE / vLLM", "--folder-uid", "sre-vllm")
    assert proc.returncode == 0, proc.stderr
    assert grafana.folders["sre-vllm"]["title"] == "SRE / vLLM"
    assert all(d["meta"]["folderUid"] == "sre-vllm" for d in grafana.dashboards.values())
    assert all(r["folderUID"] == "sre-vllm" for r in grafana.rules.values())
    bad = provision(grafana, token="wrong")
    assert bad.returncode != 0 and "401" in (bad.stderr + bad.stdout)


def test_grafana_rules_mirror_the_prometheus_alerts():
    rules = g.alert_rules("folder", "ds")
    alerts = {a.name: a for a in rule_gen.alerts(CONFIG)}
    assert [r["title"] for r in rules] == list(alerts)
    uids = [r["uid"] for r in rules]
    assert len(set(uids)) == len(uids) and all(len(u) <= 40 for u in uids)
    for rule in rules:
        alert = alerts[rule["title"]]
        query = rule["data"][0]
        assert query["model"]["expr"] == alert.expr and query["datasourceUid"] == "ds"
        assert rule["condition"] == "B" and rule["data"][1]["model"]["expression"] == "A"
        assert rule["for"] == alert.for_ and rule["labels"] == {"severity": alert.severity}
        assert rule["annotations"]["runbook_url"] == CONFIG.runbook_url(alert.name)
        description = rule["annotations"]["description"]
        assert "$values.A.Value" in description and not re.search(r"\$value\b", description)
    # Grafana's condition is A > 0: every alert's value is positive when it fires
    for section in ("throttled_long", "throttled_kv", "wake_lateness", "telemetry_dropped"):
        values = [v for k, v in CONFIG[section].items() if k in {"share", "seconds", "max_drops"}]
        assert values and all(v >= 0 for v in values)


def test_alerting_file_provisioning_matches_the_api_rules():
    import yaml

    data = yaml.safe_load((REPO / "dashboards" / "provisioning" / "alerting.yaml").read_text())
    (group,) = data["groups"]
    assert group["folder"] == FOLDER_TITLE and group["name"] == g.RULE_GROUP
    api_rules = {r["uid"]: r for r in g.alert_rules(FOLDER_UID, "ds")}
    assert [r["uid"] for r in group["rules"]] == list(api_rules)
    for rule in group["rules"]:
        # Grafana expands $VARS in provisioned labels and queries (not annotations):
        # the only $ outside the annotations is the datasource variable
        outside = json.dumps({k: v for k, v in rule.items() if k != "annotations"})
        assert re.findall(r"\$\{?\w+", outside) == ["${" + DATASOURCE_ENV]
        assert rule["annotations"] == api_rules[rule["uid"]]["annotations"]
        assert rule["data"][0]["model"]["expr"] == api_rules[rule["uid"]]["data"][0]["model"]["expr"]
