"""User-side tools of vllm-output-rate, installed as ``vllm_output_rate.tools``.

Nothing here runs inside vLLM's processes, and nothing on the engine side
(``vllm_output_rate`` itself, ``.telemetry``, ``.tracing``) imports it.

- ``cli``: the ``vllm-output-rate`` command (serve and the subcommands of
  ``cli.COMMANDS``); ``demo``, ``check_limits``: two of them
- ``common``: what the tools share: the streaming client and server runner,
  statistics, the tiny model, the scheduler driven on a virtual clock, help text
- ``loadgen``: scenario files and their load (``vllm-output-rate loadgen``)
- ``verify``: engine-side verification of a scenario run (``verify``)
- ``twin``: the what-if twin (``twin``)
- ``fairness``: the fairness benchmark (``fairness``)
- ``reliability``: the fault matrix and the soak (``stress``, ``soak``)
- ``bench``: benchmarks and the engine-core profile (``profile``)
- ``gen_docs``, ``grafana_provision``, ``prom_pictures``: the reference
  pages, Grafana provisioning, dashboard pictures without Grafana
  (``python -m``); ``fleet_sim``, ``redis_server``: shared budgets across
  engines against a real Redis or Redis Cluster
"""
