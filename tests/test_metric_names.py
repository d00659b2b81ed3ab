"""Metric names come only from the metric table: no module of the telemetry
or the tracing other than ``telemetry/metrics.py`` holds a string literal
equal to a metric's name (its short name, as scraped, or one of a
histogram's series), read from the source. Code refers to a metric by the
table's constants (``metrics.TOKENS_CHARGED``) and the keys they make."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from harness import REPO
from vllm_output_rate.telemetry.metrics import HISTOGRAM_SERIES, METRICS

FOLDERS = ("telemetry", "tracing")
TABLE = REPO / "telemetry" / "metrics.py"
#: every name a metric goes by
NAMES = frozenset(
    {m.name for m in METRICS} | {m.full_name for m in METRICS}
    | {f"{m.full_name}_{part}" for m in METRICS if m.kind == "histogram"
       for part in HISTOGRAM_SERIES})
#: module -> tuples (by the name they are assigned to) of the fields of the
#: user state (``GET /output-rate/users/NAME``) that share a metric's name
STATE_FIELDS = {"telemetry/introspect.py": {"_COUNTS"}}

MODULES = sorted(p for folder in FOLDERS for p in (REPO / folder).rglob("*.py") if p != TABLE)


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def metric_literals(source: str, fields: set[str] = frozenset()) -> list[tuple[int, str]]:
    """(line, name) of each string literal equal to a metric's name, but
    for a dict display's keys (fields of a JSON document, such as the user
    state's; a series is keyed by a (name, labels) tuple) and the elements
    of the tuples assigned to a name in ``fields``."""
    tree = ast.parse(source)
    exempt: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            exempt.update(id(k) for k in node.keys if k is not None)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id in fields for t in node.targets):
            exempt.update(id(n) for n in ast.walk(node.value))
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and node.value in NAMES and id(node) not in exempt)


@pytest.mark.parametrize("path", MODULES, ids=rel)
def test_no_metric_name_outside_the_table(path):
    found = metric_literals(path.read_text(), STATE_FIELDS.get(rel(path), set()))
    assert not found, (f"{rel(path)} spells metric names: "
                       + ", ".join(f"line {line}: {name!r}" for line, name in found)
                       + " (use the constants of telemetry/metrics.py)")


def test_the_check_sees_a_spelled_name():
    """The check can fail: a series key, a scraped name and a histogram's
    series spelled out are found; a JSON field named as a metric and the
    listed tuples of user-state fields are not."""
    source = (
        "counters[('engine_tokens_charged', ())] += 1\n"
        "NAME = 'vllm_output_rate_tokens_charged_total'\n"
        "BUCKET = 'vllm_output_rate_inter_token_seconds_bucket'\n"
        "gauges = {('throttled_kv_blocks', ('a',)): 1}\n"
        "state = {'throttled_kv_blocks': 3}\n"
        "_COUNTS = ('running', 'throttled_kv_blocks')\n")
    assert metric_literals(source, {"_COUNTS"}) == [
        (1, "engine_tokens_charged"), (2, "vllm_output_rate_tokens_charged_total"),
        (3, "vllm_output_rate_inter_token_seconds_bucket"), (4, "throttled_kv_blocks")]
    assert metric_literals(source)[-1] == (6, "throttled_kv_blocks")
    assert len(MODULES) > 20 and REPO / "telemetry" / "folds.py" in MODULES
    assert all(REPO / m in MODULES for m in STATE_FIELDS)


def test_each_metric_has_its_constant():
    """Every metric of the table has its constant, named as it is (so a
    constant cannot point at another metric)."""
    from vllm_output_rate.telemetry import metrics

    constants = {name: value for name, value in vars(metrics).items()
                 if isinstance(value, metrics.Metric)}
    assert {m.name.upper() for m in METRICS} == set(constants)
    assert all(value.name.upper() == name for name, value in constants.items())
    assert metrics.TOKENS_REFUNDED.key("a", "preempted") == ("tokens_refunded", ("a", "preempted"))
