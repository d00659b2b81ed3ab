"""The alerts: the rule files and their cases through the real ``promtool``
(which can fail), a firing and a quiet case for every alert, summaries,
descriptions and runbook sections, and the affinity alert (a user on several
replicas: off by default, its settings, cases and runbook).

No engine: the generator, its files and the real ``promtool``.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dashboard_files import (CONFIG, DASH, FLEET_SELECTOR, RULE_FILES, TEST_FILES, alert_rules,
                             all_panels, custom_thresholds, needs_promtool, promtool)
from vllm_output_rate.dashboards import generate
from vllm_output_rate.dashboards import rules as rule_gen
from vllm_output_rate.dashboards.config import Config
from vllm_output_rate.dashboards.expressions import replicas_per_user_expr
from vllm_output_rate.dashboards.thresholds import seconds
from vllm_output_rate.dashboards.users_dashboard import replicas_per_user_panels, users_dashboard


# -- promtool ----------------------------------------------------------------------

@needs_promtool
@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_promtool_check_rules(path):
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


@needs_promtool
@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: p.name)
def test_promtool_test_rules(path):
    proc = subprocess.run([promtool, "test", "rules", path.name], cwd=path.parent,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_promtool
def test_promtool_unit_tests_can_fail(tmp_path):
    """A wrong expectation must make ``promtool test rules`` fail (so the
    test above is not vacuous)."""
    test = yaml.safe_load(TEST_FILES[0].read_text())
    for path in RULE_FILES:
        shutil.copy(path, tmp_path / path.name)
    for case in test["tests"]:
        for art in case.get("alert_rule_test", ()):
            for alert in art["exp_alerts"]:
                alert["exp_labels"]["user"] = "someone-else"
    (tmp_path / "broken.test.yaml").write_text(yaml.safe_dump(test))
    proc = subprocess.run([promtool, "test", "rules", "broken.test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert proc.returncode != 0


def test_every_alert_has_a_firing_and_a_quiet_case():
    _check_firing_and_quiet_cases(yaml.safe_load(TEST_FILES[0].read_text())["tests"], alert_rules())


def _check_firing_and_quiet_cases(tests: list[dict], rules: list[dict]) -> None:
    fires: dict[str, list] = {}
    quiet: dict[str, list] = {}
    for case in tests:
        for art in case.get("alert_rule_test", ()):
            (fires if art["exp_alerts"] else quiet).setdefault(art["alertname"], []).append(art)
    for rule in rules:
        name = rule["alert"]
        assert name in fires, f"{name}: no case where it fires"
        assert name in quiet, f"{name}: no case where it must not fire"
        wait = seconds(rule["for"])
        # a quiet case only counts when evaluated after the for: duration
        assert any(seconds(a["eval_time"]) > wait + 300 for a in quiet[name]), name
        for art in fires[name]:
            for alert in art["exp_alerts"]:
                assert set(alert["exp_annotations"]) == {"summary", "description", "runbook_url"}
                assert alert["exp_labels"]["severity"] == rule["labels"]["severity"]


# -- alerts: annotations and runbook ---------------------------------------------------

def _anchors(markdown: str) -> set[str]:
    """GitHub-style anchors of the Markdown headings."""
    out = set()
    for line in markdown.splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_alerts_have_summary_description_and_runbook():
    _check_annotations_and_runbook(alert_rules())


def _check_annotations_and_runbook(rules: list[dict]) -> None:
    runbook = (DASH / "runbook.md").read_text()
    anchors = _anchors(runbook)
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    assert {"OutputRateUserOverLimit", "OutputRateUserThrottledContinuously",
            "OutputRateThrottledKVCacheHigh", "OutputRateEngineWakesLate",
            "OutputRateTelemetryDropping", "OutputRateLimitsReloadFailed",
            "OutputRateLimitsDiffer"} <= set(names)
    for rule in rules:
        ann = rule["annotations"]
        assert ann["summary"] and ann["description"], rule["alert"]
        assert "$value" in ann["description"], rule["alert"]  # the measured value
        # the description names what the alert is about: the user, else the
        # engine, else (an alert over a model's replicas) the model
        label = ("user" if "user" in rule["expr"] or "user" in ann["summary"]
                 else "engine" if "engine" in rule["expr"] else "model_name")
        assert f"$labels.{label}" in ann["description"], rule["alert"]
        url, _, anchor = ann["runbook_url"].partition("#")
        assert url.endswith("dashboards/runbook.md"), url
        assert anchor == rule["alert"].lower() and anchor in anchors, rule["alert"]
        section = runbook.split(f"## {rule['alert']}\n", 1)[1].split("\n## ", 1)[0]
        for part in ("**What it means.**", "**How to confirm.**", "**What to do.**"):
            assert part in section, (rule["alert"], part)
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert re.fullmatch(r"\d+[smh]", rule["for"])


def _with_affinity() -> dict:
    """thresholds.yaml with the affinity alert on (shipped off)."""
    custom = copy.deepcopy(CONFIG.thresholds)
    custom["affinity"] = {**custom["affinity"], "enabled": True}
    return custom


# -- affinity: a user on several replicas --------------------------------------------------

AFFINITY = "OutputRateUserOnSeveralReplicas"
SHARED = '__other__|__anonymous__|__unlisted__'


def test_affinity_alert_is_off_by_default_and_absent_from_every_rule_artefact():
    """Shipped off (a fleet that does not route by user would fire for every
    busy user): no rule, no promtool case, no Grafana copy, nothing in the
    PrometheusRule."""
    assert CONFIG["affinity"]["enabled"] is False
    assert AFFINITY not in {a.name for a in rule_gen.alerts(CONFIG)}
    assert AFFINITY not in {r["alert"] for r in alert_rules()}
    tests = yaml.safe_load(TEST_FILES[0].read_text())["tests"]
    assert all(art["alertname"] != AFFINITY for case in tests for art in case.get("alert_rule_test", ()))
    for rel in ("prometheus/alerts.rules.yaml", "prometheus/alerts.test.yaml",
                "provisioning/alerting.yaml", "kubernetes/prometheusrule.yaml"):
        assert AFFINITY not in (DASH / rel).read_text(), rel
    # turned on, it reaches them all
    c = Config(_with_affinity())
    out = generate.outputs(c)
    for rel in ("prometheus/alerts.rules.yaml", "prometheus/alerts.test.yaml",
                "provisioning/alerting.yaml", "kubernetes/prometheusrule.yaml"):
        assert AFFINITY in out[rel], rel


def test_affinity_alert_counts_the_replicas_that_charged_a_user():
    """The group labels are what it counts (not a grouping of the alert),
    through the fleet selector, without the shared users."""
    c = Config(_with_affinity())
    alert = {a.name: a for a in rule_gen.alerts(c)}[AFFINITY]
    panel = {p.title: p for p in users_dashboard(c).panels}["Replicas serving each user (last 10m)"]
    assert alert.fleet_wide
    assert alert.expr == (
        "count by (model_name, user) (count by (model_name, user, instance) (increase("
        f'vllm_output_rate_tokens_charged_total{{user!~"{SHARED}"}}[10m]) > 0)) > 1')
    assert (alert.for_, alert.severity) == ("20m", "warning")
    assert "$labels.user" in alert.description and "$labels.model_name" in alert.summary
    assert "$labels.instance" not in alert.summary + alert.description
    (target,) = panel.targets
    assert target.expr == (
        "sort_desc(count by (model_name, user) (count by (model_name, user, instance) (increase("
        'vllm_output_rate_tokens_charged_total{model_name=~"$model_name", instance=~"$instance", '
        f'user=~"$user", user!~"{SHARED}"}}[10m]) > 0)))')
    c = Config(custom_thresholds())
    alert = {a.name: a for a in rule_gen.alerts(c)}[AFFINITY]
    assert alert.expr == (
        "count by (model_name, user) (count by (model_name, user, cluster, pod) (increase("
        f'vllm_output_rate_tokens_charged_total{{{FLEET_SELECTOR}, user!~"{SHARED}"}}[10m]) > 0)) > 1')
    assert "(distinct (cluster, pod))" in alert.description


def test_affinity_settings_reach_the_alert_and_the_panel():
    custom = _with_affinity()
    custom["affinity"].update({"window": "5m", "for": "15m", "severity": "critical",
                               "exclude_users": SHARED + r'|batch\..*|say "hi"'})
    c = Config(custom)
    alert = {a.name: a for a in rule_gen.alerts(c)}[AFFINITY]
    (panel,) = replicas_per_user_panels(c)
    matcher = r'user!~"__other__|__anonymous__|__unlisted__|batch\\..*|say \"hi\""'
    assert f"{matcher}}}[5m]" in alert.expr
    assert (alert.for_, alert.severity) == ("15m", "critical")
    assert f"{matcher}}}[5m]" in panel.targets[0].expr and panel.title.endswith("(last 5m)")
    # red from 2 replicas when the fleet routes by user; a plain count otherwise
    assert panel.thresholds == [("green", None), ("red", 2)]
    (shipped,) = replicas_per_user_panels(CONFIG)
    assert shipped.thresholds == []
    # replicas not told apart (no group labels): nothing to count, no panel
    flat = copy.deepcopy(CONFIG.thresholds)
    flat["fleet"]["group_labels"] = []
    c = Config(flat)
    assert replicas_per_user_panels(c) == []


def test_the_users_dashboard_shows_the_replicas_serving_each_user():
    board = json.loads((DASH / "output-rate-users.json").read_text())
    (panel,) = [p for p in all_panels(board) if p["title"].startswith("Replicas serving each user")]
    assert panel["type"] == "table" and panel["options"]["sortBy"] == [{"displayName": "replicas", "desc": True}]
    (target,) = panel["targets"]
    assert target["instant"] and target["format"] == "table" and target["expr"].startswith("sort_desc(")
    assert replicas_per_user_expr(CONFIG, dashboard=True) in target["expr"]


@pytest.mark.parametrize("change", [
    {"enabled": "yes"},
    {"for": "10m"},                                      # not longer than the window: a move fires
    {"window": "30m", "for": "20m"},
    {"exclude_users": "__anonymous__|__unlisted__"},     # __other__ is on every replica
    {"exclude_users": "__other__|__anonymous__"},
    {"exclude_users": "("},
    {"exclude_users": None},
    {"severity": "ticket"},                              # a label of the page_ticket scheme
    {"severity": "urgent"},
    {"window": "ten minutes"},
])
def test_bad_affinity_settings_are_refused(change):
    bad = _with_affinity()
    bad["affinity"].update(change)
    with pytest.raises(ValueError):
        Config(bad)


def test_affinity_needs_group_labels_to_count_replicas():
    bad = _with_affinity()
    bad["fleet"]["group_labels"] = []
    with pytest.raises(ValueError, match="group_labels"):
        Config(bad)
    bad["affinity"]["enabled"] = False  # off: no alert, nothing to count
    c = Config(bad)
    assert AFFINITY not in {a.name for a in rule_gen.alerts(c)}


def test_affinity_alert_has_cases_annotations_and_runbook():
    c = Config(_with_affinity())
    out = generate.outputs(c)
    rules = [r for g in yaml.safe_load(out["prometheus/alerts.rules.yaml"])["groups"] for r in g["rules"]]
    assert AFFINITY in {r["alert"] for r in rules}
    _check_annotations_and_runbook(rules)
    _check_firing_and_quiet_cases(yaml.safe_load(out["prometheus/alerts.test.yaml"])["tests"], rules)
    section = (DASH / "runbook.md").read_text().split(f"## {AFFINITY}\n", 1)[1].split("\n## ", 1)[0]
    for needle in ("hash $http_x_user_id consistent;", "RING_HASH", "hash_policy", "Gateway API",
                   "shared-budget", "affinity.enabled: true", "generate.py"):
        assert needle in section, needle


def _affinity_promtool_run(tmp_path: Path, mutate=None) -> subprocess.CompletedProcess:
    c = Config(_with_affinity())
    out = generate.outputs(c)
    for rel in ("prometheus/recording.rules.yaml", "prometheus/alerts.rules.yaml"):
        (tmp_path / Path(rel).name).write_text(out[rel])
    test = yaml.safe_load(out["prometheus/alerts.test.yaml"])
    if mutate:
        mutate(test)
    (tmp_path / "alerts.test.yaml").write_text(yaml.safe_dump(test, sort_keys=False))
    return subprocess.run([promtool, "test", "rules", "alerts.test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, check=False)


@needs_promtool
def test_affinity_alert_promtool_cases_pass(tmp_path):
    """On a copy of the thresholds with affinity.enabled: true, the cases
    (fires on two replicas; quiet for users on their own replica, the shared
    users, a user moved once, a user away while its replica restarted) pass,
    with every other case; and the rules pass promtool check."""
    proc = _affinity_promtool_run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = [c["name"] for c in yaml.safe_load((tmp_path / "alerts.test.yaml").read_text())["tests"]]
    assert sum(name.startswith("affinity:") for name in names) == 4
    proc = subprocess.run([promtool, "check", "rules", "recording.rules.yaml", "alerts.rules.yaml"],
                          cwd=tmp_path, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_promtool
def test_affinity_alert_promtool_cases_can_fail(tmp_path):
    """The quiet cases are not vacuous: expecting the alert where it must
    stay quiet fails, and so does expecting it on another user."""
    def expect_firing_everywhere(test):
        for case in test["tests"]:
            if case["name"].startswith("affinity:"):
                for art in case["alert_rule_test"]:
                    if not art["exp_alerts"]:
                        art["exp_alerts"] = [{"exp_labels": {"severity": "warning", "model_name": "tiny",
                                                             "user": "user-a"}}]
                    else:
                        art["exp_alerts"][0]["exp_labels"]["user"] = "user-b"
    proc = _affinity_promtool_run(tmp_path, expect_firing_everywhere)
    assert proc.returncode != 0
    failed = proc.stdout + proc.stderr
    # every affinity case fails (promtool names a case once per failing evaluation)
    assert len(set(re.findall(r"name: (affinity:[^,]*),", failed))) == 4, failed
