#!/usr/bin/env bash
# The GPU checks of doc/GPU-RUNS.md, for a GPU machine that has Python with torch but no cargo
# (the lent device machine): the CUDA test binaries and the abi3 wheel are built elsewhere
# (scripts/gpu_prepare.sh) into .gpu/, and this script runs them here.
#
#   bash scripts/gpu_checks.sh [OUT_DIR]      (what: $GPU_CHECKS, default "env,kernels,pytest,bench")
#
# Every section prints its own header and keeps going when one fails; the exit status is the
# number of failed sections. Logs and the bench JSON go to OUT_DIR (default /tmp/gpu-out).
set -u
OUT_DIR=${1:-/tmp/gpu-out}
mkdir -p "$OUT_DIR"
WHAT=${GPU_CHECKS:-env,kernels,pytest,bench}
PY=${PYTHON:-python3}
failed=0
has() { [[ ",$WHAT," == *",$1,"* ]]; }
section() { echo; echo "==== $1 ($(date +%T))"; }

# NVRTC and cuBLAS from the CUDA 13 wheels beside torch (nvidia/cu13/lib)
NV_LIB=$($PY - <<'EOF'
import glob, os, site
for d in site.getsitepackages():
    for hit in sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libnvrtc.so*"))):
        print(os.path.dirname(hit)); raise SystemExit
EOF
)
export ORTRAIN_NVRTC_LIB=${ORTRAIN_NVRTC_LIB:-$NV_LIB}
export LD_LIBRARY_PATH=${NV_LIB}:${LD_LIBRARY_PATH:-}

if has env; then
    section "environment"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    $PY -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
    echo "NVRTC/cuBLAS folder: $NV_LIB"; ls "$NV_LIB" | grep -E "nvrtc|cublas" | head
fi

if has kernels; then
    # the loader test twice: a cold NVRTC compile of every kernel file, then the disk cache
    if [ -x .gpu/cuda_gpu ]; then
        rm -rf /tmp/ortrain-cold && export ORTRAIN_CACHE_DIR=/tmp/ortrain-cold
        section "cuda_gpu, cold kernel cache"
        /usr/bin/time -f "cuda_gpu cold: %e s wall, %U s user" .gpu/cuda_gpu --nocapture 2>&1 | tee "$OUT_DIR/cuda_gpu.log" || failed=$((failed + 1))
        section "cuda_gpu, warm kernel cache"
        /usr/bin/time -f "cuda_gpu warm: %e s wall, %U s user" .gpu/cuda_gpu --nocapture 2>&1 | tail -4 || failed=$((failed + 1))
    fi
    # the engine's CUDA unit tests: kernel parity, cuBLAS, the executor (warm cache)
    if [ -x .gpu/cuda_lib ]; then
        section "engine CUDA unit tests"
        set -o pipefail
        /usr/bin/time -f "cuda_lib: %e s wall" .gpu/cuda_lib backend::cuda:: --test-threads 4 ${LIB_TEST_ARGS:-} 2>&1 | tee "$OUT_DIR/cuda_lib.log" | grep -vE "^test .* ok$" | tail -80 || failed=$((failed + 1))
        set +o pipefail
        grep -c "SKIPPED" "$OUT_DIR/cuda_lib.log" | sed 's/^/SKIPPED lines (must be 0 on a GPU): /'
    fi
fi

if has pytest || has bench; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ortrain-site .gpu/*.whl
    export PYTHONPATH=/tmp/ortrain-site
fi

if has pytest; then
    section "pytest -m gpu"
    $PY -m pytest -q -m gpu tests/test_cuda*.py -rs ${PYTEST_ARGS:-} 2>&1 | tee "$OUT_DIR/pytest-gpu.log" | tail -30
    [ "${PIPESTATUS[0]}" = 0 ] || failed=$((failed + 1))
fi

if has bench; then
    section "bench.gpu"
    PYTHONUNBUFFERED=1 $PY -m bench.gpu ${BENCH_ARGS:-} --json "$OUT_DIR/bench-gpu.json" || failed=$((failed + 1))
fi
echo "failed sections: $failed"
exit "$failed"
