"""End to end: the engine core's spans through the real OTLP exporters.

- A receiver on loopback (OTLP over HTTP, protobuf decoded with the
  OpenTelemetry proto classes) gets the throttle and generation spans of a
  real engine serving a limited and an unlimited user (identified by a
  trusted header). The limited user's streams carry a W3C ``traceparent``:
  their spans are children of it, beside vLLM's own ``llm_request`` span of
  the same request (same ``gen_ai.request.id``); the unlimited user's spans
  start traces of their own.
- With only the standard ``OTEL_*`` variables (no ``--otlp-traces-endpoint``:
  vLLM then passes no trace headers itself), the API server's middleware
  carries each request's ``traceparent`` and the spans still join its trace.
- With the OTLP endpoint down (gRPC to a closed port), the engine serves at
  the limit exactly as before and the drop counter on /metrics rises.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from fractions import Fraction

import httpx
import pytest

from harness import REPO, OtlpSpanReceiver, rate_while_stepping, spend_rate, tiny_model
from vllm_output_rate.telemetry.events import EngineLog
from vllm_output_rate.tools.common.client import (
    http_limits,
    Server,
    StreamResult,
    chat_body,
    free_port,
    metric_value,
    run_load,
    scrape_metrics,
    stream_into,
)
from vllm_output_rate.tools.verify.gcra import gcra_worst_window

pytestmark = pytest.mark.e2e

LIMIT = 20
ARGS = ["--max-num-seqs", "16", "--max-model-len", "1024",
        "--default-user-output-tokens-per-second", "100000",
        "--user-output-tokens-per-second", json.dumps({"user-a": LIMIT, "user-b": 100000})]


async def _streams(base_url: str, plan: list[tuple[str, int, dict[str, str]]]) -> list[StreamResult]:
    """Streams of (user, max_tokens, extra headers) at once, the user named
    by the trusted X-User header (none in the body)."""
    async with httpx.AsyncClient(limits=http_limits(None), timeout=httpx.Timeout(600.0)) as client:
        async def one(user: str, max_tokens: int, headers: dict[str, str]) -> StreamResult:
            rec = StreamResult(user, max_tokens, started=time.monotonic())
            body = chat_body("tiny", "Explain continuous batching.", max_tokens, None)
            await stream_into(client, base_url, body, rec, headers={"X-User": user, **headers})
            return rec

        return list(await asyncio.gather(*(one(*p) for p in plan)))


def test_spans_of_a_real_engine_reach_an_otlp_receiver_in_the_requests_traces():
    receiver = OtlpSpanReceiver()
    env = {"OUTPUT_RATE_TELEMETRY": "1",
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
           "OTEL_BSP_SCHEDULE_DELAY": "200",
           # a throttle span for every throttled request's longest episode
           # (by default only those of 1 s and more: here about 4 s each)
           "OUTPUT_RATE_TRACE_THROTTLE_MIN_S": "0"}
    # vLLM passes a request's trace headers to the engine only with
    # --otlp-traces-endpoint (its own request spans go there too)
    args = [*ARGS, "--otlp-traces-endpoint", receiver.url, "--output-rate-user-header", "X-User"]
    parents = {os.urandom(16).hex(): os.urandom(8).hex() for _ in range(3)}  # trace -> span
    plan = [("user-a", 30, {"traceparent": f"00-{trace}-{span}-01"})
            for trace, span in parents.items()] + [("user-b", 60, {})]
    try:
        with Server(tiny_model(), args, REPO / ".cache" / "logs" / "e2e-traces.log",
                    extra_env=env) as server:
            results = asyncio.run(_streams(server.base_url, plan))
            assert all(r.error is None and r.completion_tokens == r.max_tokens for r in results), [
                r.error for r in results]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if (len(receiver.named("output_rate.generation")) >= 4
                        and len(receiver.named("llm_request")) >= 4
                        and receiver.named("output_rate.over_limit")):
                    break
                time.sleep(0.5)
    finally:
        receiver.close()
    gens = receiver.named("output_rate.generation")
    assert sorted(g["attributes"]["gen_ai.usage.output_tokens"] for g in gens) == [30, 30, 30, 60]
    throttles = receiver.named("output_rate.throttle")
    assert throttles and {t["attributes"]["output_rate.user"] for t in throttles} == {"user-a"}
    assert all(t["attributes"]["output_rate.kv_blocks"] > 0 for t in throttles)
    # the limited user's spans are children of its requests' traceparents
    for span in throttles + [g for g in gens if g["attributes"]["output_rate.user"] == "user-a"]:
        assert parents.get(span["trace_id"]) == span["parent_span_id"], span
        assert span["attributes"]["user.id"] == "user-a"  # a trusted header
        assert span["attributes"]["output_rate.identity_source"] == "header"
    by_trace = {g["trace_id"]: g for g in gens}
    assert set(parents) <= set(by_trace)
    for t in throttles:  # the same request as the generation span of its trace
        assert t["attributes"]["gen_ai.request.id"] == by_trace[t["trace_id"]]["attributes"][
            "gen_ai.request.id"]
    # user-a's over-limit period: a span of its own, with its episodes. One
    # period on a machine that runs the engine promptly; a stall of the
    # machine long enough to let user-a's budget refill (its requests all
    # served and none throttled for a while) ends a period and the next
    # refusal starts another: the periods' sums are what is checked.
    periods = receiver.named("output_rate.over_limit")
    assert 1 <= len(periods) <= 3, periods
    for period in periods:
        pa = period["attributes"]
        assert pa["output_rate.user"] == "user-a" and pa["output_rate.limit_tokens_per_second"] == 20
    total = {key: sum(p["attributes"][key] for p in periods)
             for key in ("output_rate.throttle_episodes", "output_rate.throttled_us",
                         "output_rate.tokens_charged")}
    a_gens = [g for g in gens if g["attributes"]["output_rate.user"] == "user-a"]
    # its three streams take turns at its limit (a token, then throttled
    # again): about one episode each, from its first refusal to its last
    # token (90 tokens at 20 tok/s: about 4.5 s), not one per token (a
    # stall of the engine that lets a stream through two steps in a row
    # splits one)
    assert 3 <= total["output_rate.throttle_episodes"] == sum(
        g["attributes"]["output_rate.throttle_episodes"] for g in a_gens) < 30
    assert len(throttles) == 3  # one per request: its longest episode
    # throttled for most of each request's generation (a token every 150
    # ms, a step a few ms: more than half of it while steps take under 75
    # ms; the generation span runs from its first token to its last, the
    # engine's own times), and never longer than the request lived as the
    # client saw it (stamped before sending, and at its last chunk: an
    # episode may start before the first token): the upper bound load-proof,
    # the lower one checked where its premise holds (below)
    generating_us = sum(g["end_ns"] - g["start_ns"] for g in a_gens) / 1e3
    lived_us = sum(r.last - r.started for r in results if r.user == "user-a") * 1e6
    assert generating_us >= 3 * 4_000_000, generating_us  # 30 tokens at 20/3 tok/s each
    assert 0 < total["output_rate.throttled_us"] <= lived_us, (total, generating_us, lived_us)
    # (the premise of "most of it": the engine kept pace with the limit, its
    # generation within 1.5 x what the limit takes, 29 spacings of 150 ms a
    # stream; a machine so loaded that steps take longer than the limit's
    # spacing throttles nobody, and the exact figure is checked in virtual
    # time: tests/virtual_time.md)
    if generating_us <= 1.5 * 3 * 29 * 150_000:
        assert 0.5 * generating_us <= total["output_rate.throttled_us"], (total, generating_us)
    assert 60 <= total["output_rate.tokens_charged"] <= 90
    (b,) = [g for g in gens if g["attributes"]["output_rate.user"] == "user-b"]
    assert b["parent_span_id"] == "" and b["trace_id"] not in parents  # a trace of its own
    for g in gens:
        a = g["attributes"]
        assert a["gen_ai.response.model"] == "tiny"
        assert a["gen_ai.response.finish_reasons"] == ["length"]
        assert len(a["output_rate.spacing_series_us"]) == a["gen_ai.usage.output_tokens"] - 1
    # vLLM's own request span: in the same trace, under the same parent,
    # with the same gen_ai.request.id
    vllm_spans = {s["trace_id"]: s for s in receiver.named("llm_request")}
    for trace, span in parents.items():
        mine, theirs = by_trace[trace], vllm_spans[trace]
        assert theirs["parent_span_id"] == span
        assert theirs["attributes"]["gen_ai.request.id"] == mine["attributes"]["gen_ai.request.id"]
    # the limited user's streams: 3 streams sharing 20 tok/s -> p50 ~ 150 ms
    a_p50 = sorted(g["attributes"]["output_rate.spacing_p50_us"] for g in gens
                   if g["attributes"]["gen_ai.usage.output_tokens"] == 30)
    assert all(120_000 <= p <= 180_000 for p in a_p50), a_p50


@pytest.mark.long  # (make test-all; the middleware's trace context: tests/test_frontend.py)
def test_only_otel_variables_put_the_spans_in_the_requests_traces():
    receiver = OtlpSpanReceiver()
    env = {"OUTPUT_RATE_TELEMETRY": "1",
           "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.base_url,  # the exporter adds /v1/traces
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_BSP_SCHEDULE_DELAY": "200"}
    args = [*ARGS, "--output-rate-user-header", "X-User"]  # no --otlp-traces-endpoint
    parents = {os.urandom(16).hex(): os.urandom(8).hex() for _ in range(2)}  # trace -> span
    plan = [("user-a", 20, {"traceparent": f"00-{trace}-{span}-01", "tracestate": "t=1"})
            for trace, span in parents.items()] + [("user-b", 20, {})]
    try:
        with Server(tiny_model(), args, REPO / ".cache" / "logs" / "e2e-traces-otel-only.log",
                    extra_env=env) as server:
            results = asyncio.run(_streams(server.base_url, plan))
            assert all(r.error is None and r.completion_tokens == r.max_tokens for r in results)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len(receiver.named("output_rate.generation")) < 3:
                time.sleep(0.5)
    finally:
        receiver.close()
    gens = receiver.named("output_rate.generation")
    assert len(gens) == 3, gens
    for g in gens:
        user = g["attributes"]["output_rate.user"]
        if user == "user-a":  # a child of the traceparent it came with
            assert parents.get(g["trace_id"]) == g["parent_span_id"], g
        else:
            assert g["parent_span_id"] == "" and g["trace_id"] not in parents
    assert {g["trace_id"] for g in gens} >= set(parents)
    assert receiver.named("llm_request") == []  # vLLM's own tracing is off


def test_an_unreachable_otlp_endpoint_costs_nothing_but_counted_drops(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    events = tmp_path / "events.jsonl"
    env = {"OUTPUT_RATE_TELEMETRY": "1", "OUTPUT_RATE_EVENTS": str(events),
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": dead,
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
           "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1",
           "OTEL_BSP_SCHEDULE_DELAY": "200"}
    with Server(tiny_model(), ARGS, REPO / ".cache" / "logs" / "e2e-traces-down.log",
                extra_env=env) as server:
        start = time.monotonic_ns()
        results = asyncio.run(run_load(server.base_url, [("user-a", 4, 60), ("user-b", 1, 200)]))
        assert [r.error for r in results if r.error] == []
        assert all(r.completion_tokens == r.max_tokens for r in results)
        # the limit, exactly, measured engine-side (the client sees chunks
        # bunched by HTTP): the GCRA bound in every window with one step of
        # slack, and the limit reached
        deadline = time.monotonic() + 30
        while True:  # the exporter appends the event log about once a second
            log = EngineLog.read(events)
            spends = log.user_spends("user-a", start)
            if sum(n for _, n in spends) >= 240 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert sum(n for _, n in spends) == 240
        worst = gcra_worst_window(spends, Fraction(LIMIT),
                                  log.dispatch_lower_bounds(t for t, _ in spends))
        assert worst["excess"] <= 0, worst
        # the lower side over the time the engine was stepping (a stall of
        # the shared cores costs for good: 8.7 tok/s first to last once, in
        # a loaded run); the exporter's failures must not slow the steps
        # themselves, so the rate while stepping holds the limit
        steps = [t for t, _ in log.steps]
        rate = rate_while_stepping(spends, steps, LIMIT)
        gaps = sorted((b - a) / 1e6 for a, b in zip(steps, steps[1:]) if spends[0][0] <= a <= spends[-1][0])
        print(f"user-a: {spend_rate(spends):.2f} tok/s first to last, {rate:.2f} while stepping; "
              f"step gaps p50 {gaps[len(gaps) // 2]:.1f} ms, max {gaps[-1]:.1f} ms, "
              f"{sum(g > 1000 / LIMIT for g in gaps)} over {1000 / LIMIT:.0f} ms")
        assert rate >= 0.9 * LIMIT, (rate, spend_rate(spends))
        deadline = time.monotonic() + 60
        dropped = 0.0
        while time.monotonic() < deadline:
            dropped = metric_value(scrape_metrics(server.base_url),
                                   "vllm_output_rate_telemetry_dropped_total",
                                   reason="trace_export_failed")
            if dropped > 0:
                break
            time.sleep(1)
        assert dropped > 0
        log = server.log_path.read_text(errors="replace")
        assert log.count("span(s) dropped (trace_export_failed)") == 1  # logged once, not per span
