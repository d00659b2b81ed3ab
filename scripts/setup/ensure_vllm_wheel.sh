#!/usr/bin/env bash
# vLLM VERSION (its CUDA wheel: the CPU build stays at 0.32.0) beside the
# project's venv, for the scheduler-level tests against that version:
# installed with --no-deps into a folder of its own (.cache/vllm-VERSION), put
# first on PYTHONPATH by `make test-vllm-VERSION`, imported with
# VLLM_TARGET_DEVICE=cpu over the CPU build's torch. Its CUDA kernels are
# absent: no engine runs there, only the scheduler.
#   scripts/setup/ensure_vllm_wheel.sh 0.34.0
set -euo pipefail
cd "$(dirname "$0")/../.."
version="${1:?usage: ensure_vllm_wheel.sh VERSION}"
target=".cache/vllm-$version"
if [ -f "$target/.ready" ]; then exit 0; fi
echo "ensure_vllm_wheel: installing vllm==$version (no dependencies) into $target"
rm -rf "$target"
.venv/bin/python -m pip install --quiet --no-deps --target "$target" "vllm==$version"
touch "$target/.ready"
