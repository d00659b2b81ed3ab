"""Small PromQL helpers shared by the generator, the tests and the scripts.

- ``render``: a panel expression with Grafana's variables filled in, ready
  for Prometheus' HTTP API (what Grafana would send).
- ``metric_names``: the metric names an expression reads, so tests can check
  every one against the metric table, vLLM's known metrics and the recording
  rules.
"""

from __future__ import annotations

import re

#: Words of PromQL that look like names but are not metrics.
KEYWORDS = frozenset({
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "and", "or", "unless", "offset", "inf", "nan", "atan2", "start", "end",
})

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^}]*\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_VARIABLE = re.compile(r"\$\{?\w+\}?")
_NAME = re.compile(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?")


def metric_names(expr: str) -> set[str]:
    """Every metric (or recorded series) name ``expr`` selects."""
    s = _STRING.sub('""', expr)
    s = _MATCHERS.sub("", s)
    s = _GROUPING.sub("", s)
    s = _RANGE.sub("", s)
    s = _VARIABLE.sub("", s)
    names = set()
    for match in _NAME.finditer(s):
        word, call = match.group(1), match.group(2)
        if call or word.lower() in KEYWORDS:
            continue  # a function, an aggregation or a keyword
        names.add(word)
    return names


#: a regex matcher whose whole value is one variable: ``instance=~"$instance"``
_ALL_MATCHER = re.compile(r'=~"\$\{?\w+\}?"')


def render(expr: str, variables: dict[str, str] | None = None, *,
           rate_interval: str = "15s", interval: str = "5s", range_: str = "5m") -> str:
    """``expr`` with ``$var`` / ``${var}`` and Grafana's ``$__*`` intervals
    replaced (values are regexes: panels match with ``=~``). A variable not in
    ``variables`` that is a matcher's whole value is "All" (``.*``, the
    dashboards' allValue), as Grafana sends it: callers name only the
    variables they filter by (e.g. not the fleet's ``instance``)."""
    out = (expr.replace("$__rate_interval", rate_interval)
           .replace("${__rate_interval}", rate_interval)
           .replace("$__interval", interval)
           .replace("$__range", range_))
    for name, value in (variables or {}).items():
        out = out.replace("${" + name + "}", value)
        out = re.sub(r"\$" + re.escape(name) + r"\b", lambda _m, v=value: v, out)
    return _ALL_MATCHER.sub('=~".*"', out)
