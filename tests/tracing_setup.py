"""What the tracing modules (``test_tracing_*.py``) share: a scheduler with
telemetry and a span recorder on a TracerProvider made here with an
in-memory exporter (the ``exporter`` fixture), the ``telemetry_mode``
fixture (folded at once or deferred), the spans read back, a traceparent,
and three requests traced where the OTEL_* variables say."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from harness import Driver, VirtualClock, attach_telemetry, make_request, make_scheduler
from vllm_output_rate.internals import SchedulerView
from vllm_output_rate.tracing.provider import tracer_provider_from_env
from vllm_output_rate.tracing.recorder import SpanRecorder


SERIES = "output_rate.spacing_series_us"
TOKENS = "gen_ai.usage.output_tokens"


def series(span) -> list[int]:
    """A generation span's spacing series (whole microseconds): an integer
    array attribute."""
    values = span.attributes[SERIES]
    assert all(type(v) is int for v in values)
    return list(values)


def limits(default, **users):
    return {"default_user_output_tokens_per_second": default,
            "user_output_tokens_per_second": users}


@pytest.fixture
def exporter():
    return InMemorySpanExporter()


def setup(tmp_path, exporter, lim, background=True, throttle_min_s=0.0, **kw):
    """A scheduler with telemetry and a span recorder on a TracerProvider
    made here (so from the OTEL_* variables set now: sampler, span limits);
    every throttle episode gets a span unless ``throttle_min_s`` (None: the
    setting's)."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    clock = VirtualClock()
    sched = make_scheduler(lim, clock=clock, **kw)
    recorder = SpanRecorder(provider.get_tracer("test"), SchedulerView(sched), clock_offset_ns=0,
                            background=background)
    if throttle_min_s is not None:
        recorder.throttle_min_ns = int(throttle_min_s * 1e9)
    _RECORDERS[:] = [recorder]
    tel = attach_telemetry(sched, str(tmp_path), start_thread=False, spans=recorder,
                           defer=_DEFER[0])
    _TELEMETRY[:] = [tel]
    return sched, Driver(sched, clock, step_ms=10.0), tel, recorder


#: recorders and telemetry made by setup(): spans() folds what the
#: telemetry was handed and builds what the recorders queued first
_RECORDERS: list[SpanRecorder] = []
_TELEMETRY: list = []
#: whether setup()'s telemetry defers its folds to a drain (as with its
#: worker thread) or folds each event at once
_DEFER = [False]


@pytest.fixture(params=[False, True], ids=["folded-at-once", "deferred"])
def telemetry_mode(request):
    """The tests that use setup() run twice: events folded as they come,
    and deferred (folded only when spans are read: the requests are gone
    from the engine by then, as they may be when the worker drains)."""
    _DEFER[0] = request.param
    yield request.param
    _DEFER[0] = False


def spans(exporter, name):
    for tel in _TELEMETRY:
        tel.drain()
    for recorder in _RECORDERS:
        recorder.flush()
    return [s for s in exporter.get_finished_spans() if s.name == name]


TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def traceparent(trace_id=TRACE_ID, span_id=PARENT_ID, flags="01"):
    return f"00-{trace_id}-{span_id}-{flags}"


def three_requests_with_env_traces(tmp_path, also_to=None):
    """Three requests of a limited user (the first with a traceparent)
    through a scheduler whose spans go where the OTEL_* / project variables
    say, as the engine core builds them, and to the exporter ``also_to``
    if given; the recorder shut down (everything exported). (drops, driver,
    requests)."""
    from vllm_output_rate.tracing.drops import TraceDrops
    from vllm_output_rate.tracing.provider import tracer_from

    drops = TraceDrops(2048)
    provider = tracer_provider_from_env(None, drops)
    assert provider is not None
    if also_to is not None:
        provider.add_span_processor(SimpleSpanProcessor(also_to))
    clock = VirtualClock()
    sched = make_scheduler(limits(1000, a=10), clock=clock)
    recorder = SpanRecorder(tracer_from(provider), SchedulerView(sched), clock_offset_ns=0)
    recorder.drops, recorder.provider = drops, provider
    attach_telemetry(sched, str(tmp_path), start_thread=False, spans=recorder)
    drv = Driver(sched, clock, step_ms=10.0)
    reqs = [make_request("a", max_tokens=8) for _ in range(3)]
    reqs[0].trace_headers = {"traceparent": traceparent()}
    drv.add(*reqs)
    drv.run_until_done()
    recorder.shutdown(timeout_s=10)
    return drops, drv, reqs


def clear_otel_env(monkeypatch):
    for var in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(var, raising=False)


def cap_series(monkeypatch, series_mod, throttle_mod, cap):
    """The spacing series, and the episode durations kept per over-limit
    period, cut past ``cap``."""
    monkeypatch.setattr(series_mod, "MAX_SERIES", cap)
    monkeypatch.setattr(throttle_mod, "MAX_SERIES", cap)
