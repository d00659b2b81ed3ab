#!/usr/bin/env bash
# vLLM 0.33.0 (its CUDA build: the CPU build stays at 0.32.0) beside the
# project's venv, for the scheduler-level tests against 0.33: installed with
# --no-deps into a folder of its own (.cache/vllm-0.33), put first on
# PYTHONPATH by `make test`, imported with VLLM_TARGET_DEVICE=cpu over the
# CPU build's torch. Its CUDA kernels are absent: no engine runs there.
set -euo pipefail
cd "$(dirname "$0")/.."
target=.cache/vllm-0.33
if [ -f "$target/.ready" ]; then exit 0; fi
echo "ensure_vllm033: installing vllm==0.33.0 (no dependencies) into $target"
rm -rf "$target"
.venv/bin/python -m pip install --quiet --no-deps --target "$target" vllm==0.33.0
touch "$target/.ready"
