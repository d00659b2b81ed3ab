"""What the dashboard modules (``test_dashboards_*.py``) share: the committed
dashboards and rule files, the thresholds as the generator reads them, the
real ``promtool`` if installed, every series a panel or rule may read and
every expression that reads one, and thresholds for another fleet."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import yaml

from vllm_output_rate.dashboards.config import VLLM_METRICS, Config
from vllm_output_rate.telemetry.metrics import METRICS

REPO = Path(__file__).resolve().parents[1]


DASH = REPO / "dashboards"
RULE_FILES = sorted(DASH.rglob("*.rules.yaml"))
TEST_FILES = sorted(DASH.rglob("*.test.yaml"))
DASHBOARD_FILES = sorted(DASH.glob("*.json"))


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


KNOWN_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def known_series() -> dict[str, str]:
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


def all_expressions() -> list[tuple[str, str]]:
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


FLEET_SELECTOR = 'job="vllm-fleet", namespace=~"llm-.*"'


def custom_thresholds(affinity: bool = True) -> dict:
    """Another selector and group labels, and (unless ``affinity`` is False)
    the affinity alert on: every rule there is."""
    custom = copy.deepcopy(CONFIG.thresholds)
    custom["fleet"] = {"selector": FLEET_SELECTOR, "group_labels": ["cluster", "pod"]}
    custom["affinity"] = {**custom["affinity"], "enabled": affinity}
    return custom
