"""End to end: the engine core's spans through the real OTLP exporters.

- A receiver on loopback (OTLP over HTTP, protobuf decoded with the
  OpenTelemetry proto classes) gets the throttle and generation spans of a
  real engine serving a limited and an unlimited user.
- With the OTLP endpoint down (gRPC to a closed port), the engine serves at
  the limit exactly as before and the drop counter on /metrics rises.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from harness import REPO, OtlpHttpReceiver, tiny_model
from vllm_patch.client import Server, free_port, metric_value, run_load, scrape_metrics, summarize

pytestmark = pytest.mark.e2e

LIMIT = 20
ARGS = ["--max-num-seqs", "16", "--max-model-len", "1024",
        "--default-user-output-tokens-per-second", "100000",
        "--user-output-tokens-per-second", json.dumps({"user-a": LIMIT, "user-b": 100000})]


def _string(value) -> str:
    return value.string_value


def test_spans_of_a_real_engine_reach_an_otlp_receiver():
    receiver = OtlpHttpReceiver()
    env = {"VLLM_OUTPUT_RATE_TELEMETRY": "1",
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
           "OTEL_BSP_SCHEDULE_DELAY": "200"}
    try:
        with Server(tiny_model(), ARGS, REPO / ".cache" / "logs" / "e2e-traces.log",
                    extra_env=env) as server:
            results = asyncio.run(run_load(server.base_url, [("user-a", 3, 30), ("user-b", 1, 60)]))
            assert all(r.error is None and r.completion_tokens == r.max_tokens for r in results)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                gens = [a for n, a in receiver.spans if n == "output_rate.generation"]
                if len(gens) >= 4:
                    break
                time.sleep(0.5)
    finally:
        receiver.close()
    gens = [a for n, a in receiver.spans if n == "output_rate.generation"]
    assert sorted(a["output_rate.tokens"].int_value for a in gens) == [30, 30, 30, 60]
    throttles = [a for n, a in receiver.spans if n == "output_rate.throttle"]
    assert throttles and {_string(a["output_rate.user"]) for a in throttles} == {"user-a"}
    assert all(a["output_rate.kv_blocks"].int_value > 0 for a in throttles)
    # the limited user's streams: 3 streams sharing 20 tok/s -> p50 ~ 150 ms
    a_p50 = sorted(a["output_rate.spacing_p50_us"].int_value for a in gens
                   if a["output_rate.tokens"].int_value == 30)
    assert all(120_000 <= p <= 180_000 for p in a_p50), a_p50


def test_an_unreachable_otlp_endpoint_costs_nothing_but_counted_drops():
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {"VLLM_OUTPUT_RATE_TELEMETRY": "1",
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": dead,
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
           "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1",
           "OTEL_BSP_SCHEDULE_DELAY": "200"}
    with Server(tiny_model(), ARGS, REPO / ".cache" / "logs" / "e2e-traces-down.log",
                extra_env=env) as server:
        results = asyncio.run(run_load(server.base_url, [("user-a", 4, 60), ("user-b", 1, 200)]))
        assert [r.error for r in results if r.error] == []
        assert all(r.completion_tokens == r.max_tokens for r in results)
        s = {x.user: x for x in summarize(results, {})}["user-a"]
        # the same bounds as with traces off (test_e2e): the limit, exactly
        assert s.tokens <= (s.span_s + 0.1 + 0.05) * LIMIT + 1, s
        assert s.rate >= 0.97 * LIMIT, s
        deadline = time.monotonic() + 60
        dropped = 0.0
        while time.monotonic() < deadline:
            dropped = metric_value(scrape_metrics(server.base_url),
                                   "output_rate_telemetry_dropped_total",
                                   reason="trace_export_failed")
            if dropped > 0:
                break
            time.sleep(1)
        assert dropped > 0
        log = server.log_path.read_text(errors="replace")
        assert log.count("span(s) dropped (trace_export_failed)") == 1  # logged once, not per span
