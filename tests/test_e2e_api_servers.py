"""End to end with several API-server processes (``--api-server-count 2``).

vLLM then runs prometheus_client in multiprocess mode and every API server
answers ``/metrics`` from a fresh registry; the engine's snapshots must still
appear once per engine, whichever API server answers, and the API servers
that never parsed our options (the parent did) must still refuse beam search.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from harness import REPO, tiny_model
from vllm_patch.client import Server, metric_value, run_load, scrape_metrics

pytestmark = pytest.mark.e2e

LIMITS = {"user-a": 20}
ARGS = ["--max-num-seqs", "16", "--max-model-len", "1024",
        "--default-user-output-tokens-per-second", "100000",
        "--user-output-tokens-per-second", json.dumps(LIMITS),
        "--api-server-count", "2"]


@pytest.fixture(scope="module")
def server():
    srv = Server(tiny_model(), ARGS, REPO / ".cache" / "logs" / "e2e-api-servers.log",
                 extra_env={"VLLM_OUTPUT_RATE_TELEMETRY": "1"})
    srv.start()
    yield srv
    srv.stop()


def test_every_api_server_shows_the_engine_metrics_once(server):
    results = asyncio.run(run_load(server.base_url, [("user-a", 2, 30), ("user-b", 2, 50)]))
    assert all(r.error is None and r.completion_tokens == r.max_tokens for r in results)
    delivered = {u: sum(r.completion_tokens for r in results if r.user == u)
                 for u in ("user-a", "user-b")}
    time.sleep(2.5)  # one engine export interval and then some
    for _ in range(12):
        # A new connection each time: the kernel spreads connections over
        # the API servers (SO_REUSEPORT); 12 all on one server: p = 2**-11.
        samples = scrape_metrics(server.base_url)
        for user, n in delivered.items():
            series = [k for k in samples if k[0] == "output_rate_tokens_charged_total"
                      and dict(k[1]).get("user") == user]
            assert len(series) == 1, series  # once, not once per API server
            assert metric_value(samples, "output_rate_tokens_charged_total", user=user) == n
        assert metric_value(samples, "output_rate_engine_tokens_charged_total") == sum(
            delivered.values())
    assert metric_value(samples, "output_rate_user_limit_tokens_per_second", user="user-a") == 20


def test_every_api_server_refuses_beam_search(server):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "n": 2,
            "use_beam_search": True}
    for _ in range(12):  # new connections, spread over both API servers
        resp = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 400, resp.text
        assert "beam search" in resp.text.lower()
