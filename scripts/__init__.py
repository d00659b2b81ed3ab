"""User-side tools of vllm-output-rate, installed as ``vllm_output_rate.tools``.

Nothing here runs inside vLLM's processes, and nothing on the engine side
(``vllm_output_rate`` itself, ``.telemetry``, ``.tracing``) imports it.

- ``cli``: the ``vllm-output-rate`` command (serve, demo, loadgen, verify, profile)
- ``demo``: the tiny model served with limits, load driven, results shown
- ``loadgen``, ``client``: scenario files and the streaming OpenAI client
  (one streaming loop, ``client.stream_into``, for both)
- ``stats``: the quantile of the reports
- ``verify``: engine-side ITL verification before launch
- ``profile_engine``: py-spy schedule-cost report
- ``tiny_model``: the locally generated model and tokenizer
- ``scheduler_driver``: the real vLLM scheduler driven with a fake clock
  (benchmarks and tests)
- ``bench_scheduler``, ``compare_upstream``, ``grafana_provision``,
  ``prom_pictures``: benchmarks and operator scripts (``python -m``)
"""
