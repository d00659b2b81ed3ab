"""The dashboards and rules in the conventions of kube-prometheus-stack and
the monitoring mixins: ``critical|warning|info`` severities (the earlier
``page|ticket`` as ``severity_scheme: page_ticket``), runbook links into the
runbook that ships, recording rules named ``level:metric:operations`` with
the earlier names recorded for one release, the dashboards linked both
ways, a current ``schemaVersion``. No engine: the generator, its files and
the real ``promtool``.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from harness import REPO
from vllm_output_rate.dashboards import generate
from vllm_output_rate.dashboards import rules as rule_gen
from vllm_output_rate.dashboards.config import Config
from vllm_output_rate.dashboards.panels import SCHEMA_VERSION
from vllm_output_rate.dashboards.promql import metric_names

DASH = REPO / "dashboards"
CONFIG = Config.load()
promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(promtool is None, reason="promtool not installed (make tools)")

#: each alert's severity, typed out: what an Alertmanager route of
#: kube-prometheus-stack sees
SEVERITIES = {
    "OutputRateUserOverLimit": "critical",
    "OutputRateUserThrottledContinuously": "info",
    "OutputRateThrottledKVCacheHigh": "warning",
    "OutputRateEngineWakesLate": "warning",
    "OutputRateTelemetryStale": "warning",
    "OutputRateTelemetryDropping": "warning",
    "OutputRateLimitsReloadFailed": "warning",
    "OutputRateLimitsDiffer": "warning",
    "OutputRateSharedStoreUnreachable": "warning",
    "OutputRateUserPromptsDominateSteps": "warning",
}
#: the recorded names of the release before -> their new names
RENAMED = {
    "model_user:vllm_output_rate_tokens_charged_total:rate1m":
        "model_user:vllm_output_rate_tokens_charged:rate1m",
    "model_user:vllm_output_rate_tokens_charged_total:rate5m":
        "model_user:vllm_output_rate_tokens_charged:rate5m",
    "model_user:output_rate_limit_ratio:rate5m":
        "model_user:vllm_output_rate_tokens_charged_per_limit:ratio_rate5m",
}


def groups(text: str) -> dict[str, list[dict]]:
    return {g["name"]: g["rules"] for g in yaml.safe_load(text)["groups"]}


def shipped(rel: str) -> str:
    return (DASH / rel).read_text()


def alert_labels(test_file: dict) -> list[tuple[str, str]]:
    """(alert, severity) of every firing expectation of a promtool file."""
    return [(art["alertname"], alert["exp_labels"]["severity"])
            for case in test_file["tests"] for art in case.get("alert_rule_test", ())
            for alert in art["exp_alerts"]]


def promtool_run(tmp_path: Path, out: dict[str, str], mutate=None) -> subprocess.CompletedProcess:
    """``promtool test rules`` on a generator run's files (``mutate``: a change
    to the rule files' data before writing them)."""
    for rel in ("prometheus/recording.rules.yaml", "prometheus/alerts.rules.yaml",
                "prometheus/alerts.test.yaml"):
        text = out[rel]
        if mutate:
            text = yaml.safe_dump(mutate(Path(rel).name, yaml.safe_load(text)), sort_keys=False)
        (tmp_path / Path(rel).name).write_text(text)
    return subprocess.run([promtool, "test", "rules", "alerts.test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, check=False)


# -- severities ---------------------------------------------------------------------

def test_alerts_carry_the_standard_severities():
    alerts = {r["alert"]: r for r in groups(shipped("prometheus/alerts.rules.yaml"))["output-rate.alerts"]}
    assert {name: r["labels"]["severity"] for name, r in alerts.items()} == SEVERITIES
    # the PrometheusRule and the Grafana copies carry the same labels
    (rule,) = yaml.safe_load_all(shipped("kubernetes/prometheusrule.yaml"))
    in_k8s = {r["alert"]: r["labels"]["severity"] for g in rule["spec"]["groups"]
              for r in g["rules"] if "alert" in r}
    assert in_k8s == SEVERITIES
    grafana = {r["title"]: r["labels"]["severity"]
               for g in yaml.safe_load(shipped("provisioning/alerting.yaml"))["groups"] for r in g["rules"]}
    assert grafana == SEVERITIES
    # and the promtool cases expect them where each alert fires
    fired = alert_labels(yaml.safe_load(shipped("prometheus/alerts.test.yaml")))
    assert {name for name, _ in fired} == set(SEVERITIES)
    assert all(severity == SEVERITIES[name] for name, severity in fired)


def _page_ticket() -> dict:
    custom = copy.deepcopy(CONFIG.thresholds)
    custom["severity_scheme"] = "page_ticket"
    custom["affinity"]["enabled"] = True
    return custom


def test_the_page_ticket_scheme_writes_the_earlier_labels_everywhere():
    out = generate.outputs(Config(_page_ticket()))
    old = {"critical": "page", "warning": "ticket", "info": "ticket"}
    expected = {**{name: old[s] for name, s in SEVERITIES.items()},
                "OutputRateUserOnSeveralReplicas": "ticket"}
    alerts = groups(out["prometheus/alerts.rules.yaml"])["output-rate.alerts"]
    assert {r["alert"]: r["labels"]["severity"] for r in alerts} == expected
    fired = alert_labels(yaml.safe_load(out["prometheus/alerts.test.yaml"]))
    assert {name for name, _ in fired} == set(expected)
    assert all(severity == expected[name] for name, severity in fired)
    for rel in ("provisioning/alerting.yaml", "kubernetes/prometheusrule.yaml"):
        assert "severity: critical" not in out[rel] and "severity: page" in out[rel], rel


@needs_promtool
@pytest.mark.parametrize("scheme", ["standard", "page_ticket"])
def test_promtool_cases_pass_under_each_scheme_and_fail_under_the_other(tmp_path, scheme):
    """Each scheme's cases pass against its own rules (every alert firing
    and quiet, the affinity alert on), and fail against the other's labels."""
    custom = _page_ticket()
    custom["severity_scheme"] = scheme
    out = generate.outputs(Config(custom))
    proc = promtool_run(tmp_path, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    other = {"standard": "page_ticket", "page_ticket": "standard"}[scheme]
    custom["severity_scheme"] = other
    rules_of_other = generate.outputs(Config(custom))
    mixed = {**out, "prometheus/alerts.rules.yaml": rules_of_other["prometheus/alerts.rules.yaml"]}
    proc = promtool_run(tmp_path, mixed)
    assert proc.returncode != 0


@pytest.mark.parametrize(("change", "message"), [
    ({"severity_scheme": "pager"}, "severity_scheme"),
    ({"severity_scheme": None}, "severity_scheme"),
    ({"over_limit": "page"}, "over_limit.severity"),
    ({"throttled_kv": "ticket"}, "throttled_kv.severity"),
    ({"telemetry_stale": "error"}, "telemetry_stale.severity"),
])
def test_bad_severities_are_refused_naming_the_setting(change, message):
    bad = copy.deepcopy(CONFIG.thresholds)
    for key, value in change.items():
        if key == "severity_scheme":
            bad[key] = value
        else:
            bad[key]["severity"] = value
    with pytest.raises(ValueError, match=message.replace(".", r"\.")) as err:
        Config(bad)
    if change.get("over_limit") == "page":
        assert "'critical'" in str(err.value) and "page_ticket" in str(err.value)


def test_a_bad_thresholds_file_is_named(tmp_path):
    path = tmp_path / "thresholds.yaml"
    path.write_text(shipped("thresholds.yaml").replace("severity_scheme: standard", "severity_scheme: loud"))
    with pytest.raises(ValueError, match=f"{path}: severity_scheme: .*'loud'"):
        Config.load(path)


# -- runbook links ------------------------------------------------------------------------

def test_no_placeholder_host_in_any_shipped_file():
    for path in DASH.rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            assert "example.com" not in path.read_text(errors="replace"), path


def test_runbook_links_point_into_the_runbook_that_ships():
    """The default base is the shipped runbook's own path (in the repository
    and the installed package); every anchor is one of its headings."""
    base = CONFIG["runbook_base_url"]
    assert base == "dashboards/runbook.md" and (REPO / base).is_file()
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "*.md" in setuptools["package-data"]["vllm_output_rate.dashboards"]
    headings = {line[3:].strip().lower() for line in (REPO / base).read_text().splitlines()
                if line.startswith("## ")}
    for rule in groups(shipped("prometheus/alerts.rules.yaml"))["output-rate.alerts"]:
        url, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert url == base and anchor in headings, rule["alert"]


@pytest.mark.parametrize("base", ["", "   ", None, "https://docs.internal/runbook.md#top",
                                  "runbook .md"])
def test_bad_runbook_bases_are_refused(base):
    bad = copy.deepcopy(CONFIG.thresholds)
    bad["runbook_base_url"] = base
    with pytest.raises(ValueError, match="runbook_base_url"):
        Config(bad)
    del bad["runbook_base_url"]
    with pytest.raises(ValueError, match="runbook_base_url: a required setting"):
        Config(bad)


# -- recording rule names ---------------------------------------------------------------------

def test_recorded_names_are_level_metric_operations():
    """Three parts; the metric part keeps the project's prefix and has no
    ``_total`` (``rate()`` made it a rate)."""
    recorded = groups(shipped("prometheus/recording.rules.yaml"))["output-rate.recording"]
    assert len(recorded) >= 9
    for rule in recorded:
        level, metric, operations = rule["record"].split(":")
        assert level in {"model_user", "engine_user"}, rule["record"]
        assert metric.startswith("vllm_output_rate_") and not metric.endswith("_total"), rule["record"]
        assert operations, rule["record"]
    assert set(RENAMED.values()) <= {r["record"] for r in recorded}


def test_the_earlier_names_are_recorded_from_the_new_ones_for_one_release():
    by_group = groups(shipped("prometheus/recording.rules.yaml"))
    aliases = by_group.pop(rule_gen.RENAMED_GROUP)
    assert {r["record"]: r["expr"] for r in aliases} == RENAMED
    (rule,) = yaml.safe_load_all(shipped("kubernetes/prometheusrule.yaml"))
    assert rule_gen.RENAMED_GROUP in [g["name"] for g in rule["spec"]["groups"]]
    # nothing the project ships reads an earlier name: only the aliases carry them
    for rel in ("output-rate-users.json", "output-rate-engine.json", "prometheus/alerts.rules.yaml"):
        assert not any(old in shipped(rel) for old in RENAMED), rel
    reads = set()
    for rule in (r for g in by_group.values() for r in g):
        reads |= metric_names(rule["expr"])
    assert not reads & set(RENAMED)
    # the promtool file checks every name, earlier and new
    exprs = {t["expr"].split("{")[0] for case in yaml.safe_load(shipped("prometheus/alerts.test.yaml"))["tests"]
             for t in case.get("promql_expr_test", ())}
    assert set(RENAMED) | set(RENAMED.values()) <= exprs


@needs_promtool
def test_the_recorded_names_cases_can_fail(tmp_path):
    """Without the aliases' group (or with an alias recording another name),
    the promtool cases of the earlier names fail."""
    out = generate.outputs(CONFIG)

    def drop_aliases(name: str, data: dict) -> dict:
        if name == "recording.rules.yaml":
            data["groups"] = [g for g in data["groups"] if g["name"] != rule_gen.RENAMED_GROUP]
        return data

    def swap_rates(name: str, data: dict) -> dict:
        if name == "recording.rules.yaml":
            for g in data["groups"]:
                for r in g["rules"]:
                    if r["record"] == "model_user:vllm_output_rate_tokens_charged_total:rate1m":
                        r["expr"] = "model_user:vllm_output_rate_tokens_charged_per_limit:ratio_rate5m"
        return data

    assert promtool_run(tmp_path, out).returncode == 0
    for mutate in (drop_aliases, swap_rates):
        proc = promtool_run(tmp_path, out, mutate)
        assert proc.returncode != 0, mutate.__name__
        assert any(old in proc.stdout + proc.stderr for old in RENAMED), mutate.__name__


# -- dashboards: links and schema -----------------------------------------------------------------

def test_each_dashboard_links_to_the_others():
    boards = {name: json.loads(shipped(name)) for name in generate.DASHBOARDS}
    assert len(boards) == 2
    for name, board in boards.items():
        (link,) = board["links"]
        assert link["type"] == "dashboards" and link["includeVars"] and link["keepTime"], name
        others = [b for n, b in boards.items() if n != name]
        # a dashboards link lists every dashboard carrying one of its tags
        for other in others:
            assert set(link["tags"]) <= set(other["tags"]), (name, other["uid"])


def test_dashboards_use_a_current_schema_version():
    """Grafana 12's schema (41): its migrations past 39 make ``refresh`` a
    string and drop ``timepicker.time_options``; the dashboards are already
    so, and the ConfigMap holds the same JSON."""
    assert SCHEMA_VERSION >= 41
    for name in generate.DASHBOARDS:
        board = json.loads(shipped(name))
        assert board["schemaVersion"] == SCHEMA_VERSION, name
        assert isinstance(board["refresh"], str), name
        assert "time_options" not in board["timepicker"], name
