"""OpenTelemetry traces of the output-rate limiter (throttle, charge, refund,
wake-up and per-request generation spans). Work in progress: see the
telemetry issue.
"""
