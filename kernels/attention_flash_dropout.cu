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

FA_INSTANCES(bf16, _dp, false, true)
FA_INSTANCES(f16, _dp, false, true)
