"""Dashboards and Prometheus rules: generated files, promtool, references.

No engine here; the integration test (test_dashboards_e2e.py) runs every
panel query against a real Prometheus scraping a real engine.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

from vllm_output_rate.dashboards import generate
from vllm_output_rate.dashboards import rules as rule_gen
from vllm_output_rate.dashboards.alert import Alert
from vllm_output_rate.dashboards.config import VLLM_METRICS, Config
from vllm_output_rate.dashboards.expressions import over_limit_expr, replicas_per_user_expr
from vllm_output_rate.dashboards.promql import metric_names, render
from vllm_output_rate.dashboards.recording import recording_rules
from vllm_output_rate.dashboards.thresholds import seconds
from vllm_output_rate.dashboards.users_dashboard import replicas_per_user_panels, users_dashboard
from vllm_output_rate.telemetry.metrics import METRICS

DASH = REPO / "dashboards"
RULE_FILES = sorted(DASH.rglob("*.rules.yaml"))
TEST_FILES = sorted(DASH.rglob("*.test.yaml"))
DASHBOARD_FILES = sorted(DASH.glob("*.json"))
#: the uids Grafana links and bookmarks point at: changing one breaks them
STABLE_UIDS = {"output-rate-users", "output-rate-engine"}
REQUIRED_VARIABLES = {"datasource", "model_name", "instance", "engine", "user"}

#: thresholds.yaml, as the generator reads it
CONFIG = Config.load()

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
        for var in ("model_name", "instance", "engine", "user"):
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
                assert 'instance=~"$instance"' in expr, where  # the fleet's replica variable
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
    for name, kind in VLLM_METRICS.items():
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
    for name in VLLM_METRICS:
        assert f'name="{name}"' in source, name


def test_recording_rules_cover_rate_spacing_and_throttled_kv():
    names = recorded_names()
    assert any(":vllm_output_rate_tokens_charged:rate" in n for n in names)
    assert any(":vllm_output_rate_inter_token_seconds:p99" in n for n in names)
    assert any(":vllm_output_rate_throttled_kv_cache_ratio:" in n for n in names)


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


FLEET_SELECTOR = 'job="vllm-fleet", namespace=~"llm-.*"'


def _custom_thresholds(affinity: bool = True) -> dict:
    """Another selector and group labels, and (unless ``affinity`` is False)
    the affinity alert on: every rule there is."""
    custom = copy.deepcopy(CONFIG.thresholds)
    custom["fleet"] = {"selector": FLEET_SELECTOR, "group_labels": ["cluster", "pod"]}
    custom["affinity"] = {**custom["affinity"], "enabled": affinity}
    return custom


def _with_affinity() -> dict:
    """thresholds.yaml with the affinity alert on (shipped off)."""
    custom = copy.deepcopy(CONFIG.thresholds)
    custom["affinity"] = {**custom["affinity"], "enabled": True}
    return custom


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
    c = Config(_custom_thresholds())
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
    c = Config(_custom_thresholds())
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
    known = _known_series()
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
    custom = _custom_thresholds()
    custom["limits_differ"] = {**custom["limits_differ"], "same_by": ["cluster"]}
    c = Config(custom)
    alert = {a.name: a for a in rule_gen.alerts(c)}["OutputRateLimitsDiffer"]
    assert alert.expr == ("count by (model_name, cluster) (count by (model_name, cluster, sha256) "
                          f"(vllm_output_rate_limits_info{{{FLEET_SELECTOR}}})) > 1")
    assert "{{ with $labels.cluster }} in cluster {{ . }}{{ end }}" in alert.summary
    assert "$labels.pod" not in alert.summary + alert.description


@pytest.mark.parametrize("same_by", [["pod", "cluster"], ["sha256"], ["user"], "cluster", ["a b"]])
def test_bad_limits_differ_settings_are_refused(same_by):
    bad = _custom_thresholds()  # group labels [cluster, pod]
    bad["limits_differ"] = {**bad["limits_differ"], "same_by": same_by}
    with pytest.raises(ValueError):
        Config(bad)


def test_engine_dashboard_has_the_limits_row():
    """The limits in force: distinct digests per model, the digest per engine,
    the reloads with failures apart, the age; each a metric of the table."""
    board = json.loads((DASH / "output-rate-engine.json").read_text())
    panels = all_panels(board)
    titles = [p["title"] for p in panels]
    row = titles.index("Limits")
    assert panels[row]["type"] == "row"
    limits = panels[row + 1:row + 5]
    by_title = {p["title"]: p for p in limits}
    assert set(by_title) == {"Distinct limits in force per model",
                             "Limits in force per engine (SHA-256, source, loaded ago)",
                             "Limits file reloads by result", "Age of the limits in force"}
    stat = by_title["Distinct limits in force per model"]
    assert stat["type"] == "stat"
    steps = stat["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["color"] for s in steps] == ["green", "red"] and steps[1]["value"] == 2
    table = by_title["Limits in force per engine (SHA-256, source, loaded ago)"]
    assert table["type"] == "table" and "sha256" in table["targets"][0]["expr"]
    assert "by (model_name, engine, sha256, source, instance)" in table["targets"][0]["expr"]
    reloads = by_title["Limits file reloads by result"]
    ok, failed = (t["expr"] for t in reloads["targets"])
    assert 'result=~"loaded|unchanged"' in ok and 'result=~"invalid|unreadable"' in failed
    assert [t["legendFormat"].startswith("FAILED") for t in reloads["targets"]] == [False, True]
    red = [o for o in reloads["fieldConfig"]["overrides"] if o["matcher"]["options"] == "^FAILED.*"]
    assert {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}} in red[0]["properties"]
    age = by_title["Age of the limits in force"]
    assert age["targets"][0]["expr"].startswith("time() - max by (engine, instance) "
                                                "(vllm_output_rate_limits_loaded_timestamp_seconds{")


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


def test_every_dashboard_variable_a_query_uses_exists():
    """render() makes an unnamed variable "All": a misspelt one would pass
    unnoticed, so every $variable in a query is one of the dashboard's."""
    for name, board in load_dashboards().items():
        variables = {v["name"] for v in board["templating"]["list"]}
        for panel in all_panels(board):
            for target in panel.get("targets", ()):
                used = set(re.findall(r"\$\{?(\w+)\}?", target["expr"])) - {"__rate_interval", "__interval", "__range"}
                assert used <= variables, (name, panel["title"], used - variables)


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
    c = Config(_custom_thresholds())
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
