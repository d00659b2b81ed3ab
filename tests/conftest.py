"""Session set-up shared by every test module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_output_rate.tools.common.scheduler_driver import cpu_platform_without_kernels


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


#: The modules that start engines, longest first (their busy seconds in a
#: clean run, ``TEST_TIMELINE``; tests/README.md): with two workers
#: (``--dist loadfile --no-loadscope-reorder``: xdist's default reorder by
#: test count would override this order) each takes the next module as it
#: frees up; the long ones first, the short unit modules last, so that both
#: workers end together. Other modules keep their order after these.
SLOW_FIRST = (
    # the engine pool's modules, one unit of work (POOL_SCOPE); verify's
    # last: its last test stops the engine it used in the middle of a run
    "test_e2e.py", "test_e2e_live_limits.py", "test_e2e_borrowing.py", "test_profile.py",
    "test_e2e_prompts.py", "test_verify_e2e.py",
    "test_e2e_shared_state.py", "test_e2e_traces.py", "test_stress.py",
    "test_tools_second_model.py", "test_e2e_api_servers.py", "test_dashboards_e2e.py",
    "test_package.py", "test_e2e_identity.py", "test_e2e_affinity.py",
    "test_bench_scheduler.py", "test_soak.py",
)

#: The modules that take their engines from the session's pool (the
#: ``engines`` fixture, tests/engine_pool.py): one unit of work for
#: pytest-xdist, so that they run on one worker and each pooled
#: configuration starts once.
POOL_MODULES = ("test_e2e.py", "test_e2e_live_limits.py", "test_e2e_borrowing.py", "test_profile.py",
                "test_e2e_prompts.py", "test_verify_e2e.py")
POOL_SCOPE = "tests/engine-pool"


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the pool's modules as one file."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class PoolAwareFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return POOL_SCOPE if Path(scope).name in POOL_MODULES else scope

    return PoolAwareFileScheduling(config, log)


_POOLS: list = []


@pytest.fixture(scope="session")
def engines(tmp_path_factory):
    """The session's engine pool (tests/engine_pool.py)."""
    from engine_pool import EnginePool

    pool = EnginePool(tmp_path_factory.mktemp("engine-pool"))
    _POOLS.append(pool)
    yield pool
    pool.close()


def pytest_runtest_teardown(item, nextitem):
    """The pool's engines stop when its modules are done (they run as one
    unit of work, one after another): idle engines would hold memory and
    some CPU while this worker goes on with other modules."""
    if _POOLS and item.path.name in POOL_MODULES and (
            nextitem is None or nextitem.path.name not in POOL_MODULES):
        for pool in _POOLS:
            pool.close()


def pytest_runtest_logreport(report):
    """With ``TEST_TIMELINE=FILE``, one JSON line per test phase: the worker,
    the test, the phase, its start and end (wall clock) and outcome; what
    `make test` spent where, per worker (``tests/timeline.py`` sums
    it)."""
    path = os.environ.get("TEST_TIMELINE")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # written once, by the controller (or a run without workers)
    import json

    node = getattr(report, "node", None)
    worker = node.gateway.id if node is not None else "main"
    with open(path, "a") as f:
        f.write(json.dumps({"worker": worker, "test": report.nodeid, "when": report.when,
                            "start": report.start, "stop": report.stop,
                            "outcome": report.outcome}) + "\n")
