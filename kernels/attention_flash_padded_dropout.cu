// The flash attention kernels with key padding and the probabilities' dropout (PAD and DROP in
// kernels/attention_flash.cuh, which says what they compute): the same blocks and launch bounds
// as attention_flash_padded.cu's, named with `_kp_dp` after the block size
// (attention_flash_fwd_d64r128_kp_dp_bf16).

#include "prelude.cuh"
#include "attention.cuh"
#include "attention_mma_stage.cuh"
#include "attention_flash.cuh"

FA_INSTANCES(bf16, _kp_dp, true, true)
FA_INSTANCES(f16, _kp_dp, true, true)
