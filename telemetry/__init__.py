"""Engine-side metrics of the output-rate limiter.

- ``metrics``: the one table of metric names, types, units, help, buckets;
- ``labels``: the bounded ``user`` label (pinned + top-K + ``__other__``);
- ``engine``: per-step aggregation in the engine core and the snapshot
  exporter thread;
- ``collector``: the snapshots as Prometheus metrics on vLLM's ``/metrics``.

The scheduler exposes what it did in each step as plain data
(``vllm_patch.scheduler.OutputRateStep``) and each idle wait of the engine
loop (``vllm_patch.engine_loop.IdleWait``); nothing here runs per token on
the scheduler's thread beyond plain in-memory arithmetic.
"""
