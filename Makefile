# Two commands do all the set-up on a fresh machine:
#   make demo   - tiny local model, served with per-user limits, load, results
#   make test   - the whole test suite (what CI runs)
PY := .venv/bin/python
# The scheduler-level suites, run a second time against vLLM 0.33 (CPU, no engine).
VLLM033_TESTS := tests/test_scheduler.py tests/test_live_limits.py tests/test_telemetry.py tests/test_tracing.py \
                 tests/test_plugin.py tests/test_layers.py tests/test_frontend.py tests/test_shared_state.py

.PHONY: venv tools vllm033 demo test test-vllm033 bench clean

venv:
	@scripts/bootstrap.sh

# Debian's prometheus/promtool for the rule tests and the dashboard integration
# test, Debian's nginx for the affinity-routing test, Debian's redis-server
# for the shared-budget tests
tools:
	@scripts/ensure_prometheus.sh
	@scripts/ensure_nginx.sh
	@scripts/ensure_redis.sh

# vLLM 0.33.0 in .cache/vllm-0.33 (no dependencies) for the second run below
vllm033: venv
	@scripts/ensure_vllm033.sh

demo: venv
	$(PY) -m vllm_output_rate.tools.demo

test: venv tools vllm033
	$(PY) -m pytest -q tests
	$(MAKE) --no-print-directory test-vllm033

test-vllm033: vllm033
	VLLM_TARGET_DEVICE=cpu PYTHONPATH=$(CURDIR)/.cache/vllm-0.33 EXPECT_VLLM_MINOR=0.33 \
	    $(PY) -m pytest -q $(VLLM033_TESTS)

bench: venv
	$(PY) -m vllm_output_rate.tools.bench_scheduler

clean:
	rm -rf .cache .pytest_cache .hypothesis
