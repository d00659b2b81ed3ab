"""vllm-output-rate: per-user output-token rate limits in vLLM's V1 scheduler.

Pure modules (no vLLM import): ``config``, ``limiter``, ``internals``.
vLLM-facing modules: ``scheduler``, ``engine_loop``, ``plugin``, ``cli``.
"""

__version__ = "0.1.0"
