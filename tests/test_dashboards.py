"""Dashboards and Prometheus rules: generated files, promtool, references.

No engine here; the integration test (test_dashboards_e2e.py) runs every
panel query against a real Prometheus scraping a real engine.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dashboards import generate  # noqa: E402
from dashboards.promql import metric_names, render  # noqa: E402
from telemetry.metrics import METRICS  # noqa: E402

DASH = REPO / "dashboards"
RULE_FILES = sorted(DASH.rglob("*.rules.yaml"))
TEST_FILES = sorted(DASH.rglob("*.test.yaml"))
DASHBOARD_FILES = sorted(DASH.glob("*.json"))
#: the uids Grafana links and bookmarks point at: changing one breaks them
STABLE_UIDS = {"output-rate-users", "output-rate-engine"}
REQUIRED_VARIABLES = {"datasource", "model_name", "engine", "user"}

promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(promtool is None, reason="promtool not installed (make tools)")


def load_dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in DASHBOARD_FILES}


def all_panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", ()))
    return out


def rule_groups() -> list[dict]:
    return [g for p in RULE_FILES for g in yaml.safe_load(p.read_text())["groups"]]


def recorded_names() -> set[str]:
    return {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}


def alert_rules() -> list[dict]:
    return [r for g in rule_groups() for r in g["rules"] if "alert" in r]


# -- generated files -------------------------------------------------------------

def test_committed_files_equal_generator_output():
    stale = [rel for rel, content in generate.outputs().items()
             if not (DASH / rel).exists() or (DASH / rel).read_text() != content]
    assert stale == [], f"run `python dashboards/generate.py` and commit: {stale}"


def test_one_generator_run_makes_consistent_files(monkeypatch):
    """A new alert reaches the Grafana provisioning in the same run that
    writes it to the rule file (not only in the next one)."""
    made = generate.alerts

    def with_new_alert():
        return [*made(), generate.Alert("OutputRateBrandNew", "vector(1)", "1m", "warning",
                                        "summary", "description")]

    monkeypatch.setattr(generate, "alerts", with_new_alert)
    out = generate.outputs()
    assert "OutputRateBrandNew" in out["prometheus/alerts.rules.yaml"]
    assert "OutputRateBrandNew" in out["provisioning/alerting.yaml"]


def test_expected_files_exist():
    assert {p.name for p in DASHBOARD_FILES} == set(generate.DASHBOARDS)
    assert {p.name for p in RULE_FILES} == {"recording.rules.yaml", "alerts.rules.yaml"}
    assert [p.name for p in TEST_FILES] == ["alerts.test.yaml"]


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
    tests = yaml.safe_load(TEST_FILES[0].read_text())["tests"]
    fires: dict[str, list] = {}
    quiet: dict[str, list] = {}
    for case in tests:
        for art in case.get("alert_rule_test", ()):
            (fires if art["exp_alerts"] else quiet).setdefault(art["alertname"], []).append(art)
    for rule in alert_rules():
        name = rule["alert"]
        assert name in fires, f"{name}: no case where it fires"
        assert name in quiet, f"{name}: no case where it must not fire"
        wait = generate.seconds(rule["for"])
        # a quiet case only counts when evaluated after the for: duration
        assert any(generate.seconds(a["eval_time"]) > wait + 300 for a in quiet[name]), name
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
    runbook = (DASH / "runbook.md").read_text()
    anchors = _anchors(runbook)
    names = [r["alert"] for r in alert_rules()]
    assert len(names) == len(set(names))
    assert {"OutputRateUserOverLimit", "OutputRateUserThrottledContinuously",
            "OutputRateThrottledKVCacheHigh", "OutputRateEngineWakesLate",
            "OutputRateTelemetryDropping"} <= set(names)
    for rule in alert_rules():
        ann = rule["annotations"]
        assert ann["summary"] and ann["description"], rule["alert"]
        assert "$value" in ann["description"], rule["alert"]  # the measured value
        label = "user" if "user" in rule["expr"] or "user" in ann["summary"] else "engine"
        assert f"$labels.{label}" in ann["description"], rule["alert"]
        url, _, anchor = ann["runbook_url"].partition("#")
        assert url.endswith("dashboards/runbook.md"), url
        assert anchor == rule["alert"].lower() and anchor in anchors, rule["alert"]
        section = runbook.split(f"## {rule['alert']}\n", 1)[1].split("\n## ", 1)[0]
        for part in ("**What it means.**", "**How to confirm.**", "**What to do.**"):
            assert part in section, (rule["alert"], part)
        assert rule["labels"]["severity"] in {"page", "ticket"}
        assert re.fullmatch(r"\d+[smh]", rule["for"])


def test_thresholds_are_commented_in_one_file():
    text = (DASH / "thresholds.yaml").read_text()
    for line in text.splitlines():
        if re.match(r"\s+\w+:\s*\S", line):  # every nested setting has a comment
            assert "#" in line, line
    # nothing else in dashboards/ types a threshold: the rules use the file
    assert generate.T == yaml.safe_load(text)


# -- dashboards -----------------------------------------------------------------------

def test_dashboards_are_valid_with_stable_unique_uids():
    boards = load_dashboards()
    uids = [b["uid"] for b in boards.values()]
    assert len(uids) == len(set(uids))
    assert set(uids) == STABLE_UIDS
    for name, board in boards.items():
        assert board.get("id") is None and board["title"] and board["schemaVersion"] >= 36
        ids = [p["id"] for p in all_panels(board)]
        assert len(ids) == len(set(ids)), name
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert REQUIRED_VARIABLES <= set(variables), name
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        assert variables["user"]["multi"] is True and variables["user"]["includeAll"] is True
        for var in ("model_name", "engine", "user"):
            assert variables[var]["datasource"]["uid"] == "${datasource}"


def test_every_panel_has_datasource_unit_title_description():
    for name, board in load_dashboards().items():
        for panel in all_panels(board):
            if panel["type"] == "row":
                assert panel["title"]
                continue
            where = f"{name}: {panel.get('title')!r}"
            assert panel["title"].strip(), where
            assert len(panel.get("description", "")) > 40, where
            assert "healthy" in panel["description"].lower(), where  # what a good value looks like
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
            assert panel["fieldConfig"]["defaults"].get("unit"), where
            assert panel["targets"], where
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}", where
                expr = target["expr"]
                assert 'model_name=~"$model_name"' in expr, where
                # rendered the way Grafana would, the query parses as PromQL names
                assert "$" not in render(expr, {"model_name": ".*", "engine": ".*", "user": ".*"})


KNOWN_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def _known_series() -> dict[str, str]:
    """Every series name a panel or rule may read -> where it comes from."""
    out = {}
    for metric in METRICS:
        if metric.kind == "histogram":
            for suffix in KNOWN_SUFFIXES["histogram"]:
                out[metric.full_name + suffix] = metric.name
        else:
            out[metric.full_name] = metric.name
    for name, kind in generate.VLLM_METRICS.items():
        for suffix in KNOWN_SUFFIXES[kind]:
            out[name + suffix] = name
    for name in recorded_names():
        out[name] = "recording rule"
    return out


def _all_expressions() -> list[tuple[str, str]]:
    out = []
    for name, board in load_dashboards().items():
        for panel in all_panels(board):
            for target in panel.get("targets", ()):
                out.append((f"{name}: {panel['title']}", target["expr"]))
            for var in board["templating"]["list"]:
                if var["type"] == "query":
                    out.append((f"{name}: ${var['name']}", var["definition"]))
    for rule in (r for g in rule_groups() for r in g["rules"]):
        out.append((rule.get("record") or rule["alert"], rule["expr"]))
    return out


def test_every_referenced_metric_is_known():
    known = _known_series()
    unknown = []
    for where, expr in _all_expressions():
        m = re.fullmatch(r"label_values\((.*),\s*\w+\)", expr)
        names = metric_names(m.group(1) if m else expr)
        assert names, (where, expr)
        unknown += [(where, n) for n in names if n not in known]
    assert unknown == []


def test_metric_names_parser_finds_and_ignores_the_right_words():
    expr = ('histogram_quantile(0.99, sum by (user, le) (rate(output_rate_x_bucket'
            '{user=~"$user", le="0.1"}[5m]))) / on (model_name) group_left () '
            'vllm:foo_total > bool 1e-3 or model_user:y:rate1m offset 5m')
    assert metric_names(expr) == {"output_rate_x_bucket", "vllm:foo_total", "model_user:y:rate1m"}


def test_vllm_metrics_exist_in_this_vllm():
    """The vLLM metric names the dashboards use are defined by the installed vLLM
    (the integration test checks them against a real scrape too)."""
    import vllm.v1.metrics.loggers as loggers

    source = Path(loggers.__file__).read_text()
    for name in generate.VLLM_METRICS:
        assert f'name="{name}"' in source, name


def test_recording_rules_cover_rate_spacing_and_throttled_kv():
    names = recorded_names()
    assert any(":output_rate_tokens_charged_total:rate" in n for n in names)
    assert any(":output_rate_inter_token_seconds:p99" in n for n in names)
    assert any(":output_rate_throttled_kv_cache_share:" in n for n in names)


def test_reverse_report_of_metrics_no_panel_shows():
    """Every exported metric should be on some panel; a new one without a
    panel is reported (a warning, not a failure: add the panel)."""
    shown = set()
    known = _known_series()
    for where, expr in _all_expressions():
        if where.split(":")[0].endswith(".json"):
            shown |= {known[n] for n in metric_names(expr) if n in known}
    unshown = [m.full_name for m in METRICS if m.name not in shown]
    print("\nexported metrics no panel shows:", unshown or "none")
    if unshown:
        warnings.warn(f"exported metrics no dashboard panel shows: {unshown}")
    # the report itself must see the panels
    assert "tokens_charged" in shown and "inter_token_seconds" in shown
