"""The affinity nginx configuration: rendered, checked by Debian's nginx
(``nginx -t``), and the shipped example is what the generator renders."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from harness import REPO
from vllm_output_rate.dashboards import proxy


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    assert found, "nginx is missing: make tools (scripts/setup/ensure_nginx.sh) installs Debian's"
    return found


def test_header_variable():
    assert proxy.header_variable("X-User-Id") == "$http_x_user_id"
    with pytest.raises(ValueError):
        proxy.header_variable("X User")


def test_the_rendered_config_is_valid_nginx(tmp_path):
    conf = tmp_path / "nginx.conf"
    conf.write_text(proxy.nginx_config(["127.0.0.1:9001", "127.0.0.1:9002"], "X-Tenant",
                                       "127.0.0.1:9000", run_dir=str(tmp_path)))
    text = conf.read_text()
    assert "hash $http_x_tenant consistent;" in text and "proxy_buffering off;" in text
    run = subprocess.run([nginx_binary(), "-t", "-p", str(tmp_path), "-c", str(conf)],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    with pytest.raises(ValueError):
        proxy.nginx_config([])


def test_the_shipped_example_is_the_generators():
    shipped = (REPO / "dashboards" / "nginx" / "affinity.conf").read_text()
    assert shipped == proxy.nginx_config(
        ["vllm-0.vllm:8000", "vllm-1.vllm:8000", "vllm-2.vllm:8000"])


def test_the_ring_spreads_users_and_moves_few_when_a_replica_joins():
    from vllm_output_rate.tools.bench.affinity_balance import Ring, balance

    ring = Ring(["10.0.0.1:8000", "10.0.0.2:8000"])
    assert len(ring.hashes) == 320 and ring.lookup("alice") == ring.lookup("alice")
    r = balance(10_000, 8)
    assert r["max_over_mean"] < 1.5 and abs(r["moved_on_add"] - 1 / 9) < 0.05
