"""Spans on their way out: no tracing without configuration, failed exports
and a full queue counted (and on the metrics), spans built off the
scheduler's thread, the real OTLP/HTTP exporter into a loopback receiver
(the endpoint, the service, vLLM's own tracer beside ours, an exporter
list), and the offline OTLP/JSON traces file."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from harness import Driver, OtlpHttpReceiver, VirtualClock, attach_telemetry, make_request, make_scheduler
from tracing_setup import (
    PARENT_ID,
    TOKENS,
    TRACE_ID,
    clear_otel_env,
    exporter,  # noqa: F401  (a fixture)
    limits,
    three_requests_with_env_traces,
)
from vllm_output_rate.internals import SchedulerView
from vllm_output_rate.tracing.provider import tracer_provider_from_env
from vllm_output_rate.tracing.recorder import THROTTLE_MIN_ENV, SpanRecorder


def test_no_tracing_without_configuration(monkeypatch):
    for var in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert tracer_provider_from_env(None) is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert tracer_provider_from_env(None) is not None


class _FailingExporter:
    """An exporter whose endpoint is down (the OTLP exporter returns FAILURE)."""

    def __init__(self, raise_instead=False):
        self.calls = 0
        self.raise_instead = raise_instead

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.calls += 1
        if self.raise_instead:
            raise ConnectionError("endpoint down")
        return SpanExportResult.FAILURE

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis=30000):
        return True


def _counting_provider(exporter, max_queue=2048):
    from vllm_output_rate.tracing.drops import TraceDrops, counting_processor

    drops = TraceDrops(max_queue)
    provider = TracerProvider()
    provider.add_span_processor(counting_processor(exporter, drops))
    return provider, drops


@pytest.mark.parametrize("raise_instead", [False, True])
def test_failed_exports_are_counted_and_reach_the_metrics(tmp_path, raise_instead):
    provider, drops = _counting_provider(_FailingExporter(raise_instead))
    clock = VirtualClock()
    sched = make_scheduler(limits(1000, a=10), clock=clock)
    recorder = SpanRecorder(provider.get_tracer("test"), SchedulerView(sched), clock_offset_ns=0)
    recorder.drops, recorder.provider = drops, provider
    tel = attach_telemetry(sched, str(tmp_path), start_thread=False, spans=recorder)
    drv = Driver(sched, clock, step_ms=10.0)
    drv.add(*[make_request("a", max_tokens=8) for _ in range(3)])
    drv.run_until_done()
    recorder.flush()
    provider.force_flush()
    assert drops.counts["trace_export_failed"] > 0
    assert drops.counts["trace_queue_full"] == 0
    assert not drops.pending  # nothing left counted as queued
    counters = {(n, tuple(l)): v for n, l, v in tel.snapshot()["counters"]}
    assert counters[("telemetry_dropped", ("trace_export_failed",))] == drops.counts[
        "trace_export_failed"]
    recorder.shutdown()


def test_a_full_span_queue_drops_and_counts_without_blocking():
    import threading

    from opentelemetry.sdk.trace.export import SpanExportResult

    gate = threading.Event()

    class Stuck(_FailingExporter):
        received = 0

        def export(self, spans):
            Stuck.received += len(spans)
            gate.wait(10)  # an exporter stuck on a dead endpoint
            return SpanExportResult.SUCCESS

    provider, drops = _counting_provider(Stuck(), max_queue=8)
    tracer = provider.get_tracer("test")
    for i in range(100):  # returns at once although nothing is exported
        tracer.start_span(f"s{i}").end()
    # at most 8 queued, at most one batch (8) in the stuck exporter, the rest
    # dropped; every span accounted for
    assert len(drops.pending) <= 8 and Stuck.received <= 8
    assert drops.counts["trace_queue_full"] == 100 - len(drops.pending) - Stuck.received >= 84
    gate.set()
    provider.shutdown()


def test_spans_reach_a_real_otlp_http_receiver(tmp_path, monkeypatch):
    """The real OTLP/HTTP exporter, configured by OTEL_* variables, against a
    receiver on loopback that decodes the protobuf requests."""
    receiver = OtlpHttpReceiver()
    try:
        monkeypatch.setenv(THROTTLE_MIN_ENV, "0")  # a span per throttle episode
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.url)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        drops, _drv, _reqs = three_requests_with_env_traces(tmp_path)
    finally:
        receiver.close()
    received = receiver.spans
    names = [n for n, _ in received]
    assert names.count("output_rate.generation") == 3
    assert "output_rate.throttle" in names
    gen = next(a for n, a in received if n == "output_rate.generation")
    assert gen[TOKENS].int_value == 8
    assert drops.counts == {"trace_queue_full": 0, "trace_export_failed": 0}


@pytest.mark.parametrize("service", [
    pytest.param({}, id="defaults"),
    pytest.param({"OTEL_SERVICE_NAME": "llm-gold"}, id="OTEL_SERVICE_NAME"),
    pytest.param({"OTEL_RESOURCE_ATTRIBUTES": "service.name=llm-eu,service.version=7,deployment.environment=prod"},
                 id="OTEL_RESOURCE_ATTRIBUTES"),
])
def test_a_base_endpoint_gets_the_traces_path_and_the_service_comes_from_the_environment(
        tmp_path, monkeypatch, service):
    """OTEL_EXPORTER_OTLP_ENDPOINT is a base URL: over http/protobuf spans go
    to its /v1/traces (at a real receiver); service.name / service.version
    come from the standard variables, ours only where they give none."""
    from importlib import metadata

    clear_otel_env(monkeypatch)
    for name, value in service.items():
        monkeypatch.setenv(name, value)
    receiver = OtlpHttpReceiver()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.base_url)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        drops, _drv, _reqs = three_requests_with_env_traces(tmp_path)
    finally:
        receiver.close()
    assert receiver.paths and set(receiver.paths) == {"/v1/traces"}
    assert [n for n, _ in receiver.spans].count("output_rate.generation") == 3
    resource = receiver.resources[0]
    want_name = {"OTEL_SERVICE_NAME": "llm-gold", "OTEL_RESOURCE_ATTRIBUTES": "llm-eu"}
    # unset: the SDK's default, what vLLM's own tracer provider carries too
    assert resource["service.name"] == next(
        (want_name[k] for k in service), "unknown_service:python")
    if "OTEL_RESOURCE_ATTRIBUTES" in service:
        assert resource["service.version"] == "7" and resource["deployment.environment"] == "prod"
    else:  # this package's version is its tracer's, not the service's
        assert "service.version" not in resource
    assert {v for _n, v in receiver.scopes} == {metadata.version("vllm-output-rate")}
    assert drops.counts == {"trace_queue_full": 0, "trace_export_failed": 0}


@pytest.mark.parametrize("service_name", [None, "llm-gold"])
def test_our_spans_and_vllms_own_land_in_one_service(monkeypatch, service_name):
    """vLLM's own tracer (``vllm.tracing.init_tracer``) and ours, in one
    process, export to one receiver: one service.name and one
    service.instance.id, with or without OTEL_SERVICE_NAME."""
    import os
    import subprocess
    import sys

    clear_otel_env(monkeypatch)
    receiver = OtlpHttpReceiver()
    env = {**os.environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    if service_name:
        env["OTEL_SERVICE_NAME"] = service_name
    script = ("import sys\n"
              "from opentelemetry.trace import get_tracer_provider\n"
              "from vllm.tracing import init_tracer\n"
              "from vllm_output_rate.tracing.provider import tracer_from, tracer_provider_from_env\n"
              "init_tracer('vllm.llm_engine', sys.argv[1]).start_span('vllm').end()\n"
              "ours = tracer_provider_from_env(sys.argv[1])\n"
              "tracer_from(ours).start_span('ours').end()\n"
              "ours.shutdown()\n"
              "get_tracer_provider().shutdown()\n")
    try:
        run = subprocess.run([sys.executable, "-c", script, receiver.url], env=env,
                             capture_output=True, text=True, timeout=300)
    finally:
        receiver.close()
    assert run.returncode == 0, run.stderr
    assert sorted(n for n, _ in receiver.spans) == ["ours", "vllm"]
    assert len(receiver.resources) == 2
    vllm_res, ours_res = sorted(receiver.resources, key=lambda r: "vllm.process_id" in r, reverse=True)
    assert "vllm.process_id" in vllm_res and "vllm.process_id" not in ours_res
    for key in ("service.name", "service.instance.id"):
        assert ours_res[key] == vllm_res[key], key
    assert ours_res["service.name"] == (service_name or "unknown_service:python")


def test_a_comma_separated_exporter_list_exports_to_each(monkeypatch):
    """OTEL_TRACES_EXPORTER=otlp,console: every span to a real receiver and
    to the console (in a process of its own, whose stdout is the console)."""
    import os
    import subprocess
    import sys

    clear_otel_env(monkeypatch)
    receiver = OtlpHttpReceiver()
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "otlp, console",
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    script = ("from vllm_output_rate.tracing.provider import tracer_from, tracer_provider_from_env\n"
              "p = tracer_provider_from_env(None)\n"
              "t = tracer_from(p)\n"
              "for i in range(3):\n"
              "    t.start_span('probe').end()\n"
              "p.shutdown()\n")
    try:
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=120)
    finally:
        receiver.close()
    assert run.returncode == 0, run.stderr
    assert run.stdout.count('"name": "probe"') == 3
    assert [n for n, _ in receiver.spans] == ["probe"] * 3
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console,none")
    assert tracer_provider_from_env(None) is None  # none wins


def test_spans_are_built_off_the_schedulers_thread_with_a_bounded_counted_queue(tmp_path, exporter):
    """The scheduler's thread only queues plain data: no SDK span exists
    until the builder (here: flush) runs; past the queue's bound spans are
    dropped and counted, and a span that cannot be built is counted while
    the rest are built."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    clock = VirtualClock()
    sched = make_scheduler(limits(1000, a=20), clock=clock)
    rec = SpanRecorder(provider.get_tracer("test"), SchedulerView(sched), clock_offset_ns=0, background=False)
    rec.drops.max_queue = 6
    attach_telemetry(sched, str(tmp_path), start_thread=False, spans=rec)
    drv = Driver(sched, clock, step_ms=10.0)
    drv.add(*[make_request("a", max_tokens=6) for _ in range(4)])
    drv.run_until_done()
    assert not exporter.get_finished_spans()  # nothing built on the scheduler's thread
    queued, dropped = len(rec._pending), rec.drops.counts["trace_queue_full"]
    assert queued == 6 and dropped > 0
    broken = rec._pending[0]
    assert broken[0].__name__.lstrip("_").startswith(("build_", "replay_"))
    rec._pending[0] = (lambda: 1 / 0, ())
    rec.flush()  # a broken entry is counted, the rest go on
    assert rec.drops.counts["trace_export_failed"] == 1
    assert not rec._pending
    # every update and step with something for the builder: all accounted
    # for, queued or dropped
    assert dropped + queued >= drv.steps


def _any_value(value):
    """An OTLP AnyValue as the SDK holds attribute values (arrays as tuples)."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_any_value(v) for v in value.array_value.values)
    return getattr(value, kind)


def _from_otlp_json(line: str):
    """One line of the traces file back into an ExportTraceServiceRequest:
    the ids are hex there (OTLP/JSON), base64 in protobuf's own JSON
    mapping, which json_format.Parse reads (and refuses unknown fields)."""
    import base64
    import json
    import re

    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    doc = json.loads(line)
    assert set(doc) == {"resourceSpans"}
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                assert isinstance(span["kind"], int)  # enums as integers
                assert isinstance(span["startTimeUnixNano"], str)  # int64 as a string
                for obj in [span, *span.get("links", ())]:
                    for field, digits in (("traceId", 32), ("spanId", 16), ("parentSpanId", 16)):
                        if field in obj:
                            assert re.fullmatch(f"[0-9a-f]{{{digits}}}", obj[field]), obj[field]
                            obj[field] = base64.b64encode(bytes.fromhex(obj[field])).decode()
    return json_format.Parse(json.dumps(doc), ExportTraceServiceRequest())


@pytest.mark.parametrize("writable", [True, False])
def test_offline_traces_are_an_otlp_json_file(tmp_path, monkeypatch, writable):
    """OUTPUT_RATE_TRACES_FILE: every line one ExportTraceServiceRequest in
    OTLP/JSON (lowerCamelCase, hex ids, integer enums), as the Collector's
    otlpjsonfile receiver reads it; parsed back it holds exactly the spans
    the SDK made (names, ids, parents, times, attributes including the
    integer series). A file that cannot be written is a counted export
    failure, the engine goes on."""
    from importlib import metadata

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from vllm_output_rate.tracing.provider import TRACES_FILE_ENV

    path = tmp_path / ("traces.jsonl" if writable else "missing-dir/traces.jsonl")
    clear_otel_env(monkeypatch)
    monkeypatch.setenv(TRACES_FILE_ENV, str(path))
    monkeypatch.setenv(THROTTLE_MIN_ENV, "0")  # a span per throttle episode
    made = InMemorySpanExporter()
    drops, drv, reqs = three_requests_with_env_traces(tmp_path, also_to=made)
    assert all(drv.count(r.request_id) == 8 for r in reqs)
    if not writable:
        assert not path.exists()
        assert drops.counts["trace_export_failed"] >= 3 + 1  # every span, counted
        return
    assert drops.counts == {"trace_queue_full": 0, "trace_export_failed": 0}
    lines = path.read_text().splitlines()
    assert lines
    got = {}
    for line in lines:
        request = _from_otlp_json(line)
        for rs in request.resource_spans:
            resource = {a.key: _any_value(a.value) for a in rs.resource.attributes}
            assert resource["service.name"] == "unknown_service:python"
            for ss in rs.scope_spans:
                assert ss.scope.name == "vllm_output_rate"
                assert ss.scope.version == metadata.version("vllm-output-rate")
                for span in ss.spans:
                    got[span.span_id] = span
    sdk = {s.context.span_id.to_bytes(8, "big"): s for s in made.get_finished_spans()}
    assert set(got) == set(sdk)  # every span, once
    for span_id, span in got.items():
        want = sdk[span_id]
        assert span.name == want.name
        assert span.trace_id == want.context.trace_id.to_bytes(16, "big")
        assert span.parent_span_id == (
            want.parent.span_id.to_bytes(8, "big") if want.parent else b"")
        assert (span.start_time_unix_nano, span.end_time_unix_nano) == (want.start_time,
                                                                        want.end_time)
        assert {a.key: _any_value(a.value) for a in span.attributes} == dict(want.attributes)
    names = [s.name for s in got.values()]
    assert names.count("output_rate.generation") == 3 and "output_rate.throttle" in names
    child = [s for s in got.values() if s.attributes and any(
        a.key == "output_rate.request_id" and a.value.string_value == reqs[0].request_id
        for a in s.attributes)]
    assert {s.name for s in child} == {"output_rate.generation", "output_rate.throttle"}
    assert all(s.trace_id.hex() == TRACE_ID and s.parent_span_id.hex() == PARENT_ID
               for s in child)
    gen = next(s for s in child if s.name == "output_rate.generation")
    attrs = {a.key: a.value for a in gen.attributes}
    assert attrs["gen_ai.usage.output_tokens"].int_value == 8
    values = attrs["output_rate.spacing_series_us"].array_value.values
    assert len(values) == 7 and all(v.WhichOneof("value") == "int_value" for v in values)
