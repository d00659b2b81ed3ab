"""The package as a user gets it: a wheel built from the tracked files only,
installed into a fresh virtual environment beside vLLM, run from a directory
that is not the repository."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

from harness import REPO, scrape_until, tiny_model
from vllm_output_rate.tools.common.client import Server, metric_value

PACKAGES = ("vllm_output_rate/", "vllm_output_rate-")  # the module and its dist-info


@pytest.mark.parametrize("flag", ["-v", "--version"])
def test_version_command(flag):
    run = subprocess.run([sys.executable, "-m", "vllm_output_rate.tools.cli", flag],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("vllm-output-rate 0.1.0, vLLM 0.3"), run.stdout
    assert "(supported); supports vLLM 0.32, 0.33, 0.34 (>=0.32,<0.35)" in run.stdout


def test_every_package_folder_is_listed():
    """Each folder of a package (an ``__init__.py``) is in pyproject's
    ``packages``: one left out would be missing from the wheel."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join([package, *init.parent.relative_to(REPO / folder).parts])
             for package, folder in config["package-dir"].items()
             for init in (REPO / folder).rglob("__init__.py")}
    assert found == set(config["packages"])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the tracked files (what a clean clone has)."""
    root = tmp_path_factory.mktemp("clone")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            dst = root / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(root)],
                   check=True, capture_output=True, timeout=600)
    (whl,) = out.glob("vllm_output_rate-*.whl")
    return whl


def test_the_wheel_installs_one_namespace_with_its_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert all(n.startswith(PACKAGES) for n in names), sorted({n.split("/")[0] for n in names})
    for shipped in ("vllm_output_rate/plugin.py", "vllm_output_rate/telemetry/plugin.py",
                    "vllm_output_rate/tools/loadgen/scenarios/default.yaml",
                    "vllm_output_rate/dashboards/output-rate-users.json",
                    "vllm_output_rate/dashboards/prometheus/alerts.rules.yaml",
                    "vllm_output_rate/dashboards/provisioning/alerting.yaml",
                    "vllm_output_rate/dashboards/runbook.md"):
        assert shipped in names, shipped
    meta = next(n for n in names if n.endswith("METADATA"))
    metadata = zipfile.ZipFile(wheel).read(meta).decode()
    assert "Requires-Python: >=3.11" in metadata
    for dep in ("prometheus-client", "opentelemetry-sdk", "PyYAML", "httpx"):
        assert f"Requires-Dist: {dep}" in metadata, dep
    points = zipfile.ZipFile(wheel).read(meta.replace("METADATA", "entry_points.txt")).decode()
    assert "output_rate = vllm_output_rate.plugin:register" in points
    assert "output_rate_telemetry = vllm_output_rate.telemetry.plugin:register" in points
    assert "vllm-output-rate = vllm_output_rate.tools.cli:main" in points


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory) -> Path:
    """A new venv that sees vLLM and the other dependencies from the
    project's venv (a path entry, so the project's own editable install is
    not active there) and gets the wheel installed."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = Path(sysconfig.get_paths()["purelib"])
    (site,) = (venv / "lib").glob("python3*/site-packages")
    (site / "beside_vllm.pth").write_text(str(purelib) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "--quiet", "--no-deps", str(wheel)],
                   check=True, capture_output=True, timeout=600)
    return venv


def test_the_installed_command_runs_from_any_directory(fresh_venv, tmp_path):
    run = subprocess.run([str(fresh_venv / "bin" / "vllm-output-rate"), "--version"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("vllm-output-rate 0.1.0, vLLM 0.32"), run.stdout
    where = subprocess.run(
        [str(fresh_venv / "bin" / "python"), "-c",
         "import json, vllm_output_rate.telemetry.plugin as t, vllm_output_rate.tools.cli as c;"
         "print(json.dumps([t.__file__, c.__file__]))"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    for path in json.loads(where.stdout):
        assert Path(path).is_relative_to(fresh_venv), path  # the wheel's copy, not the repo


@pytest.mark.e2e
def test_serve_from_the_wheel_limits_and_reports(fresh_venv, tmp_path):
    """`vllm-output-rate serve` of the installed wheel, started outside the
    repository: the limit holds and the engine's series are on /metrics."""
    args = ["--max-num-seqs", "8", "--max-model-len", "512", "--gpu-memory-utilization", "0.3",
            "--default-user-output-tokens-per-second", "1000",
            "--user-output-tokens-per-second", json.dumps({"slow": 20})]
    with Server(tiny_model(), args, tmp_path / "server.log", cwd=tmp_path,
                command=[str(fresh_venv / "bin" / "vllm-output-rate")]) as server:
        import httpx

        body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 40, "ignore_eos": True, "vllm_xargs": {"output_rate_user": "slow"}}
        t0 = time.monotonic()
        answer = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120).json()
        took = time.monotonic() - t0
        assert answer["usage"]["completion_tokens"] == 40
        # 40 tokens at 20 tok/s with a 0.1 s burst: at least (40 - 1) / 20 - 0.1 s
        assert took >= (40 - 1) / 20 - 0.1 - 0.05
        samples = scrape_until(server.base_url, lambda s: metric_value(  # one engine export
            s, "vllm_output_rate_tokens_charged_total", user="slow") >= 40)
        assert metric_value(samples, "vllm_output_rate_tokens_charged_total", user="slow") == 40
        log = server.log_path.read_text(errors="replace")
        assert "Unknown vLLM environment variable detected: VLLM_OUTPUT_RATE" not in log
