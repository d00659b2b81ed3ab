"""The dashboards' panel model and its Grafana JSON.

A dashboard is a list of rows and panels (``Dashboard``, ``Row``,
``Panel``, ``Target``): the dashboard modules (``users_dashboard.py``,
``engine_dashboard.py``) build them from the config, ``dashboard_json``
lays them out on Grafana's 24-column grid and writes the JSON (the schema
of ``SCHEMA_VERSION``, a datasource variable, then model_name, one per
group label, engine and user variables, each filtered by those before it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_output_rate.dashboards.config import Config, m

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
#: the dashboard schema Grafana 12 writes (its migrations to 40 and 41 make
#: ``refresh`` a string and drop ``timepicker.time_options``: these
#: dashboards are written that way; older Grafana 11 loads them as they are)
SCHEMA_VERSION = 41
#: the tag every dashboard of the project carries: each links to the others by it
LINK_TAG = "output-rate"
#: the unit of a rate in tokens
TOKS = "suffix: tok/s"


@dataclass
class Target:
    expr: str
    legend: str = ""
    #: what the integration test demands of this query after the two-user load:
    #: "users" every load user has a series; "throttled" the throttled user has
    #: a positive value and unthrottled users none; "configured" the users
    #: configured with a limit have a series; "positive" some value > 0;
    #: "data" a non-empty result
    expect: str = "data"
    instant: bool = False
    format: str = "time_series"


@dataclass
class Panel:
    title: str
    description: str
    unit: str
    targets: list[Target]
    kind: str = "timeseries"
    w: int = 12
    h: int = 8
    repeat_user: bool = False
    #: extra fieldConfig overrides
    overrides: list[dict[str, Any]] = field(default_factory=list)
    log_scale: bool = False
    stack: bool = False
    #: name of the panel for scripts/prom_pictures.py ("" = not drawn there)
    key: str = ""
    #: stat panels: (colour, lowest value) steps of the background colour
    thresholds: list[tuple[str, float | None]] = field(default_factory=list)
    #: tables: the column (display name) sorted descending
    sort_by: str = "rate / limit"


@dataclass
class Row:
    title: str


@dataclass
class Dashboard:
    uid: str
    title: str
    description: str
    items: list[Panel | Row]
    tags: tuple[str, ...] = ("vllm", "output-rate")

    @property
    def panels(self) -> list[Panel]:
        return [p for p in self.items if isinstance(p, Panel)]


def dashed(regex: str, color: str = "red") -> dict[str, Any]:
    """Draw the series whose name matches ``regex`` as a dashed reference line."""
    return {
        "matcher": {"id": "byRegexp", "options": regex},
        "properties": [
            {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
            {"id": "custom.lineWidth", "value": 2},
            {"id": "custom.fillOpacity", "value": 0},
            {"id": "color", "value": {"mode": "fixed", "fixedColor": color}},
        ],
    }


def right_axis(regex: str, unit: str) -> dict[str, Any]:
    return {
        "matcher": {"id": "byRegexp", "options": regex},
        "properties": [
            {"id": "unit", "value": unit},
            {"id": "custom.axisPlacement", "value": "right"},
        ],
    }


def _variables(c: Config) -> list[dict[str, Any]]:
    default_limit = m("default_limit_tokens_per_second").full_name
    charged = m("tokens_charged").full_name

    def query_var(name: str, label: str, query: str, multi: bool) -> dict[str, Any]:
        return {
            "name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": {"query": query, "refId": f"{name}-variable"}, "definition": query,
            "refresh": 2, "sort": 1, "multi": multi, "includeAll": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "options": [], "hide": 0, "regex": "", "skipUrlSync": False,
        }

    # each variable is filtered by the selector and the variables before it
    filters = [c.selector()] if c.selector() else []
    out = [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "options": [], "refresh": 1, "regex": "", "skipUrlSync": False},
    ]
    for name, label, metric in (("model_name", "model", default_limit),
                                *((g, g, default_limit) for g in c.group_variables()),
                                ("engine", "engine", default_limit), ("user", "user", charged)):
        matchers = "{" + ", ".join(filters) + "}" if filters else ""
        out.append(query_var(name, label, f"label_values({metric}{matchers}, {name})", True))
        filters.append(f'{name}=~"${name}"')
    return out


def _target_json(t: Target, ref: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "refId": ref, "datasource": DATASOURCE, "expr": t.expr, "legendFormat": t.legend,
        "editorMode": "code", "range": not t.instant, "instant": t.instant,
    }
    if t.format != "time_series":
        out["format"] = t.format
    return out


def _panel_json(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    custom: dict[str, Any] = {}
    options: dict[str, Any]
    if p.kind == "timeseries":
        custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                  "spanNulls": False, "axisSoftMin": 0}
        if p.log_scale:
            custom["scaleDistribution"] = {"type": "log", "log": 10}
            del custom["axisSoftMin"]
        if p.stack:
            custom["stacking"] = {"mode": "normal", "group": "A"}
        options = {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                              "calcs": ["mean", "max", "lastNotNull"]},
                   "tooltip": {"mode": "multi", "sort": "desc"}}
    elif p.kind == "heatmap":
        options = {"calculate": False, "cellGap": 1, "yAxis": {"unit": p.unit, "axisPlacement": "left"},
                   "rowsFrame": {"layout": "auto"},
                   "color": {"mode": "scheme", "scheme": "Spectral", "scale": "exponential",
                             "exponent": 0.5, "steps": 64, "reverse": False},
                   "filterValues": {"le": 1e-9}, "tooltip": {"mode": "single", "yHistogram": True},
                   "legend": {"show": True}, "cellValues": {"unit": "suffix: /s"}}
    elif p.kind == "stat":
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "colorMode": "background", "graphMode": "area", "justifyMode": "auto",
                   "orientation": "auto", "textMode": "value_and_name", "wideLayout": True,
                   "showPercentChange": False}
    else:  # table
        options = {"showHeader": True, "cellHeight": "sm", "footer": {"show": False},
                   "sortBy": [{"displayName": p.sort_by, "desc": True}]}
    panel: dict[str, Any] = {
        "id": pid, "type": p.kind, "title": p.title, "description": p.description,
        "datasource": DATASOURCE, "gridPos": {"h": p.h, "w": p.w, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": p.unit, "custom": custom}, "overrides": p.overrides},
        "options": options,
        "targets": [_target_json(t, chr(ord("A") + i)) for i, t in enumerate(p.targets)],
    }
    if p.thresholds:
        panel["fieldConfig"]["defaults"]["color"] = {"mode": "thresholds"}
        panel["fieldConfig"]["defaults"]["thresholds"] = {
            "mode": "absolute", "steps": [{"color": c, "value": v} for c, v in p.thresholds]}
    if p.kind == "table":
        panel["transformations"] = [
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {"excludeByName": {"Time": True}}},
        ]
    if p.repeat_user:
        panel.update({"repeat": "user", "repeatDirection": "h", "maxPerRow": 2})
    return panel


def links(d: Dashboard) -> list[dict[str, Any]]:
    """A dropdown of the project's other dashboards (by their common tag, as
    the monitoring mixins link theirs), keeping the time range and the
    variables (model, replica, engine, user) they share."""
    assert LINK_TAG in d.tags, d.tags
    return [{"title": "Output rate dashboards", "type": "dashboards", "tags": [LINK_TAG],
             "asDropdown": True, "includeVars": True, "keepTime": True,
             "icon": "external link", "targetBlank": False, "tooltip": "", "url": ""}]


def dashboard_json(c: Config, d: Dashboard) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    x = y = row_h = 0
    pid = 0
    for item in d.items:
        pid += 1
        if isinstance(item, Row):
            if x:
                y, x = y + row_h, 0
            panels.append({"id": pid, "type": "row", "title": item.title, "collapsed": False,
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
            y += 1
            row_h = 0
            continue
        if x + item.w > 24:
            y, x, row_h = y + row_h, 0, 0
        panels.append(_panel_json(item, pid, x, y))
        x += item.w
        row_h = max(row_h, item.h)
    return {
        "uid": d.uid, "title": d.title, "description": d.description, "tags": list(d.tags),
        "editable": True, "graphTooltip": 1, "schemaVersion": SCHEMA_VERSION, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "",
        "fiscalYearStartMonth": 0, "liveNow": False, "weekStart": "",
        "timepicker": {}, "links": links(d),
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": _variables(c)},
        "panels": panels,
    }
