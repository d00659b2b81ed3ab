"""The load generator: scenario files (``scenario``: users and their
limits, prompts, phases of streams; ``prompts``: prompt text of an exact
size in the server's tokens) and their run against an OpenAI-compatible
server, every chunk timed client-side (``run``: ``vllm-output-rate
loadgen``). The built-in scenario is ``scenarios/default.yaml``."""
