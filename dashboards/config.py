"""The one config object every part of the generator is given: the
thresholds (``thresholds.yaml``), the fleet's selector and group labels,
and the selectors of the metric table built from them.

In the manner of the monitoring mixins' ``_config``: nothing here is a
module-level setting; ``Config.load()`` reads ``thresholds.yaml`` and
``Config(thresholds)`` takes any other threshold dict (the tests' variants),
checked either way. Each dashboard, alert group, the recording rules and
the manifests are functions of one ``Config``.

``thresholds.yaml`` ``fleet``: every raw-metric selector of a rule or panel
carries ``selector``; every aggregation of an alert or recording rule keeps
``group_labels`` (one replica is never summed with, nor hidden behind,
another); the dashboards get one variable per group label.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_output_rate.dashboards.thresholds import (
    HERE,
    SEVERITY_SCHEMES,
    check_thresholds,
    load_thresholds,
)
from vllm_output_rate.telemetry.metrics import BY_NAME, Metric

#: vLLM's own metrics the dashboards show for context: base name -> kind.
#: Checked against a real scrape in the integration test.
VLLM_METRICS: dict[str, str] = {
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    #: a histogram of tokens per engine step; its _count is vLLM's step count
    "vllm:iteration_tokens_total": "histogram",
}


def m(name: str) -> Metric:
    """A metric of the table by its short name."""
    return BY_NAME[name]


def quantile(q: float, bucket_selector: str, by: str, window: str = "$__rate_interval") -> str:
    grouping = f"{by}, le" if by else "le"
    return f"histogram_quantile({q}, sum by ({grouping}) (rate({bucket_selector}[{window}])))"


@dataclass(frozen=True)
class Config:
    """The threshold dict (as ``thresholds.yaml`` spells it, checked) and
    what the rules and panels derive from it."""

    thresholds: dict[str, Any]

    def __post_init__(self) -> None:
        check_thresholds(self.thresholds)

    @classmethod
    def load(cls, path: Path = HERE / "thresholds.yaml") -> Config:
        return cls(load_thresholds(path))

    def __getitem__(self, section: str) -> Any:
        return self.thresholds[section]

    # -- sections used everywhere ------------------------------------------------

    @property
    def over(self) -> dict[str, Any]:
        return self.thresholds["over_limit"]

    @property
    def long(self) -> dict[str, Any]:
        return self.thresholds["throttled_long"]

    @property
    def short(self) -> str:
        """Window of the "at a glance" recording rules."""
        return self.thresholds["short_window"]

    @property
    def interval(self) -> str:
        """Evaluation interval of both rule groups."""
        return self.thresholds["evaluation_interval"]

    def severity(self, section: str) -> str:
        """The severity label of the alert of ``section`` (its ``severity``,
        critical / warning / info, written in ``severity_scheme``)."""
        return self.label(self.thresholds[section]["severity"])

    def label(self, severity: str) -> str:
        """``severity`` (critical / warning / info) as ``severity_scheme`` writes it."""
        return SEVERITY_SCHEMES[self.thresholds["severity_scheme"]][severity]

    def runbook_url(self, alert: str) -> str:
        return f"{self.thresholds['runbook_base_url']}#{alert.lower()}"

    # -- fleets: the selector and the group labels --------------------------------

    def selector(self) -> str:
        """The fleet selector's matchers ('' = none)."""
        return self.thresholds["fleet"]["selector"].strip().rstrip(",").strip()

    def group_labels(self) -> list[str]:
        return list(self.thresholds["fleet"]["group_labels"])

    def by(self, *labels: str) -> str:
        """``labels`` and the group labels, for ``by (...)`` / ``on (...)``."""
        return ", ".join(dict.fromkeys([*labels, *self.group_labels()]))

    def group_variables(self) -> list[str]:
        """The group labels that get a dashboard variable of their own
        (``engine`` has one already)."""
        return [label for label in self.group_labels() if label != "engine"]

    def on_group(self) -> str:
        """Legend suffix naming the group (`` on {{instance}}``)."""
        names = self.group_variables()
        return " on " + "/".join("{{" + label + "}}" for label in names) if names else ""

    def where(self) -> str:
        """Alert-text suffix naming the group, empty for series without the
        labels: `` on instance host:8000``."""
        return "".join(f"{{{{ with $labels.{label} }}}} on {label} {{{{ . }}}}{{{{ end }}}}"
                       for label in self.group_variables())

    def group_noun(self) -> str:
        """``instance``, ``(cluster, pod)``; '' when replicas are not kept apart."""
        labels = self.group_labels()
        return labels[0] if len(labels) == 1 else f"({', '.join(labels)})" if labels else ""

    def same_by(self) -> list[str]:
        """The labels besides ``model_name`` that split a model's replicas
        into fleets whose limits are compared (``limits_differ.same_by``)."""
        return list(self.thresholds["limits_differ"]["same_by"])

    def fleet_by(self) -> str:
        """``model_name`` and ``same_by``: one fleet, for ``by (...)``."""
        return ", ".join(dict.fromkeys(["model_name", *self.same_by()]))

    def in_fleet(self) -> str:
        """Alert-text suffix naming the fleet's ``same_by`` labels (`` in cluster eu``)."""
        return "".join(f"{{{{ with $labels.{label} }}}} in {label} {{{{ . }}}}{{{{ end }}}}"
                       for label in self.same_by())

    def per_group(self, what: str = "engines") -> str:
        """``of one instance`` / ``of the model`` after "summed over the engines"."""
        noun = self.group_noun()
        return f"the {what} of one {noun}" if noun else f"all {what} of the model"

    # -- selectors -------------------------------------------------------------------

    def raw(self, name: str, suffix: str = "", extra: str = "") -> str:
        """A metric of the table for a rule: its name, the fleet selector and
        ``extra`` matchers (on the metric's own labels)."""
        base = m(name).full_name + suffix
        matchers = ", ".join(part for part in (self.selector(), extra) if part)
        return f"{base}{{{matchers}}}" if matchers else base

    def matchers(self, labels: tuple[str, ...], extra: str, engine: bool) -> str:
        """A panel's matchers: the selector and the dashboard's variables."""
        parts = [self.selector()] if self.selector() else []
        parts.append('model_name=~"$model_name"')
        parts += [f'{label}=~"${label}"' for label in self.group_variables()]
        if engine:
            parts.append('engine=~"$engine"')
        if "user" in labels:
            parts.append('user=~"$user"')
        if extra:
            parts.append(extra)
        return "{" + ", ".join(parts) + "}"

    def sel(self, name: str, suffix: str = "", extra: str = "", engine: bool = True) -> str:
        """``output_rate_<name>[_bucket...]{model_name=~"$model_name", ...}``."""
        metric = m(name)
        return metric.full_name + suffix + self.matchers(metric.labels, extra, engine)

    def vsel(self, name: str, suffix: str = "") -> str:
        """A vLLM metric with the dashboard's model/engine filters."""
        assert name in VLLM_METRICS, name
        base = name + ("_total" if VLLM_METRICS[name] == "counter" else "")
        return base + suffix + self.matchers((), "", True)
