# Two commands do all the set-up on a fresh machine:
#   make demo   - tiny local model, served with per-user limits, load, results
#   make test   - the whole test suite (what CI runs)
PY := .venv/bin/python
# The scheduler-level suites: run on the CPU build (vLLM 0.32, in `tests`) and
# again against each other supported vLLM's wheel (CPU, no engine). The
# versions are one list: vllm_patch/versions.py (SUPPORTED).
SCHEDULER_SUITES := tests/test_scheduler_charging.py tests/test_scheduler_preemption.py \
                    tests/test_scheduler_idle.py tests/test_scheduler_slots.py \
                    tests/test_live_limits.py tests/test_telemetry_metrics.py \
                    tests/test_telemetry_events.py tests/test_telemetry_folds.py \
                    tests/test_telemetry_scenarios.py tests/test_tracing_throttle.py \
                    tests/test_tracing_steps.py tests/test_tracing_generation.py \
                    tests/test_tracing_context.py tests/test_tracing_export.py tests/test_plugin.py \
                    tests/test_layers.py tests/test_frontend.py tests/test_shared_state_leases.py \
                    tests/test_shared_state_fleet.py tests/test_shared_state_schedulers.py \
                    tests/test_engine_loop.py tests/test_twin.py tests/test_twin_tools.py \
                    tests/test_borrowing_limits.py tests/test_borrowing_lending.py \
                    tests/test_borrowing_telemetry.py tests/test_fairness.py tests/test_prompts.py \
                    tests/test_prompt_budget.py tests/test_prompts_shown.py tests/test_fleet_budgets.py \
                    tests/test_partition.py tests/test_held_tail.py

.PHONY: venv tools demo test test-all test-versions bench pictures docs clean

venv:
	@scripts/setup/bootstrap.sh

# Debian's prometheus/promtool for the rule tests and the dashboard integration
# test, Debian's nginx for the affinity-routing test, Debian's redis-server
# for the shared-budget tests
tools:
	@scripts/setup/ensure_prometheus.sh
	@scripts/setup/ensure_nginx.sh
	@scripts/setup/ensure_redis.sh

demo: venv
	$(PY) -m vllm_output_rate.tools.demo

# Two test workers (pytest-xdist), each module on one of them (the engine
# pool's modules as one): the modules that start engines mostly wait on
# paced streams (the suite keeps about one of two cores busy), the longest
# first (tests/conftest.py's SLOW_FIRST; --no-loadscope-reorder keeps that
# order, which xdist would otherwise sort by test count). Three were
# faster but left verify's rates to the machine (tests/README.md). The
# version matrix (CPU-bound, no engine) runs beside the suite at the lowest
# CPU priority (nice 19): it takes the cores only when the suite leaves them
# idle; its output follows the suite's, and either failing fails the target.
TEST_WORKERS ?= 2
MATRIX_WORKERS ?= 2
PYTEST_ARGS ?=
test: venv tools
	@mkdir -p .cache/logs; \
	nice -n 19 $(MAKE) --no-print-directory test-versions > .cache/logs/test-versions.log 2>&1 & \
	matrix=$$!; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS) tests; suite=$$?; \
	wait $$matrix; versions=$$?; \
	echo "--- the version matrix (make test-versions, beside the suite at nice 19):"; \
	cat .cache/logs/test-versions.log; \
	echo "--- suite: exit $$suite; version matrix: exit $$versions"; \
	test $$suite -eq 0 -a $$versions -eq 0

# Everything: make test, then the long runs: the short soaks against real
# engines (marker `long`, a few minutes), and behind RELIABILITY.md the
# stress runner's full profile (about 21 minutes) and the 30-minute soak
# (about 36)
test-all: test
	$(PY) -m pytest -q -m long tests
	$(PY) -m vllm_output_rate.tools.reliability.stress --profile full --out reports/stress-full
	$(PY) -m vllm_output_rate.tools.reliability.soak --minutes 30 --sample-s 60 --out reports/soak-30

# The version matrix: one run of the scheduler-level suites per wheel version.
test-versions: venv
	@set -e; for version in $$($(PY) -m vllm_output_rate.versions wheels); do \
	    $(MAKE) --no-print-directory test-vllm-$$version; done

# vLLM VERSION's wheel in .cache/vllm-VERSION (no dependencies), first on the path.
test-vllm-%: venv
	@scripts/setup/ensure_vllm_wheel.sh $*
	VLLM_TARGET_DEVICE=cpu PYTHONPATH=$(CURDIR)/.cache/vllm-$* EXPECT_VLLM_MINOR=$(basename $*) TEST_TIMELINE= \
	    $(PY) -m pytest -q -n $(MATRIX_WORKERS) $(SCHEDULER_SUITES)

bench: venv
	$(PY) -m vllm_output_rate.tools.bench.scheduler

# The README's pictures (docs/img/*.png) from a real run: verify's built-in
# scenario on the tiny model, a Prometheus on loopback scraping the engine
# (a few minutes on a 2-core CPU)
pictures: venv tools
	$(PY) -m vllm_output_rate.tools.verify --no-progress --report .cache/pictures \
	    --model "$$($(PY) -m vllm_output_rate.tools.common.tiny_model)" --pictures docs/img

# The reference pages generated from the code's tables (docs/metrics.md, ...)
docs: venv
	$(PY) -m vllm_output_rate.tools.gen_docs

clean:
	rm -rf .cache .pytest_cache .hypothesis
