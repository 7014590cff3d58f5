#pragma once
// The counter-based generator of the random kernels (kernels/dropout.cu) and of the fused
// attention's dropout (attention.cuh): Philox4x32-10 (Salmon et al., SC 2011), the 24-bit
// uniform the dropout compares with its ratio, and SplitMix64's finaliser that mixes a step's
// seed with a node's salt. engine/src/backend/cuda/philox.rs computes the same on the host.
// Served from memory like prelude.cuh (engine/src/backend/cuda/registry.rs HEADERS).

struct U4 { u32 x, y, z, w; };

__device__ __forceinline__ U4 philox4x32_10(U4 c, u32 k0, u32 k1) {
    const u32 M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const u32 hi0 = __umulhi(M0, c.x), lo0 = M0 * c.x;
        const u32 hi1 = __umulhi(M1, c.z), lo1 = M1 * c.z;
        c = U4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
        k0 += W0;
        k1 += W1;
    }
    return c;
}

// The four words of counter g under a 64-bit key.
__device__ __forceinline__ U4 philox_words(u64 key, u64 g) {
    return philox4x32_10(U4{(u32)g, (u32)(g >> 32), 0u, 0u}, (u32)key, (u32)(key >> 32));
}

// Word k (0..3) of r.
__device__ __forceinline__ u32 philox_word(const U4& r, int k) { return k == 0 ? r.x : k == 1 ? r.y : k == 2 ? r.z : r.w; }

// Uniform in [0, 1) from the top 24 bits (exact in f32).
__device__ __forceinline__ f32 uniform24(u32 r) { return (f32)(r >> 8) * (1.0f / 16777216.0f); }

// SplitMix64's finaliser (Steele, Lea and Flood, OOPSLA 2014), as ops/random.rs computes it.
__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
