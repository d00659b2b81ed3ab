"""End to end: the real vLLM CPU engine on the tiny model, through the OpenAI API.

One server for the module (start-up takes about a minute). vLLM's CPU
platform always turns async scheduling off, so the engine runs the
synchronous variant here; the async variant is covered by driving the real
AsyncScheduler in test_scheduler.py.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import psutil
import pytest

from harness import REPO, tiny_model
from vllm_patch.client import Server, run_load, summarize

pytestmark = pytest.mark.e2e

LIMITS = {"user-a": 20, "user-b": 60, "user-slow": 0.5}
#: the unlimited-enough default
DEFAULT = 100_000
#: one engine step of slack on top of the GCRA bound, plus client jitter
STEP_SLACK_S = 0.05


@pytest.fixture(scope="module")
def server():
    import json

    args = [
        "--max-num-seqs", "16", "--max-num-active-seqs", "8", "--max-model-len", "1024",
        "--default-user-output-tokens-per-second", str(DEFAULT),
        "--user-output-tokens-per-second", json.dumps(LIMITS),
    ]
    srv = Server(tiny_model(), args, REPO / ".cache" / "logs" / "e2e-server.log",
                 extra_env={"VLLM_OUTPUT_RATE_TELEMETRY": "1"})
    srv.start()
    yield srv
    srv.stop()


def load(server, plan):
    return asyncio.run(run_load(server.base_url, plan))


def test_limited_users_get_their_limit_and_complete(server):
    results = load(server, [("user-a", 4, 75), ("user-b", 2, 200)])
    assert [r.error for r in results if r.error] == []
    assert all(r.completion_tokens == r.max_tokens for r in results)
    assert all(r.finish_reason == "length" for r in results)
    summary = {s.user: s for s in summarize(results, {})}
    print("\nlimited users:", {u: round(s.rate, 2) for u, s in summary.items()})
    for user in ("user-a", "user-b"):
        s, limit = summary[user], LIMITS[user]
        # GCRA bound over the user's first-to-last-token span, one step of slack
        assert s.tokens <= (s.span_s + 0.1 + STEP_SLACK_S) * limit + 1, s
        # demand (several streams, >100 tok/s each) exceeds the limit throughout
        assert s.rate >= 0.97 * limit, s


def test_unlimited_user_is_not_slowed_by_limited_load(server):
    # user-c's rate from sending its request to its last token: chunks can
    # arrive bunched at the client, which would blur a first-to-last span.
    (alone,) = load(server, [("user-c", 1, 900)])
    results = load(server, [("user-a", 4, 60), ("user-b", 2, 200), ("user-c", 1, 900)])
    (with_load,) = [r for r in results if r.user == "user-c"]
    assert with_load.completion_tokens == 900
    print(f"\nuser-c alone {alone.request_rate:.0f} tok/s, "
          f"beside limited load {with_load.request_rate:.0f} tok/s")
    # Without the limiter user-a's and user-b's six streams would share every
    # step with user-c and roughly halve its rate on this machine.
    assert with_load.request_rate >= 0.7 * alone.request_rate, (alone, with_load)


def test_beam_search_is_refused_with_400(server):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "n": 2,
            "use_beam_search": True}
    resp = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert "output-rate" in resp.text and "beam search" in resp.text.lower()
    # ordinary requests still work
    ok = httpx.post(f"{server.base_url}/v1/completions",
                    json={"model": "tiny", "prompt": "hello", "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200


def _engine_core(server) -> psutil.Process:
    parent = psutil.Process(server.proc.pid)
    for child in parent.children(recursive=True):
        if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
            return child
    raise AssertionError("no engine-core process found")


def test_engine_core_does_not_spin_while_all_users_are_throttled(server):
    core = _engine_core(server)

    async def slow_user():
        # 0.5 tok/s: a token every 2 s; the engine has nothing else to do
        return await run_load(server.base_url, [("user-slow", 2, 5)])

    async def measure():
        task = asyncio.create_task(slow_user())
        await asyncio.sleep(2.0)  # prefill and first tokens done
        before, t0 = core.cpu_times(), time.monotonic()
        await asyncio.sleep(5.0)
        after, t1 = core.cpu_times(), time.monotonic()
        results = await task
        busy = (after.user + after.system) - (before.user + before.system)
        return busy / (t1 - t0), results

    share, results = asyncio.run(measure())
    print(f"\nengine-core CPU while every user is throttled: {share:.2%} of a core")
    assert all(r.completion_tokens == 5 and r.error is None for r in results)
    assert share < 0.05, f"engine core used {share:.1%} of a core while idle-throttled"


def scrape(server) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels):
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == val for k, val in labels.items()))


def test_engine_metrics_on_vllm_metrics_endpoint(server):
    from telemetry.metrics import METRICS

    before = scrape(server)
    results = load(server, [("user-a", 2, 40), ("user-b", 1, 60)])
    time.sleep(2.5)  # the engine exports every second
    after = scrape(server)
    names = {n for n, _ in after}
    missing = [m.full_name for m in METRICS
               if not any(n == m.full_name or n.startswith(m.full_name + "_") for n in names)]
    assert missing == []
    # refunds happen only under KV pressure: the configured users' series exist, at zero
    assert value(after, "output_rate_tokens_refunded_total", user="user-a", reason="preempted") == 0
    assert ("output_rate_tokens_refunded_total", (("engine", "0"), ("model_name", "tiny"),
            ("reason", "preempted"), ("user", "user-a"))) in after
    assert any(n.startswith("vllm:") for n in names)  # vLLM's own metrics still served
    for user in ("user-a", "user-b"):
        received = sum(r.completion_tokens for r in results if r.user == user)
        charged = (value(after, "output_rate_tokens_charged_total", user=user)
                   - value(before, "output_rate_tokens_charged_total", user=user))
        # sync scheduling, ignore_eos, no cancels: charged exactly what was sent
        assert charged == received, (user, charged, received)
    spacing = (value(after, "output_rate_inter_token_seconds_count", user="user-a")
               - value(before, "output_rate_inter_token_seconds_count", user="user-a"))
    assert spacing == sum(r.completion_tokens - 1 for r in results if r.user == "user-a")


def test_throttled_gauge_rises_and_returns_to_zero(server):
    async def run():
        task = asyncio.create_task(run_load(server.base_url, [("user-slow", 2, 3)]))
        await asyncio.sleep(2.5)
        during = await asyncio.to_thread(scrape, server)
        results = await task
        return during, results

    during, results = asyncio.run(run())
    assert all(r.completion_tokens == 3 for r in results)
    assert value(during, "output_rate_throttled_requests", user="user-slow") > 0
    assert value(during, "output_rate_throttled_kv_blocks", user="user-slow") > 0
    time.sleep(2.5)
    after = scrape(server)
    assert value(after, "output_rate_throttled_requests", user="user-slow") == 0
