#!/usr/bin/env bash
# Proves that cuda-emu still catches the kinds of bug it is there for: each mutation below puts
# one such bug into a copy of kernels/ (a missing barrier, a wrong mma fragment, a wrong
# divider, a misaligned tile, a tile past the end of shared memory, a cp.async tile read before
# it lands or refilled while still read, an ldmatrix of the wrong orientation, f16 operands
# rounded through bf16, key padding's rows without a key skipped or taken as causal, a padded
# key taken as visible, a reduction without its barrier, the attention's dropout bits drawn or
# shared wrong), builds the emulator from the copy and runs the GPU tests that cover it, which
# must fail. A mutation the tests survive fails this script: the emulator (or the tests) lost the
# power to see that bug. The engine's test binary is the normal one (its embedded kernels only go
# to NVRTC); what runs is the emulator built from the mutated copy.
#
#   bash cuda-emu/mutations.sh        (CI runs it after the emulated GPU tests; about 4 minutes on 2 cores)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export ORTRAIN_NVRTC_LIB="${ORTRAIN_NVRTC_LIB:-$root/.cuda-wheels/nvidia/cu13/lib}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
survived=0

# mutate NAME FILE OLD NEW TEST_FILTER [EXPECT]: OLD (which must occur) becomes NEW in the copy's
# FILE; with EXPECT, the failing tests' output must also contain it (the check that caught it).
# EMU_ONLY="file ..." before it: only those kernel files (names without .cu; the ones whose
# kernels TEST_FILTER runs) are compiled again from the copy, the others keep the main build's
# objects (a header of every attention file would otherwise rebuild all six)
mutate() {
    local began=$SECONDS
    rm -rf "$work/kernels" "$work/cuda-emu" "$work/target"
    # the sources and the emulator's objects as the main build left them (times kept): only the
    # files that include the mutated one are compiled again
    cp -a "$root/kernels" "$root/cuda-emu" "$work/"
    mkdir -p "$work/target"
    if [ -d "$root/target/cuda-emu" ]; then cp -a "$root/target/cuda-emu" "$work/target/"; fi
    python3 - "$work/$2" "$3" "$4" <<'PY'
import sys
path, old, new = sys.argv[1:4]
text = open(path).read()
if old not in text:
    sys.exit(f"mutations.sh: the text to mutate is no longer in {path}: update the mutation\n{old}")
open(path, "w").write(text.replace(old, new, 1))
PY
    local lib
    lib="$(bash "$work/cuda-emu/build.sh")"
    if (cd "$root" && LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        cargo test --release -q -p ortrain-engine --features cuda --lib "$5" > "$work/log" 2>&1); then
        echo "SURVIVED: $1 (the tests matching $5 passed with it)" >&2
        survived=$((survived + 1))
    elif [ -n "${6:-}" ] && ! grep -qF "$6" "$work/log"; then
        echo "CAUGHT FOR ANOTHER REASON: $1 (the tests failed, but without \"$6\"):" >&2
        grep -m3 "cuda-emu:\|panicked" "$work/log" >&2 || true
        survived=$((survived + 1))
    elif grep -q "^test result: FAILED" "$work/log"; then
        echo "caught: $1 ($(grep -c "panicked at" "$work/log" || true) failing assertion(s) in $5; $((SECONDS - began)) s)"
    else
        echo "mutations.sh: the tests for \"$1\" did not run:" >&2
        tail -20 "$work/log" >&2
        exit 1
    fi
}

EMU_ONLY="softmax" mutate "block_reduce without the barrier between writing and reading its scratch" kernels/prelude.cuh \
    "    if (lane == 0) scratch[warp] = v;
    __syncthreads();" \
    "    if (lane == 0) scratch[warp] = v;" \
    backend::cuda::tests::softmax

mutate "the radix sort's digit slots moved on before every thread has read them" kernels/sort.cu \
    "            __syncthreads();
            if (live && last) next[d] += rank + 1;" \
    "            if (live && last) next[d] += rank + 1;" \
    backend::cuda::tests::sort

mutate "the radix sort unstable: equal digits of a round in reverse order" kernels/sort.cu \
    "                if (u < t) rank += same;
                else if (u > t && same) last = false;" \
    "                if (u > t) rank += same;
                else if (u < t && same) last = false;" \
    backend::cuda::tests::gather::gpu_gather_grad "GatherGrad f32 case"

EMU_ONLY="layernorm" mutate "LayerNorm's warp slices of the parameter-gradient sums added before every warp has written" kernels/norm_rows.cuh \
    "        __syncthreads();  // every warp's slice summed" \
    "" \
    backend::cuda::tests::layernorm

EMU_ONLY="layernorm" mutate "LayerNorm's partials reduced before every chunk lane has written" kernels/norm_rows.cuh \
    "        __syncthreads();  // every chunk lane's sums written" \
    "" \
    backend::cuda::tests::layernorm

mutate "tensor-core attention with two registers of the mma A fragment swapped" kernels/attention_mma.cu \
    "    a[1] = am_pair(t, ld, r0 + g + 8, k0 + 2 * q);
    a[2] = am_pair(t, ld, r0 + g, k0 + 2 * q + 8);" \
    "    a[2] = am_pair(t, ld, r0 + g + 8, k0 + 2 * q);
    a[1] = am_pair(t, ld, r0 + g, k0 + 2 * q + 8);" \
    backend::cuda::tests::exec::gpu_tensor_core_attention

EMU_ONLY="movement" mutate "strided kernels dividing by a dimension without the divider's +j" kernels/prelude.cuh \
    "const u32 q = (__umulhi(j, s.magic[d]) + j) >> s.shift[d];" \
    "const u32 q = __umulhi(j, s.magic[d]) >> s.shift[d];" \
    backend::cuda::tests::movement::gpu_copy_as

mutate "tensor-core attention's dK written with its S and D strides swapped" kernels/attention_mma.cu \
    "dkt[off.gk + d * a.k_d + key * a.k_s]" \
    "dkt[off.gk + d * a.k_s + key * a.k_d]" \
    backend::cuda::tests::attention_layout

mutate "tensor-core attention's computed causal mask hiding each query's own key" kernels/attention_mma.cu \
    "if (causal) return (row >= a.T || col >= a.S || col > row) ? -ATT_INF : dot * scale;" \
    "if (causal) return (row >= a.T || col >= a.S || col >= row) ? -ATT_INF : dot * scale;" \
    backend::cuda::tests::causal_attention

EMU_ONLY="attention_flash" mutate "flash attention multiplying a key tile before its cp.async group has landed" kernels/attention_flash.cuh \
    "        fa_commit();
        fa_wait<1>();" \
    "        fa_commit();
        fa_wait<2>();" \
    backend::cuda::tests::flash_attention

EMU_ONLY="attention_flash" mutate "flash attention refilling a K/V buffer while other warps may still read it (no barrier after the tile)" kernels/attention_flash.cuh \
    "        __syncthreads();  // this buffer is read: the next iteration but one refills it" \
    "" \
    backend::cuda::tests::flash_attention

EMU_ONLY="attention_flash" mutate "flash attention reading V's fragments with ldmatrix untransposed" kernels/attention_flash_fragments.cuh \
    "    fa_ldsm<true>(b, t + (k0 + (lane & 7)" \
    "    fa_ldsm<false>(b, t + (k0 + (lane & 7)" \
    backend::cuda::tests::flash_attention

EMU_ONLY="attention_flash" mutate "flash attention's 128-row blocks skipping the key tile that holds a warp's own diagonal" kernels/attention_flash.cuh \
    "return MT > 1 && causal && s0 > row0 + 16 * MT - 1;" \
    "return MT > 1 && causal && s0 >= row0;" \
    backend::cuda::tests::flash_attention

EMU_ONLY="attention_flash" mutate "flash dK/dV's 128-key blocks skipping the query part that holds a warp's own diagonal" kernels/attention_flash.cuh \
    "if (causal && tq + QP - 1 < key0 && (!PAD" \
    "if (causal && tq + QP - 1 < key0 + 16 * MT && (!PAD" \
    backend::cuda::tests::flash_attention

EMU_ONLY="attention_flash_padded" mutate "flash dK/dV skipping the queries without a visible key before its keys (they see every key)" kernels/attention_flash.cuh \
    "if (causal && tq + QP - 1 < key0 && (!PAD || tq >= pad.uni)) continue;" \
    "if (causal && tq + QP - 1 < key0) continue;" \
    backend::cuda::tests::key_padding_attention

EMU_ONLY="attention_flash_padded" mutate "key padding without a causal mask taken as causal (a query before the first visible key sees none)" kernels/attention_flash.cuh \
    "causal ? min(first, T) : (first < S ? 0 : T)" \
    "min(first, T)" \
    backend::cuda::tests::key_padding_attention::gpu_flash_attention_takes_key_padding_without

EMU_ONLY="attention_flash_padded" mutate "the first visible key read before every warp has written its minimum" kernels/attention_flash.cuh \
    "    if ((threadIdx.x & 31) == 0) warp_first[threadIdx.x >> 5] = first;
    __syncthreads();" \
    "    if ((threadIdx.x & 31) == 0) warp_first[threadIdx.x >> 5] = first;" \
    backend::cuda::tests::key_padding_attention

EMU_ONLY="attention_flash_padded" mutate "key padding's tile visibility taking every key of a tile's second half as visible (the ballot's upper word)" kernels/attention_flash.cuh \
    "v1 = k1 >= pad.S || pad.kp[k1 * pad.ks] != 0;" \
    "v1 = true;" \
    backend::cuda::tests::key_padding_attention

EMU_ONLY="attention_flash_padded" mutate "flash dK/dV's padded key rows unmasked where no query of the part is keyless" kernels/attention_flash.cuh \
    "const int pad_below = key_vis >> 31 ? T : pad.uni;" \
    "const int pad_below = pad.uni;" \
    backend::cuda::tests::key_padding_attention

# rounding an f16 product's operands through bf16 (bf16's own are unchanged by it) stays close to
# the tensor-core kernels' result (they share the packing): only the flash test's bound on f16's
# precision sees it
EMU_ONLY="attention_flash" mutate "f16 attention's P and dS operands rounded through bf16 before f16" kernels/attention_mma_stage.cuh \
    "#define AM_PROD_PACK(P, PTX) return (u32)ort_emu_f32_to_##P(lo) | ((u32)ort_emu_f32_to_##P(hi) << 16);" \
    "#define AM_PROD_PACK(P, PTX) return (u32)ort_emu_f32_to_##P(bf16_to_f32(f32_to_bf16(lo))) | ((u32)ort_emu_f32_to_##P(bf16_to_f32(f32_to_bf16(hi))) << 16);" \
    backend::cuda::tests::flash_attention "over f16's"

# the attention's dropout: a warp's lanes draw a run's Philox counters between them and share
# the keep bits by shuffles (kernels/attention.cuh)
EMU_ONLY="attention attention_mma attention_flash_dropout attention_flash_padded_dropout" mutate "the attention's dropout without the 17th counter of a query's 64 keys (rows not starting on a counter)" kernels/attention.cuh \
    "    u32 hi = skew != 0 && qd == 0 ? att_drop_nibble(d, m0 + 16) : 0u;  // bits 64 .. 67" \
    "    u32 hi = 0u;" \
    backend::cuda::tests::attention_dropout::gpu_attention_dropout_drops_what_the_dropout_of_its_key_drops

EMU_ONLY="attention attention_mma attention_flash_dropout attention_flash_padded_dropout" mutate "the dK/dV kernels' dropout bits not gathered from the lanes 16 apart" kernels/attention.cuh \
    "    return bits | __shfl_xor_sync(0xffffffffu, bits, 16);" \
    "    return bits;" \
    backend::cuda::tests::attention_dropout::gpu_attention_dropout_drops_what_the_dropout_of_its_key_drops

# the next two leave every value as it was: only the emulator's alignment trap and the guard
# page after dynamic shared memory can see them (as a GPU's misaligned-address and
# out-of-range-shared faults would)
mutate "tensor-core attention's Vᵀ tile one bf16 off its alignment (u32 fragment loads at odd addresses)" kernels/attention_mma.cu \
    "    u16* vt = ks + AM_TILE * LD;  // Vᵀ [HD][64]" \
    "    u16* vt = ks + AM_TILE * LD - 1;  // Vᵀ [HD][64]" \
    backend::cuda::tests::exec::gpu_tensor_core_attention "misaligned address"

mutate "tensor-core attention's Vᵀ tile placed one row past the shared memory its launch asks for" kernels/attention_mma.cu \
    "    u16* vt = ks + AM_TILE * LD;  // Vᵀ [HD][64]" \
    "    u16* vt = ks + AM_TILE * LD + AM_LDT;  // Vᵀ [HD][64]" \
    backend::cuda::tests::exec::gpu_tensor_core_attention "bytes of dynamic shared memory"

if [ "$survived" -gt 0 ]; then
    echo "cuda-emu/mutations.sh: $survived mutation(s) survived" >&2
    exit 1
fi
echo "cuda-emu/mutations.sh: every mutation was caught"
