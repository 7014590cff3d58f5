#pragma once
// The data movement under the flash attention kernels (kernels/attention_flash.cuh): cp.async
// from global to shared memory, ldmatrix into mma.sync fragments of row-major tiles, and the
// softmax's exp2 (cuda-emu: its scheduler's collective operations and the C library).
// (the including file has included prelude.cuh)

// ---- the asynchronous copy and ldmatrix (cuda-emu: collective operations of its scheduler) ----

// BYTES (16: cache-global, bypassing L1; 4: cache-all) from src, zero-filled past src_bytes.
template <int BYTES> __device__ __forceinline__ void fa_cp_async(void* dst, const void* src, int src_bytes) {
#ifdef ORT_CPU_EMU
    ort_emu_cp_async(dst, src, BYTES, src_bytes);
#else
    static_assert(BYTES == 16 || BYTES == 4, "cp.async of 16 or 4 bytes");
    const u32 s = (u32)__cvta_generic_to_shared(dst);
    if (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src), "r"(src_bytes));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(s), "l"(src), "r"(src_bytes));
#endif
}
__device__ __forceinline__ void fa_commit() {
#ifdef ORT_CPU_EMU
    ort_emu_cp_async_commit();
#else
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// Waits until at most N of this thread's latest groups are in flight.
template <int N> __device__ __forceinline__ void fa_wait() {
#ifdef ORT_CPU_EMU
    ort_emu_cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// Four 8 x 8 16-bit matrices (TRANS: each transposed); this lane names row `row` (16-byte aligned)
// of matrix lane / 8.
template <bool TRANS> __device__ __forceinline__ void fa_ldsm(u32 r[4], const u16* row) {
#ifdef ORT_CPU_EMU
    ort_emu_ldmatrix_x4(r, row, TRANS ? 1 : 0);
#else
    const u32 s = (u32)__cvta_generic_to_shared(row);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(s));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(s));
#endif
}

// 2^x, flushing a subnormal result to 0 (MUFU.EX2 alone: exp2f adds the subnormal handling).
__device__ __forceinline__ f32 fa_exp2(f32 x) {
#ifdef ORT_CPU_EMU
    const f32 r = exp2f(x);
    return r < 1.17549435e-38f ? 0.f : r;
#else
    f32 r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
#endif
}

// ---- fragments of row-major tiles (rows `ld` elements apart; attention_mma.cu's header says
// which elements each lane holds) ----

// The A fragment of rows r0..r0 + 15, columns k0..k0 + 15.
__device__ __forceinline__ void fa_a(u32 a[4], const u16* t, int ld, int r0, int k0, int lane) {
    fa_ldsm<false>(a, t + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + k0 + (lane >> 4) * 8);
}
// B fragments (b[0], b[1]: columns n0..n0 + 7; b[2], b[3]: n0 + 8..) for k0..k0 + 15 of a tile
// whose rows are the product's columns (Kᵀ from K: [key][d], n = key, k = d).
__device__ __forceinline__ void fa_b_rows(u32 b[4], const u16* t, int ld, int n0, int k0, int lane) {
    fa_ldsm<false>(b, t + (n0 + (lane & 7) + (lane >> 4) * 8) * ld + k0 + ((lane >> 3) & 1) * 8);
}
// The same where the tile's rows are the product's k (V from V: [key][d], k = key, n = d).
__device__ __forceinline__ void fa_b_cols(u32 b[4], const u16* t, int ld, int k0, int n0, int lane) {
    fa_ldsm<true>(b, t + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8);
}
