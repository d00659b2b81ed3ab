"""vllm-output-rate: per-user output-token rate limits in vLLM's V1 scheduler.

This package (the repository's ``vllm_patch/``) is what runs inside vLLM's
processes: ``config``, ``limiter`` (pure, no vLLM import), ``internals``
(every vLLM internal touched, with its version), ``observers`` (the contract
telemetry plugs into), ``scheduler``, ``engine_loop`` and ``plugin``.

Beside it, in the same installed namespace: ``vllm_output_rate.telemetry``
and ``vllm_output_rate.tracing`` (observers of the engine),
``vllm_output_rate.dashboards`` and ``vllm_output_rate.tools`` (user side).
Imports point one way: tools -> dashboards -> telemetry/tracing -> this.
"""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("vllm-output-rate")
except _metadata.PackageNotFoundError:  # pragma: no cover - not installed
    __version__ = "0.0.0+unknown"
