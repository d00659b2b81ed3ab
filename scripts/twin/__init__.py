"""The what-if twin: vLLM's own scheduler, its KV cache manager, the
plugin's limiter and the project's engine telemetry, advanced by a virtual
clock on a workload.

``Twin(TwinConfig(...))`` is one run (``config``, ``run``); the command
line is one way to make its config (``TwinConfig.from_argv``, ``cli``:
``vllm-output-rate twin run|compare|workload|calibrate|accuracy|scale``).
Beside it: the workloads (``workload``), the step-time model
(``step_time``) and its calibration (``calibrate``, ``calibration_load``,
``roofline``), what a run measures and writes (``report``, ``plots``),
several runs side by side (``compare``), the twin against real engines
(``accuracy``) and the twin's own speed at scale (``scale``).
"""

from vllm_output_rate.tools.twin.config import TwinConfig, TwinError, TwinLimits, engine_args
from vllm_output_rate.tools.twin.run import Twin

__all__ = ["Twin", "TwinConfig", "TwinError", "TwinLimits", "engine_args"]
