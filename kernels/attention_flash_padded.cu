// The flash attention kernels with key padding (an attention_mask's flags, `kp`; PAD = true in
// kernels/attention_flash.cuh, which says what they compute): the same blocks and launch bounds
// as attention_flash.cu's, named with `_kp` after the block size (attention_flash_fwd_d64r128_kp_bf16).

#include "prelude.cuh"
#include "attention.cuh"
#include "attention_mma_stage.cuh"
#include "attention_flash.cuh"

#define FA_PADDED_KERNELS(P)                          \
    FA_ROW_KERNELS(64, 1, _kp, 3, P, true, false)     \
    FA_ROW_KERNELS(64, 2, r128_kp, 2, P, true, false) \
    FA_ROW_KERNELS(128, 1, _kp, 1, P, true, false)    \
    FA_DKV_KERNEL(64, 1, _kp, P, true, false)         \
    FA_DKV_KERNEL(64, 2, r128_kp, P, true, false)     \
    FA_DKV_KERNEL(128, 1, _kp, P, true, false)
FA_PADDED_KERNELS(bf16)
FA_PADDED_KERNELS(f16)
