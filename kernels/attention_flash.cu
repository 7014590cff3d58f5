// The flash attention kernels without key padding (kernels/attention_flash.cuh has them and
// says what they compute; attention_flash_padded.cu has those with key padding).

#include "prelude.cuh"
#include "attention.cuh"
#include "attention_mma_stage.cuh"
#include "attention_flash.cuh"

FA_INSTANCES(bf16, , false, false)
FA_INSTANCES(f16, , false, false)
