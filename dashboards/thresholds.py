"""The one threshold file (``thresholds.yaml``): reading it, the checks every
setting passes, and Prometheus durations. ``config.Config`` holds what this
reads and is what the generator passes along; the Grafana copies of the
alerts use ``seconds``. Imports nothing else of the dashboards.

The limiter's burst is not a threshold: it comes from the limiter itself
(``burst_seconds`` here is ``vllm_output_rate.limiter.BURST_NS``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from vllm_output_rate.config import ANONYMOUS_USER, UNLISTED_USER
from vllm_output_rate.limiter import BURST_NS
from vllm_output_rate.telemetry.labels import OTHER
from vllm_output_rate.yaml_load import safe_load

HERE = Path(__file__).resolve().parent


#: labels the rules and dashboards use themselves: not group labels
RESERVED_LABELS = frozenset({"model_name", "user", "le", "reason", "datasource"})
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def check_fleet(fleet: dict[str, Any]) -> None:
    """The ``fleet`` settings make valid PromQL (raises ValueError)."""
    selector = fleet["selector"]
    if not isinstance(selector, str) or any(c in selector for c in "{}"):
        raise ValueError(f"fleet.selector: label matchers without braces, not {selector!r}")
    labels = fleet["group_labels"]
    if not isinstance(labels, list) or len(set(labels)) != len(labels):
        raise ValueError(f"fleet.group_labels: a list of distinct label names, not {labels!r}")
    for label in labels:
        if not isinstance(label, str) or not _LABEL.fullmatch(label) or label.startswith("__") \
                or label in RESERVED_LABELS:
            raise ValueError(f"fleet.group_labels: {label!r} cannot group replicas")


#: labels of the limits metrics themselves: a fleet is not split by them
_LIMITS_LABELS = frozenset({"sha256", "source", "result", "engine"})


def check_limits_differ(settings: dict[str, Any], fleet: dict[str, Any]) -> None:
    """``limits_differ.same_by`` splits a model's replicas into fleets, and
    still compares replicas (raises ValueError)."""
    same_by = settings["same_by"]
    if not isinstance(same_by, list) or len(set(same_by)) != len(same_by):
        raise ValueError(f"limits_differ.same_by: a list of distinct label names, not {same_by!r}")
    for label in same_by:
        if not isinstance(label, str) or not _LABEL.fullmatch(label) or label.startswith("__") \
                or label in RESERVED_LABELS or label in _LIMITS_LABELS:
            raise ValueError(f"limits_differ.same_by: {label!r} cannot split a fleet")
    groups = fleet["group_labels"]
    if groups and set(groups) <= set(same_by):
        raise ValueError(f"limits_differ.same_by: {same_by!r} holds every group label {groups!r}: "
                         "each replica would only be compared with itself")


#: users every replica legitimately charges: the label-cap overflow, requests
#: without a user, and the shared budget of unlisted users
SHARED_USERS = (OTHER, ANONYMOUS_USER, UNLISTED_USER)

#: an alert's severity, as kube-prometheus-stack and the monitoring mixins spell it
SEVERITIES = ("critical", "warning", "info")
#: ``severity_scheme`` -> the label each severity is written as
SEVERITY_SCHEMES: dict[str, dict[str, str]] = {
    "standard": {s: s for s in SEVERITIES},
    "page_ticket": {"critical": "page", "warning": "ticket", "info": "ticket"},
}
_OLD_SEVERITIES = {"page": "critical", "ticket": "warning"}


def check_severities(data: dict[str, Any]) -> None:
    """``severity_scheme`` is a scheme and every section's ``severity`` one
    of ``SEVERITIES`` (raises ValueError naming the setting and the value)."""
    scheme = data.get("severity_scheme")
    if scheme not in SEVERITY_SCHEMES:
        raise ValueError(f"severity_scheme: one of {sorted(SEVERITY_SCHEMES)}, not {scheme!r}")
    for section, settings in data.items():
        if not isinstance(settings, dict) or "severity" not in settings:
            continue
        value = settings["severity"]
        if value in _OLD_SEVERITIES:
            raise ValueError(
                f"{section}.severity: {value!r} is a label of the page_ticket scheme, not a "
                f"severity: write {_OLD_SEVERITIES[value]!r} (severity_scheme: page_ticket still "
                f"writes it as {value!r})")
        if value not in SEVERITIES:
            raise ValueError(f"{section}.severity: one of {list(SEVERITIES)}, not {value!r}")


def check_runbook(base: Any) -> None:
    """``runbook_base_url``: where the shipped runbook is read (raises ValueError)."""
    if not isinstance(base, str) or not base.strip() or "#" in base or any(c.isspace() for c in base):
        raise ValueError("runbook_base_url: the address (or path) of dashboards/runbook.md, "
                         f"without spaces or '#' (each alert appends #<its anchor>), not {base!r}")


def check_affinity(settings: dict[str, Any], fleet: dict[str, Any]) -> None:
    """``affinity``: the user-on-several-replicas alert can tell replicas
    apart, does not fire for a user moved once, and never for the shared
    users (raises ValueError)."""
    if settings["enabled"] is not True and settings["enabled"] is not False:
        raise ValueError(f"affinity.enabled: true or false, not {settings['enabled']!r}")
    window, for_ = seconds(settings["window"]), seconds(settings["for"])
    if for_ <= window:
        raise ValueError(f"affinity.for ({settings['for']}) must be longer than affinity.window "
                         f"({settings['window']}): a user moved once to another replica (a replica "
                         "restarted, added or removed) is on both for about one window")
    exclude = settings["exclude_users"]
    try:
        pattern = re.compile(exclude) if isinstance(exclude, str) else None
    except re.error as exc:
        raise ValueError(f"affinity.exclude_users: not a regex: {exc}") from None
    if pattern is None or not all(pattern.fullmatch(user) for user in SHARED_USERS):
        raise ValueError(f"affinity.exclude_users: a regex matching at least {'|'.join(SHARED_USERS)} "
                         f"(they are charged on every replica), not {exclude!r}")
    if settings["enabled"] and not fleet["group_labels"]:
        raise ValueError("affinity.enabled needs fleet.group_labels: the alert counts the replicas "
                         "(distinct values of the group labels) that charged a user")


#: a Kubernetes port name (IANA service name): what a ServiceMonitor can name
_PORT_NAME = re.compile(r"(?=.*[a-z])[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?")


def check_kubernetes(k8s: dict[str, Any]) -> None:
    """The ``kubernetes`` settings make valid manifests (raises ValueError)."""
    if not _PORT_NAME.fullmatch(str(k8s["port_name"])) or "--" in str(k8s["port_name"]):
        raise ValueError(f"kubernetes.port_name: a port name (IANA service name), not {k8s['port_name']!r}")
    for key in ("selector_labels", "prometheus_labels"):
        labels = k8s[key]
        if not isinstance(labels, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise ValueError(f"kubernetes.{key}: a mapping of label names to strings, not {labels!r}")
    if not k8s["selector_labels"]:
        raise ValueError("kubernetes.selector_labels: at least one label (the ServiceMonitor selects by them)")
    seconds(k8s["scrape_interval"])


def check_thresholds(data: dict[str, Any]) -> None:
    """Every checked section of a threshold dict (raises ValueError)."""
    for key in ("runbook_base_url", "severity_scheme"):
        if key not in data:
            raise ValueError(f"{key}: a required setting of the thresholds, missing")
    check_runbook(data["runbook_base_url"])
    check_severities(data)
    check_fleet(data["fleet"])
    check_kubernetes(data["kubernetes"])
    check_limits_differ(data["limits_differ"], data["fleet"])
    check_affinity(data["affinity"], data["fleet"])


def load_thresholds(path: Path = HERE / "thresholds.yaml") -> dict[str, Any]:
    """``path`` read and checked, with the limiter's burst added."""
    data = safe_load(Path(path).read_text(), str(path))  # a key given twice is refused
    try:
        check_thresholds(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    data["over_limit"]["burst_seconds"] = BURST_NS / 1e9
    return data


def seconds(duration: str) -> float:
    """'5m' -> 300.0 (Prometheus durations of one unit)."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    for suffix in ("ms", "s", "m", "h", "d"):
        if duration.endswith(suffix) and duration[: -len(suffix)].replace(".", "").isdigit():
            return float(duration[: -len(suffix)]) * units[suffix]
    raise ValueError(f"not a duration: {duration!r}")

