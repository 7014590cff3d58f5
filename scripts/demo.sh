#!/usr/bin/env bash
# Sets everything up (scripts/bootstrap.sh) and runs the demo: the PyTorch nn.Transformer tutorial
# notebook executed headless with `%%ort compare` (PyTorch, then ortrain, from the same state),
# logged to a local MLflow store (./mlflow.db), with the comparison table printed.
# Usage: bash scripts/demo.sh [STEPS]   (default 100 steps per run)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
PYTHONUNBUFFERED=1 .venv/bin/python scripts/run_notebook.py "${1:-100}"
