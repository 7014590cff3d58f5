#!/usr/bin/env bash
# Sets up everything a fresh machine needs: the pinned Python environment in .venv, the pinned
# CUDA 13.0 NVRTC wheels in .cuda-wheels (to compile the CUDA kernels; no GPU needed) and the
# ortrain wheel built from this checkout (release build, with the CUDA backend). Idempotent: a
# second run only rebuilds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "[bootstrap] creating .venv with $($python --version)"
    "$python" -m venv .venv
fi
stamp=".venv/.requirements.sha256"
want="$(sha256sum requirements.txt | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[bootstrap] installing pinned packages from requirements.txt (first time: several minutes)"
    .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
    echo "$want" > "$stamp"
fi
cuda_stamp=".cuda-wheels/.requirements.sha256"
want_cuda="$(sha256sum requirements-cuda.txt | cut -d' ' -f1)"
if [ "$(cat "$cuda_stamp" 2>/dev/null)" != "$want_cuda" ]; then
    echo "[bootstrap] installing the pinned CUDA 13.0 NVRTC wheels into .cuda-wheels (CI compiles every CUDA kernel with them)"
    rm -rf .cuda-wheels
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --target .cuda-wheels -r requirements-cuda.txt
    echo "$want_cuda" > "$cuda_stamp"
fi

if ! command -v cargo >/dev/null; then
    echo "[bootstrap] error: cargo (Rust) is needed to build the engine; install it from rustup.rs" >&2
    exit 1
fi
echo "[bootstrap] building the ortrain wheel (release)"
rm -rf target/wheels
.venv/bin/maturin build --release -q -m pyext/Cargo.toml --out target/wheels
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --force-reinstall target/wheels/ortrain-*.whl
echo "[bootstrap] ok: $(.venv/bin/python -c 'import ortrain; print("ortrain", ortrain.__version__)')"
