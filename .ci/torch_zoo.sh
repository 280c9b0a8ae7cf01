#!/usr/bin/env bash
# CI: the torchvision zoo through both PyTorch ONNX exporters (tests marked `torch`).
# Installs the `torch` extra (the registry's torch and torchvision, which run on the CPU,
# and onnxscript for the dynamo exporter), then runs every `torch` test, slow ones included, and times it.
# JTILE_TORCH_QUICK=1 runs only the default subset (the `torch and not slow` tests).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

python -m pip install --quiet '.[test,torch]'
python -c "import torch, torchvision, onnxscript; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"

selection="torch"
if [ "${JTILE_TORCH_QUICK:-0}" = "1" ]; then
  selection="torch and not slow"
fi
start=$(date +%s)
python -m pytest -m "$selection" -p no:randomly --durations=15
echo "torch zoo tests (-m '$selection'): $(( $(date +%s) - start )) s"
