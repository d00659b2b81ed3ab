"""Session set-up shared by every test module."""

from __future__ import annotations

import os

import pytest

from vllm_output_rate.tools.scheduler_driver import cpu_platform_without_kernels


@pytest.fixture(autouse=True, scope="session")
def _vllm_configs_build_without_cpu_kernels():
    """Tests build ``VllmConfig``s (never an engine) beside vLLM wheels whose
    CPU platform refuses x86 without Triton (0.34): the scheduler-level suites
    run no model, so that check is passed over for the session."""
    with cpu_platform_without_kernels():
        yield


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs two workers), each worker's
    engines run their model on a core of their own: vLLM's CPU worker binds
    its OpenMP threads to core 0 by default, and two engines' workers on one
    core stall each other for seconds. Tests that bind engines themselves
    (the two-engine fleets) keep their own setting."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        cores = len(os.sched_getaffinity(0))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(int(worker[2:]) % cores))


#: The modules that start engines, longest first (tests/README.md,
#: durations): with two workers (``--dist loadfile``) each takes the next
#: module as it frees up, and starting the long ones first keeps one worker
#: from finishing a long module alone at the end. Other modules keep their
#: order after these.
SLOW_FIRST = (
    "test_soak.py", "test_e2e_shared_state.py", "test_verify_e2e.py", "test_stress.py",
    "test_e2e.py", "test_tools_second_model.py", "test_e2e_traces.py", "test_profile.py",
    "test_dashboards_e2e.py", "test_e2e_affinity.py", "test_bench_scheduler.py",
    "test_e2e_api_servers.py", "test_e2e_identity.py", "test_e2e_live_limits.py",
    "test_package.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
