// The flash attention kernels with key padding (an attention_mask's flags, `kp`; PAD = true in
// kernels/attention_flash.cuh, which says what they compute): the same blocks and launch bounds
// as attention_flash.cu's, named with `_kp` after the block size (attention_flash_fwd_d64r128_kp_bf16).

#include "prelude.cuh"
#include "attention.cuh"
#include "attention_mma_stage.cuh"
#include "attention_flash.cuh"

FA_INSTANCES(bf16, _kp, true, false)
FA_INSTANCES(f16, _kp, true, false)
