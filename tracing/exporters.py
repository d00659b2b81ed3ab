"""The exporters the span processor sends to: OTLP (gRPC or HTTP), several at
once (``FanOutExporter``), and an OTLP/JSON file for offline use
(``OtlpJsonFileExporter``).

The end of the data's path: ``provider`` picks them from the ``OTEL_*``
variables and puts them behind the counting processor (``drops``).
"""

from __future__ import annotations

import os
from typing import Any


def otlp_exporter(traces_endpoint: str | None) -> Any:
    """The SDK's OTLP span exporter, over the protocol the ``OTEL_*``
    variables name (gRPC unless HTTP)."""
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    # Only vLLM's flag is passed: the exporter reads the OTEL_* endpoints
    # itself, and adds the signal path to a base URL where the spec says so.
    return OTLPSpanExporter(endpoint=traces_endpoint) if traces_endpoint else OTLPSpanExporter()


class FanOutExporter:
    """Several exporters as one (``OTEL_TRACES_EXPORTER=otlp,console``): each
    gets every batch; the batch failed if any of them failed."""

    def __init__(self, exporters: list[Any]) -> None:
        self.exporters = exporters

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        ok = True
        for exporter in self.exporters:
            try:
                ok &= exporter.export(spans) is SpanExportResult.SUCCESS
            except Exception:
                ok = False
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        for exporter in self.exporters:
            exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return all(exporter.force_flush(timeout_millis) for exporter in self.exporters)


#: the fields of OTLP's trace messages that hold a trace or span id (bytes):
#: hex strings in OTLP/JSON, not protobuf JSON's base64
_OTLP_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def otlp_json(spans: Any) -> str:
    """``spans`` (SDK ReadableSpans) as one ``ExportTraceServiceRequest`` in
    OTLP/JSON, as the OpenTelemetry protocol specifies it (and the
    Collector's ``otlpjsonfile`` receiver and file exporter use it, one
    request per line): the SDK's own protobuf encoding (the one its OTLP
    exporters send) in protobuf's JSON mapping, field names lowerCamelCase,
    enums as integers, 64-bit integers as strings, and trace and span ids
    (also of links) as hex strings. No newline in it."""
    import json

    from google.protobuf import json_format
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    message = json_format.MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    for resource_spans in message.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                _hex_ids(span)
                for link in span.get("links", ()):
                    _hex_ids(link)
    return json.dumps(message, separators=(",", ":"))


def _hex_ids(obj: dict[str, Any]) -> None:
    import base64

    for field in _OTLP_ID_FIELDS:
        value = obj.get(field)
        if value:
            obj[field] = base64.b64decode(value).hex()


class OtlpJsonFileExporter:
    """Spans appended to a file in OTLP/JSON: one ``ExportTraceServiceRequest``
    per line (a batch per line, ``otlp_json``), each line written with one
    ``write`` on a file opened for appending (engines of several processes
    may share the file). A file that cannot be written fails the export
    (counted as ``trace_export_failed`` by the processor)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        if not spans:
            return SpanExportResult.SUCCESS
        data = (otlp_json(spans) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
