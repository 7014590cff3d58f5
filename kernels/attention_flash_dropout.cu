// The flash attention kernels with the probabilities' dropout (DROP = true in
// kernels/attention_flash.cuh, which says what they compute): the same blocks and launch bounds
// as attention_flash.cu's, named with `_dp` after the block size
// (attention_flash_fwd_d64r128_dp_bf16); with key padding too, attention_flash_padded_dropout.cu's
// (two files: a cold start compiles the families in parallel, backend/cuda/compile.rs
// `in_parallel`).

#include "prelude.cuh"
#include "attention.cuh"
#include "attention_mma_stage.cuh"
#include "attention_flash.cuh"

#define FA_DROPOUT_KERNELS(P)                             \
    FA_ROW_KERNELS(64, 1, _dp, 3, P, false, true)         \
    FA_ROW_KERNELS(64, 2, r128_dp, 2, P, false, true)     \
    FA_ROW_KERNELS(128, 1, _dp, 1, P, false, true)        \
    FA_DKV_KERNEL(64, 1, _dp, P, false, true)             \
    FA_DKV_KERNEL(64, 2, r128_dp, P, false, true)         \
    FA_DKV_KERNEL(128, 1, _dp, P, false, true)
FA_DROPOUT_KERNELS(bf16)
FA_DROPOUT_KERNELS(f16)
