"""Dashboards and Prometheus rules as generated: the committed files equal
the generator's output, one run makes consistent files, the thresholds are
commented in one file, and what the fleet settings (the selector, the group
labels, the replicas an alert compares) make of every rule and query.

No engine here; the integration test (test_dashboards_e2e.py) runs every
panel query against a real Prometheus scraping a real engine.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from dashboard_files import (CONFIG, DASH, DASHBOARD_FILES, FLEET_SELECTOR, RULE_FILES, TEST_FILES,
                             all_panels, custom_thresholds, known_series, needs_promtool, promtool)
from vllm_output_rate.dashboards import generate
from vllm_output_rate.dashboards import rules as rule_gen
from vllm_output_rate.dashboards.alert import Alert
from vllm_output_rate.dashboards.config import Config
from vllm_output_rate.dashboards.expressions import over_limit_expr
from vllm_output_rate.dashboards.promql import metric_names
from vllm_output_rate.dashboards.recording import recording_rules
from vllm_output_rate.telemetry.metrics import METRICS


# -- generated files -------------------------------------------------------------

def test_committed_files_equal_generator_output():
    stale = [rel for rel, content in generate.outputs(CONFIG).items()
             if not (DASH / rel).exists() or (DASH / rel).read_text() != content]
    assert stale == [], f"run `python dashboards/generate.py` and commit: {stale}"


def test_one_generator_run_makes_consistent_files(monkeypatch):
    """A new alert reaches the Grafana provisioning in the same run that
    writes it to the rule file (not only in the next one)."""
    made = rule_gen.alerts

    def with_new_alert(c):
        return [*made(c), Alert("OutputRateBrandNew", "vector(1)", "1m", "warning",
                                "summary", "description")]

    monkeypatch.setattr(rule_gen, "alerts", with_new_alert)
    out = generate.outputs(CONFIG)
    assert "OutputRateBrandNew" in out["prometheus/alerts.rules.yaml"]
    assert "OutputRateBrandNew" in out["provisioning/alerting.yaml"]


def test_expected_files_exist():
    assert {p.name for p in DASHBOARD_FILES} == set(generate.DASHBOARDS)
    assert {p.name for p in RULE_FILES} == {"recording.rules.yaml", "alerts.rules.yaml"}
    assert [p.name for p in TEST_FILES] == ["alerts.test.yaml"]


def test_thresholds_are_commented_in_one_file():
    text = (DASH / "thresholds.yaml").read_text()
    for line in text.splitlines():
        if re.match(r"\s+\w+:\s*\S", line):  # every nested setting has a comment
            assert "#" in line, line
    # nothing else in dashboards/ types a threshold: the rules use the file,
    # and the burst comes from the limiter itself (not typed again here)
    from vllm_output_rate.limiter import BURST_NS

    on_disk = yaml.safe_load(text)
    assert "burst_seconds" not in on_disk["over_limit"]
    on_disk["over_limit"]["burst_seconds"] = BURST_NS / 1e9
    assert CONFIG.thresholds == on_disk


# -- fleets: the selector and the group labels ----------------------------------------

def _generated_expressions(outputs: dict[str, str]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(rule expressions, dashboard expressions incl. variable queries) of a
    generator run's outputs."""
    rules = []
    for rel in ("prometheus/recording.rules.yaml", "prometheus/alerts.rules.yaml"):
        for group in yaml.safe_load(outputs[rel])["groups"]:
            if group["name"] == rule_gen.RENAMED_GROUP:
                continue  # the earlier names, each a recorded name of the group above
            rules += [(r.get("record") or r["alert"], r["expr"]) for r in group["rules"]]
    panels = []
    for name in generate.DASHBOARDS:
        board = json.loads(outputs[name])
        for panel in all_panels(board):
            panels += [(f"{name}: {panel['title']}", t["expr"]) for t in panel.get("targets", ())]
        panels += [(f"{name}: ${v['name']}", v["definition"])
                   for v in board["templating"]["list"] if v["type"] == "query"]
    return rules, panels


def _selections(expr: str) -> list[tuple[str, str]]:
    """(metric name, its matchers or '') of every metric an expression reads."""
    inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", expr)
    expr = inner.group(1) if inner else expr
    out = []
    for name in metric_names(expr):
        for match in re.finditer(rf"(?<![\w:]){re.escape(name)}(?![\w:])(\{{[^}}]*\}})?", expr):
            out.append((name, match.group(1) or ""))
    return out


def _groupings(expr: str) -> list[str]:
    """The label lists of every ``by (...)`` and ``on (...)`` clause."""
    return re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr)


def _fleet_wide_alerts(c: Config) -> set[str]:
    """Alerts that compare the replicas of a model (aggregate over the group
    labels) instead of judging each replica alone."""
    return {a.name for a in rule_gen.alerts(c) if a.fleet_wide}


def _check_fleet_wide_groupings(expr: str, group: set[str]) -> None:
    """An alert across replicas: every clause per model; the replicas are
    what it counts (an inner clause holds all the group labels, as the
    affinity alert's) or aggregates over (none of them), never a part of
    them; its outermost clause holds none: one alert per model (and user)."""
    groupings = [{label.strip() for label in labels.split(",")} for labels in _groupings(expr)]
    for names in groupings:
        assert "model_name" in names, expr
        assert not names & group or group <= names, expr
    assert not groupings[0] & group, expr


def test_fleet_selector_and_group_labels_reach_every_rule_and_query():
    c = Config(custom_thresholds())
    outputs = generate.outputs(c)
    n_rules = len(recording_rules(c)) + len(rule_gen.alerts(c))
    fleet_wide = _fleet_wide_alerts(c)
    rules, panels = _generated_expressions(outputs)
    assert len(rules) == n_rules
    assert fleet_wide == {"OutputRateLimitsDiffer", "OutputRateUserOnSeveralReplicas"}
    for where, expr in rules + panels:
        selections = _selections(expr)
        assert selections, (where, expr)
        for name, matchers in selections:
            # every metric read, by every rule and panel, through the selector
            assert FLEET_SELECTOR in matchers, (where, name, expr)
    for where, expr in rules:
        groupings = _groupings(expr)
        assert groupings, (where, expr)  # every rule aggregates or matches per group
        if where in fleet_wide:
            # replicas are what it compares: counted or aggregated over, per model
            _check_fleet_wide_groupings(expr, {"cluster", "pod"})
        for labels in groupings:
            names = {label.strip() for label in labels.split(",")}
            if where not in fleet_wide:
                assert {"cluster", "pod"} <= names, (where, expr)
            assert "instance" not in names, (where, expr)
    for where, expr in panels:
        # filtered by every replica variable (a variable by those before it)
        if not where.endswith(("$model_name", "$cluster", "$pod")):
            assert 'pod=~"$pod"' in expr, (where, expr)
        if not where.endswith(("$model_name", "$cluster")):
            assert 'cluster=~"$cluster"' in expr, (where, expr)
    for name in generate.DASHBOARDS:
        variables = [v["name"] for v in json.loads(outputs[name])["templating"]["list"]]
        assert variables == ["datasource", "model_name", "cluster", "pod", "engine", "user"], name
    # the alert texts name the replica; the Grafana copies carry the same expressions
    (alert_group,) = yaml.safe_load(outputs["prometheus/alerts.rules.yaml"])["groups"]
    for rule in alert_group["rules"]:
        for text in (rule["annotations"]["summary"], rule["annotations"]["description"]):
            if rule["alert"] in fleet_wide:
                assert "$labels.model_name" in text and "$labels.pod" not in text, rule["alert"]
            else:
                assert "$labels.cluster" in text and "$labels.pod" in text, rule["alert"]
    grafana_exprs = [d["model"]["expr"] for g in yaml.safe_load(outputs["provisioning/alerting.yaml"])["groups"]
                     for r in g["rules"] for d in r["data"] if "expr" in d["model"]]
    assert grafana_exprs == [r["expr"] for r in alert_group["rules"]]
    # the shipped config is another object, untouched
    assert CONFIG.selector() == "" and CONFIG.group_labels() == ["instance"]
    test_committed_files_equal_generator_output()


@needs_promtool
def test_fleet_rules_with_custom_selector_and_group_labels_are_valid(tmp_path):
    c = Config(custom_thresholds())
    outputs = generate.outputs(c)
    for rel in ("prometheus/recording.rules.yaml", "prometheus/alerts.rules.yaml"):
        path = tmp_path / Path(rel).name
        path.write_text(outputs[rel])
        proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_default_fleet_settings_keep_todays_expressions():
    """No selector and per-instance groups: the expressions only gain the
    instance label (and stay valid: no empty matchers); without group labels
    the over-limit alert is the single-engine expression of before."""
    assert CONFIG.selector() == "" and CONFIG.group_labels() == ["instance"]
    rules, panels = _generated_expressions(generate.outputs(CONFIG))
    for where, expr in rules + panels:
        assert not re.search(r"\{\s*,|,\s*\}|\{\}", expr), (where, expr)
    known = known_series()
    own_labels = {m.name: set(m.labels) for m in METRICS}
    fleet_wide = _fleet_wide_alerts(CONFIG)
    for where, expr in rules:
        for name, matchers in _selections(expr):
            # bare metric names, as before, but for a rule's matchers on the
            # metric's own labels (the failed results of the reload counter)
            used = set(re.findall(r"(\w+)\s*[=!]~?", matchers))
            assert used <= own_labels.get(known.get(name), set()), (where, name, matchers)
        for labels in _groupings(expr):
            assert ("instance" in labels) != (where in fleet_wide), (where, expr)
    before = ("sum by (model_name, user) (rate(vllm_output_rate_tokens_charged_total[5m])) / on (model_name, user) "
              "max by (model_name, user) (vllm_output_rate_user_limit_tokens_per_second) > on (model_name, user) "
              "((1 + 0.05 + (0.1 + 2) / 300) + 1 / (300 * max by (model_name, user) "
              "(vllm_output_rate_user_limit_tokens_per_second)))")
    summed = copy.deepcopy(CONFIG.thresholds)
    summed["fleet"]["group_labels"] = []
    c = Config(summed)
    assert over_limit_expr(c) == before
    assert over_limit_expr(CONFIG) == before.replace("(model_name, user)", "(model_name, user, instance)")


def test_limits_differ_alert_compares_the_replicas_of_each_fleet():
    """same_by splits a model's replicas into fleets (by cluster, here); the
    group labels (pod) are what it compares, never a grouping of it."""
    custom = custom_thresholds()
    custom["limits_differ"] = {**custom["limits_differ"], "same_by": ["cluster"]}
    c = Config(custom)
    alert = {a.name: a for a in rule_gen.alerts(c)}["OutputRateLimitsDiffer"]
    assert alert.expr == ("count by (model_name, cluster) (count by (model_name, cluster, sha256) "
                          f"(vllm_output_rate_limits_info{{{FLEET_SELECTOR}}})) > 1")
    assert "{{ with $labels.cluster }} in cluster {{ . }}{{ end }}" in alert.summary
    assert "$labels.pod" not in alert.summary + alert.description


@pytest.mark.parametrize("same_by", [["pod", "cluster"], ["sha256"], ["user"], "cluster", ["a b"]])
def test_bad_limits_differ_settings_are_refused(same_by):
    bad = custom_thresholds()  # group labels [cluster, pod]
    bad["limits_differ"] = {**bad["limits_differ"], "same_by": same_by}
    with pytest.raises(ValueError):
        Config(bad)


@pytest.mark.parametrize("fleet", [
    {"selector": '{job="vllm"}', "group_labels": ["instance"]},
    {"selector": "", "group_labels": ["user"]},
    {"selector": "", "group_labels": ["instance", "instance"]},
    {"selector": "", "group_labels": "instance"},
    {"selector": "", "group_labels": ["not a label"]},
])
def test_bad_fleet_settings_are_refused(fleet):
    bad = copy.deepcopy(CONFIG.thresholds)
    bad["fleet"] = fleet
    with pytest.raises(ValueError):
        Config(bad)
