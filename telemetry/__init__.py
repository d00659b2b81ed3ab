"""Engine-side metrics of the output-rate limiter.

- ``metrics``: the one table of metric names, types, units, help, buckets;
- ``labels``: the bounded ``user`` label (pinned + top-K + ``__other__``);
- ``engine``: the observer of the scheduler (``EngineTelemetry``, ``attach``),
  made of, along the data's path: ``intake`` (the scheduler's thread: the
  hand-over and the reads of the engine made then), ``folds`` (the worker:
  each event into aggregates, with ``throttle``: charges, skips, throttle
  episodes, and ``spacing``: token timing; ``histograms``: the arithmetic),
  ``series`` and ``books`` (the per-user series and books), ``export`` and
  ``eventlog`` (the JSON snapshot and the event log, on the worker thread);
  ``records``: what the stages hand each other (a throttle episode worked out
  once by the intake, read by the metric folds and the spans alike);
- ``collector``: the snapshots as Prometheus metrics on vLLM's ``/metrics``;
- ``events``: the engine event log's format, its encoder (``eventlog``) and
  reader (``vllm_output_rate.tools.verify``);
- ``plugin``: the ``vllm.general_plugins`` entry point that registers
  ``engine`` with ``vllm_output_rate.observers``.

The scheduler reports what it did in each step as plain data
(``vllm_output_rate.observers.StepReport``) and each idle wait of the engine
loop (``observers.IdleWait``); nothing here runs per token on the
scheduler's thread beyond plain in-memory arithmetic.
"""
