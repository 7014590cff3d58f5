#!/usr/bin/env bash
# Builds what scripts/gpu_checks.sh runs on a GPU machine without cargo: every CUDA test binary
# of the engine (engine/tests/cuda_gpu.rs and the unit tests as cuda_lib, release, feature cuda) and the abi3 wheel, into .gpu/
# (ignored by git; carried to the device machine).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu && mkdir -p .gpu
cargo test --release -p ortrain-engine --features cuda --no-run --message-format json 2>/dev/null |
    python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    kind, name = m["target"]["kind"], m["target"]["name"]
    # the integration tests engine/tests/cuda_*.rs, and the unit tests (GPU parity lives there)
    dest = name if kind == ["test"] and name == "cuda_gpu" else "cuda_lib" if "lib" in kind else None
    if dest:
        shutil.copy(m["executable"], ".gpu/" + dest); print("test binary", dest)
'
# debug info would push the unit-test binary past what the device tool carries (64 MiB)
strip --strip-debug .gpu/cuda_*
.venv/bin/maturin build --release -q -m pyext/Cargo.toml -o .gpu/
# the ONNX node cases and the gradient-check cases for cuda_lib's node_cases and grad_cases
# tests (tests/conformance/cuda_export.py, tests/gradcheck_export.py), packed
.venv/bin/python -m tests.conformance.cuda_export target/node-cases
.venv/bin/python tests/gradcheck_export.py target/grad-cases
tar -czf .gpu/op-cases.tar.gz -C target node-cases grad-cases
ls -la .gpu
