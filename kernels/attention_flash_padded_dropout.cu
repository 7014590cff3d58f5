// The flash attention kernels with key padding and the probabilities' dropout (PAD and DROP in
// kernels/attention_flash.cuh, which says what they compute): the same blocks and launch bounds
// as attention_flash_padded.cu's, named with `_kp_dp` after the block size
// (attention_flash_fwd_d64r128_kp_dp_bf16).

#include "prelude.cuh"
#include "attention.cuh"
#include "attention_mma_stage.cuh"
#include "attention_flash.cuh"

#define FA_PADDED_DROPOUT_KERNELS(P)                      \
    FA_ROW_KERNELS(64, 1, _kp_dp, 3, P, true, true)       \
    FA_ROW_KERNELS(64, 2, r128_kp_dp, 2, P, true, true)   \
    FA_ROW_KERNELS(128, 1, _kp_dp, 1, P, true, true)      \
    FA_DKV_KERNEL(64, 1, _kp_dp, P, true, true)           \
    FA_DKV_KERNEL(64, 2, r128_kp_dp, P, true, true)       \
    FA_DKV_KERNEL(128, 1, _kp_dp, P, true, true)
FA_PADDED_DROPOUT_KERNELS(bf16)
FA_PADDED_DROPOUT_KERNELS(f16)
