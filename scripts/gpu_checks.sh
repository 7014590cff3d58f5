#!/usr/bin/env bash
# The GPU checks of doc/GPU-RUNS.md, for a GPU machine that has Python with torch but no cargo
# (the lent device machine): the CUDA test binaries and the abi3 wheel are built elsewhere
# (scripts/gpu_prepare.sh) into .gpu/, and this script runs them here.
#
#   bash scripts/gpu_checks.sh [OUT_DIR]      (what: $GPU_CHECKS, default "session")
#
# GPU_CHECKS is a comma list of sections, run in the order of the session's list whatever the
# list's order (the most needed first, since the deadline cuts the last ones):
#   env        the GPU, driver, torch and the NVRTC/cuBLAS folder
#   kernels    every kernel file compiled cold by NVRTC (fills the disk cache), then warm; the
#              engine's CUDA unit tests (kernel parity, cuBLAS, the executor, graphs); the ONNX
#              node cases of tests/conformance/manifest.txt (node_cases) and the cases of
#              tests/test_gradcheck.py in four float types (grad_cases) on the CUDA executor
#              against onnx's outputs / the CPU executor's step
#   warm       `python -m ortrain.cuda warm --arch auto` (the Databricks init script's warm-up):
#              nvidia-smi's compute capability read as sm_90, and (after kernels) every kernel
#              file found in the cache the test binaries filled: the wheel and the engine agree
#              on the cache keys
#   gpt2       bench.gpu on GPT-2 124M (bf16): ortrain+fuse_attention+autocast (the engine's
#              intended path), torch.compile and eager: issue 6's target rows (50 steps each,
#              with every 5th step's loss: the loss curves side by side)
#   parity     one step of an exported GPT-2 124M with its loss (python -m bench.parity_model,
#              seq 1024, batch 2) on the CPU in f32, on the CPU at bf16 and on this GPU at bf16:
#              every weight gradient's distance from f32 (engine test onnx_parity;
#              PARITY_ARGS replaces the model's size arguments)
#   pytest     pytest -m gpu tests/test_cuda*.py tests/test_random_draws.py tests/test_distributed.py tests/test_checkpointing.py tests/test_model_loss.py (the Python path: torch interop, training)
#   tutorial   bench.gpu on the tutorial model: eager, compile, ortrain, ortrain+fuse_attention (its
#              two attentions fused with their dropout 0.2: SIMT kernels, heads of 100),
#              ortrain-nographs; then
#              bench.host_overhead on the GPU: the step's host time phase by phase against its
#              wall time, eager and ortrain (host ~ wall: the host is what the step waits on),
#              and ortrain's step under cProfile by function (where the host time goes)
#   variants   bench.gpu on GPT-2 124M: ortrain+fuse_attention+autocast with the older tensor-core
#              attention kernels instead of the flash ones (+no_flash_attention), with the flash
#              forward and dQ in 64-row blocks instead of 128 (+flash_rows64), with Q, K, V split
#              out of the c_attn projection again (+no_attention_packed_qkv), without stops 30-31's
#              passes (+no_attention_layout+no_layer_norm_half+no_layer_norm_grad_sum
#              +no_fuse_residual_linear),
#              ortrain+fuse_attention, ortrain,
#              ortrain+fuse_attention+autocast without the GELU recomputation (+no_recompute),
#              and without the GELU nor its gradient in the products' cuBLASLt epilogues
#              (+no_matmul_gelu_grad+no_fuse_linear_gelu: llm.c's gelu_fusion 0 against 2)
#   profile    bench.gpu_profile of ortrain's GPT-2 124M step with fuse_attention,autocast, then of
#              its tutorial step: the kernels' GPU time, to set against bench.gpu_roofline's model
#   fp16       bench.gpu on GPT-2 124M at fp16 (--gpt2-precision fp16): ortrain+fuse_attention
#              +autocast (the f16 flash kernels), torch.compile and eager with a GradScaler
#   padded     bench.gpu on GPT-2 124M called with a padded attention_mask (gpt2-124m-padded:
#              the key padding in the flash kernels): ortrain+fuse_attention+autocast, torch.compile
#              and eager; then the padded parity model's step (bench.parity_model --padding), and
#              BERT-base's (--model bert --padding: key padding without a causal mask)
#   llama      bench.gpu's llama-gqa (a 156M-parameter Llama, GQA, bf16): ortrain+fuse_attention+autocast,
#              torch.compile and eager; then an exported Llama's step (4 layers, width 1024, heads of 64 with 8 key/value heads,
#              seq 1024; LLAMA_PARITY_ARGS replaces the sizes), plain and with a padded
#              attention_mask: its attentions in layout BHSD_K on the flash kernels
#   bench      bench.gpu with $BENCH_ARGS (default: both workloads, the default systems)
#   session    env,kernels,warm,gpt2,parity,profile,variants,pytest,tutorial under a deadline: one call of a
#              15-minute lease (the later sections run only as far as time is left)
#
# GPU_DEADLINE (seconds from the start; "session" defaults to 540, else none) caps the whole
# run: each section gets at most its own cap and what is left before the deadline, and a
# section that would start with under 20 s left is skipped and says so. Every section prints
# its own header and keeps going when one fails; the exit status is the number of failed or
# cut sections. Logs, the bench JSON files and summary.txt (a line per section) are written to
# GPU_LOG_DIR (default /tmp/gpu-logs) as the run goes, and after every section packed into
# OUT_DIR/gpu-checks.tar.gz beside a copy of summary.txt (default OUT_DIR /tmp/gpu-out): two
# files, since the device tool brings back at most 8, and a run killed from outside keeps what
# it had finished.
set -u
OUT_DIR=${1:-/tmp/gpu-out}
LOG_DIR=${GPU_LOG_DIR:-/tmp/gpu-logs}
rm -rf "$LOG_DIR"
mkdir -p "$OUT_DIR" "$LOG_DIR"
WHAT=${GPU_CHECKS:-session}
if [[ ",$WHAT," == *",session,"* ]]; then
    WHAT="$WHAT,env,kernels,warm,gpt2,parity,profile,variants,pytest,tutorial"
    DEADLINE=${GPU_DEADLINE:-540}
else
    DEADLINE=${GPU_DEADLINE:-0}
fi
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
START=$(date +%s)
failed=0
: >"$LOG_DIR/summary.txt"
has() { [[ ",$WHAT," == *",$1,"* ]]; }
section() { echo; echo "==== $1 ($(date +%T), $(($(date +%s) - START)) s in)"; }
note() { echo "$1" | tee -a "$LOG_DIR/summary.txt"; }
pack() { tar -czf "$OUT_DIR/gpu-checks.tar.gz" -C "$LOG_DIR" . && cp "$LOG_DIR/summary.txt" "$OUT_DIR/summary.txt"; }

# capped CAP NAME LOG CMD...: runs CMD (output to LOG) within CAP seconds and the deadline, and
# records NAME's outcome. Never in a pipeline: it counts failures in this shell.
capped() {
    local cap=$1 name=$2 log=$3 limit t0 rc
    shift 3
    rm -f "$log"
    limit=$cap
    if [ "$DEADLINE" -gt 0 ]; then
        local left=$((DEADLINE - ($(date +%s) - START)))
        [ "$left" -lt "$limit" ] && limit=$left
        if [ "$limit" -lt 20 ]; then
            note "$name: SKIPPED, ${left} s left before the ${DEADLINE} s deadline"
            failed=$((failed + 1))
            return 124
        fi
    fi
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        note "$name: CUT at ${limit} s (its cap ${cap} s, the deadline ${DEADLINE} s)"
    else
        note "$name: exit ${rc} in $(($(date +%s) - t0)) s"
    fi
    [ "$rc" = 0 ] || failed=$((failed + 1))
    pack
    return "$rc"
}

# NVRTC and cuBLAS from the CUDA 13 wheels beside torch (nvidia/cu13/lib); NV_LIB names another
# folder (cuda-emu's target/cuda-emu, to try this script without a GPU)
NV_LIB=${NV_LIB:-}
[ -n "$NV_LIB" ] || NV_LIB=$($PY - <<'EOF'
import glob, os, site
for d in site.getsitepackages():
    for hit in sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libnvrtc.so*"))):
        print(os.path.dirname(hit)); raise SystemExit
EOF
)
export ORTRAIN_NVRTC_LIB=${ORTRAIN_NVRTC_LIB:-$NV_LIB}
export LD_LIBRARY_PATH=${NV_LIB}:${LD_LIBRARY_PATH:-}
# one NVRTC disk cache for the whole run: the cold compile below fills it for every later process
export ORTRAIN_CACHE_DIR=${ORTRAIN_CACHE_DIR:-/tmp/ortrain-gpu-cache}

if has env; then
    section "environment"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    $PY -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
    echo "NVRTC/cuBLAS folder: $NV_LIB"; ls "$NV_LIB" | grep -E "nvrtc|cublas" | head
fi

if has kernels; then
    # the loader test twice: a cold NVRTC compile of every kernel file, then the disk cache
    if [ -x .gpu/cuda_gpu ]; then
        rm -rf "$ORTRAIN_CACHE_DIR"
        section "cuda_gpu, cold kernel cache"
        capped 150 "kernels cold (cuda_gpu)" "$LOG_DIR/cuda_gpu.log" .gpu/cuda_gpu --nocapture
        tail -30 "$LOG_DIR/cuda_gpu.log"
        section "cuda_gpu, warm kernel cache"
        capped 30 "kernels warm (cuda_gpu)" "$LOG_DIR/cuda_gpu-warm.log" .gpu/cuda_gpu --nocapture
        tail -4 "$LOG_DIR/cuda_gpu-warm.log"
    else
        note "kernels: .gpu/cuda_gpu missing (run scripts/gpu_prepare.sh before the call)"; failed=$((failed + 1))
    fi
    # the engine's CUDA unit tests: kernel parity, cuBLAS, the executor (warm cache)
    if [ -x .gpu/cuda_lib ]; then
        section "engine CUDA unit tests"
        capped 150 "engine CUDA unit tests (cuda_lib)" "$LOG_DIR/cuda_lib.log" \
            .gpu/cuda_lib backend::cuda:: --test-threads 4 ${LIB_TEST_ARGS:-}
        if [ -f "$LOG_DIR/cuda_lib.log" ]; then
            grep -vE "^test .* ok$" "$LOG_DIR/cuda_lib.log" | tail -80
            note "engine CUDA unit tests: $(grep -E '^test result' "$LOG_DIR/cuda_lib.log" | tail -1) $(grep -c ' \.\.\. ok$' "$LOG_DIR/cuda_lib.log") ok, $(grep -c ' \.\.\. FAILED$' "$LOG_DIR/cuda_lib.log") FAILED so far"
            note "engine CUDA unit tests: $(grep -c SKIPPED "$LOG_DIR/cuda_lib.log") SKIPPED lines (must be 0 on a GPU)"
        fi
        if [ -f .gpu/op-cases.tar.gz ]; then
            section "ONNX node cases and gradient-check cases on the CUDA executor"
            rm -rf /tmp/node-cases /tmp/grad-cases && tar -xzf .gpu/op-cases.tar.gz -C /tmp
            ORTRAIN_NODE_CASES=/tmp/node-cases capped 60 "ONNX node cases on CUDA" "$LOG_DIR/node-cases.log" \
                .gpu/cuda_lib node_cases --ignored --nocapture
            [ -f "$LOG_DIR/node-cases.log" ] && grep -E "FAIL|refused|cases give|test result" "$LOG_DIR/node-cases.log" | tail -40
            ORTRAIN_GRAD_CASES=/tmp/grad-cases capped 60 "gradient-check cases on CUDA" "$LOG_DIR/grad-cases.log" \
                .gpu/cuda_lib grad_cases --ignored --nocapture
            [ -f "$LOG_DIR/grad-cases.log" ] && grep -E "FAIL|refused|cases give|test result" "$LOG_DIR/grad-cases.log" | tail -40
        fi
    else
        note "engine CUDA unit tests: .gpu/cuda_lib missing"; failed=$((failed + 1))
    fi
fi

if has warm || has pytest || has bench || has tutorial || has gpt2 || has parity || has variants || has profile || has fp16 || has padded || has llama; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ortrain-site .gpu/*.whl
    export PYTHONPATH=/tmp/ortrain-site
fi

if has warm; then
    section "python -m ortrain.cuda warm --arch auto"
    capped 120 "kernel cache warm-up" "$LOG_DIR/warm.log" $PY -m ortrain.cuda warm --arch auto
    [ -f "$LOG_DIR/warm.log" ] && tail -3 "$LOG_DIR/warm.log" && note "warm-up: $(tail -1 "$LOG_DIR/warm.log")"
fi

# bench.gpu rows, each its own process; WORKER_TIMEOUT bounds one row so a hang costs one row
bench() {
    local cap=$1 name=$2 json=$3
    shift 3
    section "bench.gpu: $name"
    capped "$cap" "bench $name" "$LOG_DIR/${json%.json}.log" \
        $PY -m bench.gpu --worker-timeout "${WORKER_TIMEOUT:-240}" --json "$LOG_DIR/$json" "$@"
    [ -f "$LOG_DIR/${json%.json}.log" ] && tail -25 "$LOG_DIR/${json%.json}.log"
}
# One exported model's training step on the CPU in f32 and at bf16 and on this GPU at bf16 and
# fp16, every weight gradient against f32 (the engine test onnx_parity):
# parity_step TITLE NAME PARITY_MODEL_ARGS... (NAME: its folder under /tmp and its logs' name)
parity_step() {
    local title=$1 name=$2
    shift 2
    section "$title"
    rm -rf "/tmp/$name"
    capped 90 "$name export" "$LOG_DIR/$name-export.log" env PYTHONPATH="$PYTHONPATH:$PWD:$PWD/tests" \
        $PY -m bench.parity_model "/tmp/$name" "$@"
    if [ -f "/tmp/$name/meta.txt" ] && [ -x .gpu/cuda_lib ]; then
        ORTRAIN_PARITY_MODEL="/tmp/$name" capped 150 "$name step" "$LOG_DIR/$name.log" .gpu/cuda_lib onnx_parity --ignored --nocapture
        tail -40 "$LOG_DIR/$name.log"
    fi
}

if has gpt2; then
    # the engine's intended GPT-2 path first: its row is the one the targets need
    bench 300 "GPT-2 124M" bench-gpt2.json --workloads gpt2-124m --steps 40 --warmup 10 \
        --systems ortrain+fuse_attention+autocast,compile,eager
fi
if has parity; then
    parity_step "one exported GPT-2 124M step: CPU f32, CPU bf16, GPU bf16" parity-gpt2 \
        ${PARITY_ARGS:---layers 12 --width 768 --heads 12 --seq 1024 --batch 2}
fi
if has profile; then
    section "bench.gpu_profile: GPT-2 124M, ortrain with fuse_attention,autocast"
    PYTHONPATH="$PYTHONPATH:$PWD:$PWD/tests" ORTRAIN_ENABLE_PASSES=fuse_attention,autocast capped 240 "profile GPT-2 124M" "$LOG_DIR/profile-gpt2.log" \
        $PY -m bench.gpu_profile --workload gpt2-124m --system ortrain --steps 3 --top 25
    [ -f "$LOG_DIR/profile-gpt2.log" ] && tail -40 "$LOG_DIR/profile-gpt2.log"
    # the tutorial's kernels (issue 6 wants 3x eager; its graphed step is GPU-bound): set against
    # `python -m bench.gpu_roofline --workload tutorial --gpu h200`, which models 0.9 ms
    section "bench.gpu_profile: tutorial, ortrain"
    PYTHONPATH="$PYTHONPATH:$PWD:$PWD/tests" capped 90 "profile tutorial" "$LOG_DIR/profile-tutorial.log" \
        $PY -m bench.gpu_profile --workload tutorial --system ortrain --steps 5 --top 25
    [ -f "$LOG_DIR/profile-tutorial.log" ] && tail -35 "$LOG_DIR/profile-tutorial.log"
fi
if has variants; then
    bench 300 "GPT-2 124M pass variants" bench-gpt2-variants.json --workloads gpt2-124m --steps 20 --warmup 4 \
        --systems ortrain+fuse_attention+autocast+no_flash_attention,ortrain+fuse_attention+autocast+flash_rows64,ortrain+fuse_attention+autocast+no_attention_packed_qkv,ortrain+fuse_attention+autocast+no_attention_layout+no_layer_norm_half+no_layer_norm_grad_sum+no_fuse_residual_linear,ortrain+fuse_attention,ortrain,ortrain+fuse_attention+autocast+no_recompute,ortrain+fuse_attention+autocast+no_matmul_gelu_grad+no_fuse_linear_gelu
fi
if has padded; then
    bench 300 "GPT-2 124M, padded attention_mask" bench-gpt2-padded.json --workloads gpt2-124m-padded --steps 20 --warmup 4 \
        --systems ortrain+fuse_attention+autocast,compile,eager
    parity_step "one exported GPT-2 step with a padded attention_mask: CPU f32, CPU bf16, GPU bf16" parity-gpt2-padded \
        --padding ${PARITY_ARGS:---layers 12 --width 768 --heads 12 --seq 1024 --batch 2}
    parity_step "one exported BERT-base step with a padded attention_mask (one row all padding): no causal mask, key padding in the flash kernels" \
        parity-bert-padded --model bert --padding ${BERT_PARITY_ARGS:---layers 12 --width 768 --heads 12 --seq 512 --batch 3 --vocab 30522}
fi
if has llama; then
    bench 300 "Llama (GQA, 156M parameters)" bench-llama.json --workloads llama-gqa --steps 20 --warmup 4 \
        --systems ortrain+fuse_attention+autocast,compile,eager
    # grouped-query attention (8 key/value heads of 16), rotary embeddings: layout BHSD_K, flash
    parity_step "one exported Llama step (4 layers, width 1024, heads of 64, GQA): CPU f32, CPU bf16, GPU bf16" parity-llama \
        --model llama ${LLAMA_PARITY_ARGS:---layers 4 --width 1024 --heads 16 --seq 1024 --batch 2 --vocab 32000}
    parity_step "the same Llama with a padded attention_mask" parity-llama-padded \
        --model llama --padding ${LLAMA_PARITY_ARGS:---layers 4 --width 1024 --heads 16 --seq 1024 --batch 2 --vocab 32000}
fi
if has pytest; then
    section "pytest -m gpu"
    capped 180 "pytest -m gpu" "$LOG_DIR/pytest-gpu.log" $PY -m pytest -q -m gpu tests/test_cuda*.py tests/test_random_draws.py tests/test_distributed.py tests/test_checkpointing.py tests/test_model_loss.py -rs ${PYTEST_ARGS:-}
    if [ -f "$LOG_DIR/pytest-gpu.log" ]; then
        tail -40 "$LOG_DIR/pytest-gpu.log"
        note "pytest -m gpu: $(tail -1 "$LOG_DIR/pytest-gpu.log")"
    fi
fi
if has tutorial; then
    bench 240 tutorial bench-tutorial.json --workloads tutorial --systems eager,compile,ortrain,ortrain+fuse_attention,ortrain-nographs \
        --steps 30 --warmup 6
    section "bench.host_overhead: the tutorial step's host time on the GPU"
    PYTHONPATH="$PYTHONPATH:$PWD" capped 90 "host overhead tutorial" "$LOG_DIR/host-overhead.log" \
        $PY -m bench.host_overhead --device cuda --steps 200 --profile 100
    [ -f "$LOG_DIR/host-overhead.log" ] && tail -33 "$LOG_DIR/host-overhead.log"
fi
if has fp16; then
    bench 300 "GPT-2 124M fp16" bench-gpt2-fp16.json --workloads gpt2-124m --gpt2-precision fp16 --steps 20 --warmup 4 \
        --systems ortrain+fuse_attention+autocast,compile,eager
fi
if has bench; then
    bench 600 "${BENCH_ARGS:-default}" bench-gpu.json ${BENCH_ARGS:-}
fi
echo
echo "==== summary ($(($(date +%s) - START)) s)"
cat "$LOG_DIR/summary.txt"
echo "failed or cut sections: $failed"
pack
exit "$failed"
