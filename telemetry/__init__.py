"""Prometheus metrics of the output-rate limiter (engine-side).

The scheduler already exposes what it did in each step as plain data
(``vllm_patch.scheduler.OutputRateStep``) and each idle wait of the engine
loop (``vllm_patch.engine_loop.IdleWait``); this package turns them into
metrics. Work in progress: see the telemetry issue.
"""
