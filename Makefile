# Two commands do all the set-up on a fresh machine:
#   make demo   - tiny local model, served with per-user limits, load, results
#   make test   - the whole test suite (what CI runs)
PY := .venv/bin/python

.PHONY: venv tools demo test bench clean

venv:
	@scripts/bootstrap.sh

# Debian's prometheus/promtool for the rule tests and the dashboard integration test
tools:
	@scripts/ensure_prometheus.sh

demo: venv
	$(PY) scripts/demo.py

test: venv tools
	$(PY) -m pytest -q tests

bench: venv
	$(PY) scripts/bench_scheduler.py

clean:
	rm -rf .cache .pytest_cache .hypothesis
