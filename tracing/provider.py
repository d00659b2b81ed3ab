"""The tracer provider from the environment: whether traces are on, the
resource (the SDK's, as vLLM's own tracing makes it), the exporters and the counting
processor in front of them, and the tracer the recorder's spans go to.

Where the data's path is set up: ``telemetry.engine`` makes the provider
(``tracer_provider_from_env``) and the recorder (``recorder``) on its tracer
(``tracer_from``); the exporters are in ``exporters``, the processor and
its drop counts in ``drops``.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_output_rate import settings
from vllm_output_rate.tracing.drops import TraceDrops, counting_processor
from vllm_output_rate.tracing.exporters import FanOutExporter, OtlpJsonFileExporter, otlp_exporter

#: A file path: spans appended there as JSON lines (offline use).
TRACES_FILE_ENV = settings.name("TRACES_FILE")
_TRACER_NAME = "vllm_output_rate"

logger = logging.getLogger("vllm_output_rate.tracing")


def tracer_provider_from_env(otlp_endpoint: str | None = None,
                             drops: TraceDrops | None = None) -> Any | None:
    """A TracerProvider from the standard ``OTEL_*`` variables or vLLM's
    ``--otlp-traces-endpoint``; None when tracing is not asked for.

    ``OTEL_TRACES_EXPORTER``: a comma-separated list of ``otlp`` (the default
    when an endpoint is set), ``console`` and ``none``;
    ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``:
    ``grpc`` (default) or ``http/protobuf``. The endpoint variables keep
    their OpenTelemetry meaning, read by the SDK's exporter itself:
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is the traces URL as given,
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` a base URL (over HTTP the exporter adds
    ``/v1/traces``). vLLM's ``--otlp-traces-endpoint`` is a traces endpoint,
    as vLLM uses it. The resource is the SDK's (``OTEL_RESOURCE_ATTRIBUTES``,
    ``OTEL_SERVICE_NAME``, else the SDK's ``unknown_service:python``), as
    vLLM's own tracer provider makes it: the spans land in the service of the
    vLLM process they come from. This package's version is the tracer's
    (the instrumentation scope's), not the service's.
    For offline use, ``OUTPUT_RATE_TRACES_FILE``: append the spans to
    that file in OTLP/JSON, one export request per line, as the
    Collector's ``otlpjsonfile`` receiver reads them (instead of the
    console or an OTLP endpoint; ``OTEL_TRACES_EXPORTER=none`` still turns
    traces off).
    """
    if not settings.traces_requested(otlp_endpoint):
        return None
    names = settings.trace_exporter_names()
    path = settings.get("TRACES_FILE") or ""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=_resource())
    exporters: list[Any] = []
    if path:
        exporters.append(OtlpJsonFileExporter(path))
    else:
        for name in names or ["otlp"]:
            if name == "console":
                exporters.append(ConsoleSpanExporter())
            elif name == "otlp":
                exporters.append(otlp_exporter(otlp_endpoint))
            else:
                logger.warning("OTEL_TRACES_EXPORTER: %r is not an exporter of "
                               "vllm-output-rate (otlp, console, none); ignored", name)
        if not exporters:
            return None
    exporter = exporters[0] if len(exporters) == 1 else FanOutExporter(exporters)
    if drops is None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    else:
        provider.add_span_processor(counting_processor(exporter, drops))
    return provider


def _resource() -> Any:
    """The SDK's resource from the environment, as vLLM's own tracing
    (``vllm.tracing.otel``) creates it: no service name of ours, so with
    ``OTEL_SERVICE_NAME`` unset a vLLM process and its limiter are one
    service."""
    from opentelemetry.sdk.resources import Resource

    return Resource.create()


def tracer_from(provider: Any) -> Any:
    """The tracer of this package on ``provider``."""
    from importlib import metadata

    try:
        version = metadata.version("vllm-output-rate")
    except metadata.PackageNotFoundError:  # pragma: no cover - not installed
        version = None
    return provider.get_tracer(_TRACER_NAME, version)
