// The flash attention kernels without key padding (kernels/attention_flash.cuh has them and
// says what they compute; attention_flash_padded.cu has those with key padding).

#include "prelude.cuh"
#include "attention.cuh"
#include "attention_mma_stage.cuh"
#include "attention_flash.cuh"

// Every kernel of the file for the 16-bit type P. Heads of 64, 64-row blocks: 3 blocks (12 warps)
// an SM at 168 registers a thread, where unbounded ptxas takes 182 (forward) and 203 (dQ), which
// leave 2; the price is 24 bytes of dQ spills (NVRTC 13.0, bf16). 128-row blocks (r128: 32 rows or
// keys a warp, each fragment of the other operand read from shared memory once for two row tiles:
// the forward's and dQ's shared-memory traffic per FLOP halved, dK/dV's cut by a third): 255
// registers, 2 blocks an SM, 4 (forward), 36 (dQ) and 48 (dK/dV) bytes of spills.
#define FA_KERNELS(P)                               \
    FA_ROW_KERNELS(64, 1, , 3, P, false, false)     \
    FA_ROW_KERNELS(64, 2, r128, 2, P, false, false) \
    FA_ROW_KERNELS(128, 1, , 1, P, false, false)    \
    FA_DKV_KERNEL(64, 1, , P, false, false)         \
    FA_DKV_KERNEL(64, 2, r128, P, false, false)     \
    FA_DKV_KERNEL(128, 1, , P, false, false)
FA_KERNELS(bf16)
FA_KERNELS(f16)
