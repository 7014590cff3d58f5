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
    for t in .gpu/cuda_*; do
        [ -x "$t" ] || continue
        name=$(basename "$t")
        filter=""; [ "$name" = cuda_lib ] && filter="backend::cuda::"  # the unit tests: CUDA ones only
        section "$name, cold kernel cache"
        rm -rf /tmp/ortrain-cold && export ORTRAIN_CACHE_DIR=/tmp/ortrain-cold
        /usr/bin/time -f "$name cold: %e s wall, %U s user" "$t" $filter --nocapture --test-threads 1 2>&1 | tee "$OUT_DIR/$name.log" || failed=$((failed + 1))
        section "$name, warm kernel cache"
        /usr/bin/time -f "$name warm: %e s wall, %U s user" "$t" $filter --nocapture --test-threads 1 2>&1 | tail -5 || failed=$((failed + 1))
    done
fi

if has pytest || has bench; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ortrain-site .gpu/*.whl
    export PYTHONPATH=/tmp/ortrain-site
fi

if has pytest; then
    section "pytest -m gpu"
    $PY -m pytest -q -m gpu tests/test_cuda*.py -rs 2>&1 | tee "$OUT_DIR/pytest-gpu.log" | tail -30
    [ "${PIPESTATUS[0]}" = 0 ] || failed=$((failed + 1))
fi

if has bench; then
    section "bench.gpu"
    PYTHONUNBUFFERED=1 $PY -m bench.gpu ${BENCH_ARGS:-} --json "$OUT_DIR/bench-gpu.json" || failed=$((failed + 1))
fi
echo "failed sections: $failed"
exit "$failed"
