"""OpenTelemetry spans of the output-rate limiter, from the engine core:
throttle episodes, refund steps, idle waits, per-request generation
(``tracing.spans``). Fed by ``telemetry.engine`` from the same plain data as
the metrics.
"""
