#!/usr/bin/env bash
# Sets everything up (scripts/bootstrap.sh) and runs the demo: the PyTorch nn.Transformer tutorial
# model trained from the same start in PyTorch eager and in ortrain, ms/step and loss for both.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
.venv/bin/python bench/tutorial_demo.py "$@"
