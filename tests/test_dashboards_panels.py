"""The dashboards' panels: valid boards with stable uids and the variables a
fleet needs, every panel with a datasource, unit, title and description,
every metric a panel or rule reads known (and every exported metric on a
panel), the limits row, the variables the queries use.

No engine here: the committed files; test_dashboards_e2e.py runs every
panel query against a real Prometheus scraping a real engine.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

from dashboard_files import DASH, all_expressions, all_panels, known_series, load_dashboards, recorded_names
from vllm_output_rate.dashboards.config import VLLM_METRICS
from vllm_output_rate.dashboards.promql import metric_names, render
from vllm_output_rate.telemetry.metrics import METRICS


#: the uids Grafana links and bookmarks point at: changing one breaks them
STABLE_UIDS = {"output-rate-users", "output-rate-engine"}
REQUIRED_VARIABLES = {"datasource", "model_name", "instance", "engine", "user"}


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


def test_every_referenced_metric_is_known():
    known = known_series()
    unknown = []
    for where, expr in all_expressions():
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
    known = known_series()
    for where, expr in all_expressions():
        if where.split(":")[0].endswith(".json"):
            shown |= {known[n] for n in metric_names(expr) if n in known}
    unshown = [m.full_name for m in METRICS if m.name not in shown]
    print("\nexported metrics no panel shows:", unshown or "none")
    if unshown:
        warnings.warn(f"exported metrics no dashboard panel shows: {unshown}")
    # the report itself must see the panels
    assert "tokens_charged" in shown and "inter_token_seconds" in shown


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


def test_every_dashboard_variable_a_query_uses_exists():
    """render() makes an unnamed variable "All": a misspelt one would pass
    unnoticed, so every $variable in a query is one of the dashboard's."""
    for name, board in load_dashboards().items():
        variables = {v["name"] for v in board["templating"]["list"]}
        for panel in all_panels(board):
            for target in panel.get("targets", ()):
                used = set(re.findall(r"\$\{?(\w+)\}?", target["expr"])) - {"__rate_interval", "__interval", "__range"}
                assert used <= variables, (name, panel["title"], used - variables)
