"""What every alert group module (``alerts_*.py``) builds on: the ``Alert``
record, and the helpers of its ``promtool test rules`` cases.

Each alert group module holds its alerts (``alerts(c)``) and, beside them,
their promtool cases: ``cases(c)`` with one engine or two (one where each
alert fires, with the expected labels and annotations, and at least one
where it must not) and ``fleet_cases(c)`` with two replicas (two scrape
targets, both reporting ``engine="0"``): the alert fires for the replica
that breaks the rule, with its ``instance``, and stays quiet while each
replica keeps it. The cases are for the default group labels
(``[instance]``).

Series names come from the metric table; the expected annotations are
typed out in the cases on purpose (they are what an SRE reads when paged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_output_rate.dashboards.config import Config
from vllm_output_rate.telemetry.metrics import BY_NAME


@dataclass
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    #: compares the replicas of a fleet (aggregates over the group labels)
    #: instead of judging each replica alone
    fleet_wide: bool = False

    @property
    def anchor(self) -> str:
        return self.name.lower()


# -- promtool cases ----------------------------------------------------------------

MODEL = "tiny"
#: two replicas of the model (the cases are for the default group labels, [instance])
R1, R2 = "10.0.0.1:8000", "10.0.0.2:8000"


def name(short: str, suffix: str = "") -> str:
    """The exported name of a metric of the table."""
    return BY_NAME[short].full_name + suffix


def series(short: str, values: str, suffix: str = "", **labels: str) -> dict[str, str]:
    labels = {"model_name": MODEL, "engine": "0", **labels}
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name(short, suffix)}{{{body}}}", "values": values}


def histogram(short: str, bucket_increments: dict[str, int], minutes: int, **labels: str) -> list[dict[str, str]]:
    """A histogram whose buckets grow by the given counts per minute
    (``bucket_increments``: bound -> observations per minute in that bucket)."""
    bounds = [*map(repr, map(float, BY_NAME[short].buckets)), "+Inf"]
    out, running = [], 0
    for bound in bounds:
        running += bucket_increments.get(bound, 0)
        out.append(series(short, f"0+{running}x{minutes}", "_bucket", le=bound, **labels))
    out.append(series(short, f"0+{running}x{minutes}", "_count", **labels))
    out.append(series(short, f"0+{running * 0.001:g}x{minutes}", "_sum", **labels))
    return out


def quiet(alert: str, eval_time: str) -> dict[str, Any]:
    """``alert`` does not fire at ``eval_time``."""
    return {"eval_time": eval_time, "alertname": alert, "exp_alerts": []}


def fires(c: Config, alert: str, eval_time: str, labels: dict[str, str], summary: str,
          description: str) -> dict[str, Any]:
    """``alert`` fires once at ``eval_time`` with these labels and texts
    (and its runbook link). The ``severity`` label is typed as a severity
    (critical / warning / info) and expected as the config's scheme writes it."""
    labels = {**labels, "severity": c.label(labels["severity"])}
    return {"eval_time": eval_time, "alertname": alert, "exp_alerts": [{
        "exp_labels": labels,
        "exp_annotations": {"summary": summary, "description": description,
                            "runbook_url": c.runbook_url(alert)}}]}
