"""Session set-up shared by every test module."""

from __future__ import annotations

import pytest

from vllm_output_rate.tools.scheduler_driver import cpu_platform_without_kernels


@pytest.fixture(autouse=True, scope="session")
def _vllm_configs_build_without_cpu_kernels():
    """Tests build ``VllmConfig``s (never an engine) beside vLLM wheels whose
    CPU platform refuses x86 without Triton (0.34): the scheduler-level suites
    run no model, so that check is passed over for the session."""
    with cpu_platform_without_kernels():
        yield
