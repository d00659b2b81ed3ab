"""End to end with several API-server processes (``--api-server-count 2``).

vLLM then runs prometheus_client in multiprocess mode and every API server
answers ``/metrics`` from a fresh registry; the engine's snapshots must still
appear once per engine, whichever API server answers, and the API servers
that never parsed our options (the parent did) must still refuse beam search
and read the user from the request fields the parent was told
(``--output-rate-user-sources``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import httpx
import pytest

from harness import REPO, scrape_until, tiny_model
from vllm_output_rate.tools.common.client import Server, metric_value, run_load, scrape_metrics

pytestmark = pytest.mark.e2e

LIMITS = {"default": 100000, "users": {"user-a": 20}}
ARGS = ["--max-num-seqs", "16", "--max-model-len", "1024", "--api-server-count", "2",
        "--output-rate-user-sources", "vllm_xargs,user"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    limits = tmp_path_factory.mktemp("api-servers") / "limits.json"
    limits.write_text(json.dumps(LIMITS))
    srv = Server(tiny_model(), [*ARGS, "--output-rate-limits-file", str(limits)],
                 REPO / ".cache" / "logs" / "e2e-api-servers.log",
                 extra_env={"OUTPUT_RATE_TELEMETRY": "1"})
    srv.limits_path = limits
    srv.start()
    yield srv
    srv.stop()


def test_every_api_server_shows_the_engine_metrics_once(server):
    results = asyncio.run(run_load(server.base_url, [("user-a", 2, 30), ("user-b", 2, 50)]))
    assert all(r.error is None and r.completion_tokens == r.max_tokens for r in results)
    delivered = {u: sum(r.completion_tokens for r in results if r.user == u)
                 for u in ("user-a", "user-b")}
    # one engine export, however late this process looks
    scrape_until(server.base_url, lambda s: all(
        metric_value(s, "vllm_output_rate_tokens_charged_total", user=u) >= n
        for u, n in delivered.items()))
    for _ in range(12):
        # A new connection each time: the kernel spreads connections over
        # the API servers (SO_REUSEPORT); 12 all on one server: p = 2**-11.
        samples = scrape_metrics(server.base_url)
        for user, n in delivered.items():
            series = [k for k in samples if k[0] == "vllm_output_rate_tokens_charged_total"
                      and dict(k[1]).get("user") == user]
            assert len(series) == 1, series  # once, not once per API server
            assert metric_value(samples, "vllm_output_rate_tokens_charged_total", user=user) == n
        assert metric_value(samples, "vllm_output_rate_engine_tokens_charged_total") == sum(
            delivered.values())
    assert metric_value(samples, "vllm_output_rate_user_limit_tokens_per_second", user="user-a") == 20


def test_every_api_server_refuses_beam_search(server):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "n": 2,
            "use_beam_search": True}
    for _ in range(12):  # new connections, spread over both API servers
        resp = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 400, resp.text
        assert "beam search" in resp.text.lower()


def test_every_api_server_shows_the_limits_in_force_after_a_reload(server):
    path = server.limits_path
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"default": 100000, "users": {"user-a": 30, "user-new": 5}}))
    tmp.replace(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    # in force within a second; one engine export after that (waited for on
    # the engine's side, however late this process looks)
    deadline = time.monotonic() + 30
    while metric_value(scrape_metrics(server.base_url), "vllm_output_rate_limits_info",
                       sha256=digest) != 1:
        assert time.monotonic() < deadline, "the reloaded limits never showed"
        time.sleep(0.25)
    for _ in range(12):  # new connections, spread over both API servers
        limits = httpx.get(f"{server.base_url}/output-rate/limits", timeout=30).json()
        assert limits.get("sha256") == digest and limits["agree"] is True, limits
        assert limits["users"] == {"user-a": 30, "user-new": 5}
        samples = scrape_metrics(server.base_url)
        assert metric_value(samples, "vllm_output_rate_limits_info", sha256=digest) == 1
        assert metric_value(samples, "vllm_output_rate_user_limit_tokens_per_second", user="user-a") == 30
        user = httpx.get(f"{server.base_url}/output-rate/users/user-new", timeout=30).json()
        assert user["limit"] == 5 and user["listed"] is True


def test_every_api_server_charges_the_openai_user_field_it_was_told_to_read(server):
    """The OpenAI SDK's ``user=`` is charged to that user (the server reads
    ``vllm_xargs,user``), on /v1/completions and /v1/responses;
    ``vllm_xargs.output_rate_user``, read first, wins over it when both are
    given."""
    from openai import OpenAI

    charged = "vllm_output_rate_tokens_charged_total"
    users = ("sdk-user", "xargs-user")
    before = scrape_metrics(server.base_url)
    for i in range(12):  # a new client (connection) each, spread over both API servers
        extra = {"ignore_eos": True}
        if i % 2:
            extra["vllm_xargs"] = {"output_rate_user": "xargs-user"}
        with OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as client:
            out = client.completions.create(model="tiny", prompt="hello", max_tokens=3,
                                            user="sdk-user", extra_body=extra)
        assert out.usage.completion_tokens == 3
    # the Responses API's ``user`` too (/v1/responses)
    for _ in range(4):
        with OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as client:
            out = client.responses.create(model="tiny", input="hello", max_output_tokens=3,
                                          user="responses-user", extra_body={"ignore_eos": True})
        assert out.usage.output_tokens == 3
    users = (*users, "responses-user")
    after = scrape_until(server.base_url, lambda s: all(
        metric_value(s, charged, user=u) - metric_value(before, charged, user=u) >= 12
        for u in users))
    got = {u: metric_value(after, charged, user=u) - metric_value(before, charged, user=u)
           for u in (*users, "__anonymous__")}
    assert got == {"sdk-user": 18, "xargs-user": 18, "responses-user": 12, "__anonymous__": 0}, got
