#!/usr/bin/env bash
# Runs every test that CI runs: the Rust unit tests and the pytest suite (minus `slow` and `gpu`).
# Sets up the environment first (scripts/bootstrap.sh), so it works on a fresh clone.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# Each section's wall time, so that CI's log says where its minutes go (CI wants the whole run
# under 45 minutes on 2 cores).
section_start=$SECONDS
section_title="bootstrap"
section_took() { echo "[test] ${section_title}: $((SECONDS - section_start)) s (total $SECONDS s)"; }
section() {
    section_took
    section_title="${1%%:*}"
    section_title="${section_title:0:80}"
    section_start=$SECONDS
    echo "[test] $1"
}
trap section_took EXIT
bash scripts/bootstrap.sh

section "cargo test (engine, with the cuda feature)"
export ORTRAIN_NVRTC_LIB="$root/.cuda-wheels/nvidia/cu13/lib"
cargo test --release -q -p ortrain-engine --features cuda -- --skip every_kernel_file
section "every CUDA kernel file compiled by NVRTC to an sm_90 CUBIN, every kernel symbol checked (no GPU: compiled, not run)"
cargo test --release -q -p ortrain-engine --features cuda --test cuda_kernels every_kernel_file -- --nocapture

section "the CUDA backend's GPU tests on cuda-emu: kernels/*.cu compiled by g++ and run on the CPU (emulated, not a GPU)"
emu_path="$(bash cuda-emu/build.sh)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
target/cuda-emu/selftest
# two emulated GPUs: backend::cuda::tests::multi_device trains on cuda:1 too
ORT_EMU_DEVICES=2 LD_LIBRARY_PATH="$emu_path" cargo test --release -q -p ortrain-engine --features cuda --lib backend::cuda::
LD_LIBRARY_PATH="$emu_path" cargo test --release -q -p ortrain-engine --features cuda --test cuda_gpu
section "an exported GPT-2 with its loss (2 layers, seq 256, vocab 50257): one step on cuda-emu at bf16 and at fp16 as close to the CPU's f32 step as the CPU's bf16 step"
.venv/bin/python -m bench.parity_model target/parity-gpt2
ORTRAIN_PARITY_MODEL="$root/target/parity-gpt2" LD_LIBRARY_PATH="$emu_path" \
    cargo test --release -q -p ortrain-engine --features cuda --lib onnx_parity -- --ignored --nocapture
section "the same GPT-2 called with a padded attention_mask (left and right): the attentions take it as key padding (flash kernels), the queries without a visible key included"
.venv/bin/python -m bench.parity_model target/parity-gpt2-padded --padding
ORTRAIN_PARITY_MODEL="$root/target/parity-gpt2-padded" LD_LIBRARY_PATH="$emu_path" \
    cargo test --release -q -p ortrain-engine --features cuda --lib onnx_parity -- --ignored --nocapture
section "an exported BERT masked-language model (2 layers, seq 256) called with a padded attention_mask, one row all padding: its attentions (no causal mask) take it as key padding (flash kernels)"
.venv/bin/python -m bench.parity_model target/parity-bert-padded --model bert --padding --batch 3 --vocab 1000
ORTRAIN_PARITY_MODEL="$root/target/parity-bert-padded" LD_LIBRARY_PATH="$emu_path" \
    cargo test --release -q -p ortrain-engine --features cuda --lib onnx_parity -- --ignored --nocapture
section "an exported Llama (2 layers, heads of 32, grouped-query attention, rotary embeddings, RMSNorm), with and without a padded attention_mask: its attentions read K untransposed (layout BHSD_K) and K and V before their repeat, on the flash kernels"
for padded in "" -padded; do
    .venv/bin/python -m bench.parity_model "target/parity-llama$padded" --model llama --width 128 --heads 4 --seq 128 --vocab 1000 \
        ${padded:+--padding}
    ORTRAIN_PARITY_MODEL="$root/target/parity-llama$padded" LD_LIBRARY_PATH="$emu_path" \
        cargo test --release -q -p ortrain-engine --features cuda --lib onnx_parity -- --ignored --nocapture
done
section "the ONNX node cases of tests/conformance/manifest.txt on the CUDA executor (cuda-emu): onnx's expected outputs, as the CPU gives them"
.venv/bin/python -m tests.conformance.cuda_export target/node-cases
ORTRAIN_NODE_CASES="$root/target/node-cases" LD_LIBRARY_PATH="$emu_path" \
    cargo test --release -q -p ortrain-engine --features cuda --lib node_cases -- --ignored --nocapture
section "every gradient rule on the CUDA executor (cuda-emu): tests/test_gradcheck.py's cases in f64, f32, f16 and bf16, one step each, as the CPU executor gives it"
.venv/bin/python tests/gradcheck_export.py target/grad-cases
ORTRAIN_GRAD_CASES="$root/target/grad-cases" LD_LIBRARY_PATH="$emu_path" \
    cargo test --release -q -p ortrain-engine --features cuda --lib grad_cases -- --ignored --nocapture
section "cuda-emu still catches a missing barrier, a wrong mma fragment, a wrong divider, swapped strides, a cp.async tile read early or refilled while read, an untransposed ldmatrix, f16 operands rounded through bf16, key padding's queries without a key skipped or taken as causal, a reduction read before its barrier, a misaligned tile, a shared-memory overrun and the attention's dropout bits drawn or shared wrong (mutated kernel copies must fail)"
bash cuda-emu/mutations.sh

section "cargo check (engine without the cuda feature)"
cargo check --release -q -p ortrain-engine

section "cargo test (tracking, against a real mlflow server from .venv)"
cargo test --release -q -p ortrain-tracking

section "pytest"
set +e
.venv/bin/python -m pytest -q --durations=30 -m "not slow and not gpu" tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "[test] pytest collected no tests: that is a failure" >&2
    exit 1
fi
exit "$rc"
