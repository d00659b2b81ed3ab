"""Benchmarks: the scheduler's cost with the limiter on and off
(``scheduler``: ``python -m vllm_output_rate.tools.bench.scheduler``),
where the engine-core process spends its time (``profile_engine``, its
samples in ``profile_stacks``: ``vllm-output-rate profile``), side by side
with upstream vLLM on the CPU engine (``compare_upstream``) and what
affinity routing costs in balance (``affinity_balance``)."""
