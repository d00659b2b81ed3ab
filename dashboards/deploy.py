"""Kubernetes artefacts of the dashboards and rules (``kubernetes/`` here).

Made by ``generate.py`` in the same run as the rule files and dashboards,
from the same data (never read back from disk), so they cannot drift:

- ``prometheusrule.yaml``: a ``PrometheusRule`` (monitoring.coreos.com/v1)
  whose ``spec`` is the recording and alert rule groups of
  ``prometheus/*.rules.yaml``;
- ``servicemonitor.yaml``: a ``ServiceMonitor`` scraping vLLM's ``/metrics``
  on the named port of the Services with the selector labels;
- ``grafana-dashboards.yaml``: a ``ConfigMap`` for Grafana's dashboard
  sidecar (label ``grafana_dashboard: "1"``), one key per dashboard JSON;
- ``vllm.yaml``: the example Deployment (the image of ``Dockerfile`` here,
  ``vllm-output-rate serve`` with limit flags), its Service and a
  ``NetworkPolicy`` that lets only the operator namespace (Prometheus) and
  the tenants' gateway reach it: ``/metrics`` and ``/output-rate/`` belong
  on an operator network, and the gateway (the nginx example,
  ``proxy.py``) refuses them on the tenants' port;
- ``kustomization.yaml``: all of the above, for ``kubectl apply -k``.

The knobs (names, selector labels, port name, scrape interval, the labels
the Prometheus Operator selects by) are the ``kubernetes`` section of
``thresholds.yaml``; the runbook links come from its ``runbook_base_url``
through the alert rules. ``Dockerfile`` is a static file (tested).
"""

from __future__ import annotations

import json
from importlib import metadata
from typing import Any

import yaml

FOLDER = "kubernetes"
#: vLLM's default API port (also its /metrics)
PORT = 8000
#: where the example mounts the model weights (read-only volume)
MODEL_DIR = "/models/model"
SERVED_MODEL_NAME = "model"
#: Grafana sidecar label (the kube-prometheus-stack / Grafana chart default)
SIDECAR_LABEL = {"grafana_dashboard": "1"}
#: Grafana chart's usual ``sidecar.dashboards.folderAnnotation``
FOLDER_ANNOTATION = "grafana_folder"
#: the limit flags the example starts with (README "Serving with limits")
LIMIT_ARGS = [
    "--max-num-seqs", "64", "--max-num-active-seqs", "16",
    "--output-rate-default-tokens-per-second", "100",
    "--output-rate-user-tokens-per-second", json.dumps({"user-a": 100, "user-b": 500}),
]
#: who may reach the engines (``NetworkPolicy``; edit to your cluster): the
#: namespace of the Prometheus that scrapes ``/metrics`` and of the
#: operators' tools, and the pods of the tenants' gateway
OPERATOR_NAMESPACE = "monitoring"
GATEWAY_LABELS = {"app.kubernetes.io/component": "gateway"}
FILES = ("vllm.yaml", "servicemonitor.yaml", "prometheusrule.yaml", "grafana-dashboards.yaml")


def image() -> str:
    """The tag the README builds the Dockerfile as: this package's version."""
    return f"vllm-output-rate:{metadata.version('vllm-output-rate')}"


def _meta(k8s: dict[str, Any], name: str, **labels: str) -> dict[str, Any]:
    return {"name": name, "labels": {**k8s["selector_labels"], **labels}}


def prometheus_rule(k8s: dict[str, Any], rule_files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    groups = [g for data in rule_files.values() for g in data["groups"]]
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": _meta(k8s, f"{k8s['name']}-rules", **k8s["prometheus_labels"]),
            "spec": {"groups": groups}}


def service_monitor(k8s: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": _meta(k8s, k8s["name"], **k8s["prometheus_labels"]),
            "spec": {
                "selector": {"matchLabels": dict(k8s["selector_labels"])},
                "endpoints": [{"port": k8s["port_name"], "path": "/metrics", "scheme": "http",
                               "interval": k8s["scrape_interval"]}]}}


def dashboards_configmap(k8s: dict[str, Any], dashboards: dict[str, str], folder: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {**_meta(k8s, f"{k8s['name']}-dashboards", **SIDECAR_LABEL),
                         "annotations": {FOLDER_ANNOTATION: folder}},
            "data": dict(dashboards)}


def container_args() -> list[str]:
    """``vllm-output-rate serve`` arguments of the example (after the entrypoint)."""
    return ["--model", MODEL_DIR, "--served-model-name", SERVED_MODEL_NAME,
            "--port", str(PORT), *LIMIT_ARGS]


def example(k8s: dict[str, Any]) -> list[dict[str, Any]]:
    """The example Deployment and Service (one replica on one GPU)."""
    labels = dict(k8s["selector_labels"])
    port = k8s["port_name"]
    health = {"httpGet": {"path": "/health", "port": port}}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(k8s, k8s["name"]),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {
                "containers": [{
                    "name": "vllm",
                    "image": image(),
                    "args": container_args(),
                    "env": [{"name": "HF_HUB_OFFLINE", "value": "1"},
                            {"name": "VLLM_NO_USAGE_STATS", "value": "1"}],
                    "ports": [{"name": port, "containerPort": PORT, "protocol": "TCP"}],
                    "startupProbe": {**health, "periodSeconds": 10, "failureThreshold": 90},
                    "readinessProbe": {**health, "periodSeconds": 10},
                    "livenessProbe": {**health, "periodSeconds": 30, "failureThreshold": 3},
                    "resources": {"limits": {"nvidia.com/gpu": 1}},
                    "volumeMounts": [{"name": "model", "mountPath": MODEL_DIR.rsplit("/", 1)[0],
                                      "readOnly": True},
                                     {"name": "shm", "mountPath": "/dev/shm"}],
                }],
                "volumes": [
                    {"name": "model", "persistentVolumeClaim": {
                        "claimName": f"{k8s['name']}-model", "readOnly": True}},
                    {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
                ],
            }},
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(k8s, k8s["name"]),
        "spec": {"selector": labels,
                 "ports": [{"name": port, "port": PORT, "targetPort": port, "protocol": "TCP"}]},
    }
    policy = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta(k8s, k8s["name"]),
        "spec": {
            "podSelector": {"matchLabels": labels},
            "policyTypes": ["Ingress"],
            "ingress": [{
                "from": [
                    {"namespaceSelector": {"matchLabels": {
                        "kubernetes.io/metadata.name": OPERATOR_NAMESPACE}}},
                    {"podSelector": {"matchLabels": dict(GATEWAY_LABELS)}},
                ],
                "ports": [{"port": port, "protocol": "TCP"}],
            }],
        },
    }
    return [deployment, service, policy]


def kustomization() -> dict[str, Any]:
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": list(FILES)}


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the dashboards' JSON) as literal blocks; no
    anchors (a label set used twice is written twice, as people write it)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _dump(header: str, *docs: Any) -> str:
    return header + yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, width=10_000,
                                  allow_unicode=True, explicit_start=len(docs) > 1)


def outputs(thresholds: dict[str, Any], rule_files: dict[str, dict[str, Any]],
            dashboards: dict[str, str], folder: str, header: str) -> dict[str, str]:
    """Relative path under dashboards/ -> content of every generated manifest."""
    k8s = thresholds["kubernetes"]
    return {
        f"{FOLDER}/vllm.yaml": _dump(header, *example(k8s)),
        f"{FOLDER}/servicemonitor.yaml": _dump(header, service_monitor(k8s)),
        f"{FOLDER}/prometheusrule.yaml": _dump(header, prometheus_rule(k8s, rule_files)),
        f"{FOLDER}/grafana-dashboards.yaml": _dump(header, dashboards_configmap(k8s, dashboards, folder)),
        f"{FOLDER}/kustomization.yaml": _dump(header, kustomization()),
    }
