"""Engine-side metrics of the output-rate limiter.

- ``metrics``: the one table of metric names, types, units, help, buckets;
- ``labels``: the bounded ``user`` label (pinned + top-K + ``__other__``);
- ``engine``: the observer of the scheduler: per-step aggregation in the
  engine core and the snapshot exporter thread;
- ``collector``: the snapshots as Prometheus metrics on vLLM's ``/metrics``;
- ``events``: the engine event log's format, its encoder (``engine``) and
  reader (``vllm_output_rate.tools.verify``);
- ``plugin``: the ``vllm.general_plugins`` entry point that registers
  ``engine`` with ``vllm_output_rate.observers``.

The scheduler reports what it did in each step as plain data
(``vllm_output_rate.observers.StepReport``) and each idle wait of the engine
loop (``observers.IdleWait``); nothing here runs per token on the
scheduler's thread beyond plain in-memory arithmetic.
"""
