// Shared by the attention kernel families (kernels/attention.cu: SIMT f32; kernels/attention_mma.cu:
// tensor cores): the kernels' shape argument, batch offsets, warp reductions and the masked,
// scaled score. Served from memory like prelude.cuh (engine/src/backend/cuda/registry.rs HEADERS).

#define ATT_INF __int_as_float(0x7f800000)
#define ATT_NAN __int_as_float(0x7fc00000)

struct AttnShape {
    i64 dims[4];  // the full batch, padded with leading 1s
    i64 q[4];     // batch strides of each input (elements; 0 where broadcast)
    i64 k[4];
    i64 v[4];
    i64 m[4];
    i64 T, S, D, Dv;
    i64 mask_t, mask_s;  // the mask's strides along T and S
};

struct AttnOff {
    i64 q, k, v, m;
};

__device__ __forceinline__ AttnOff attn_offsets(const AttnShape& b, i64 bi) {
    AttnOff o = {0, 0, 0, 0};
    for (int d = 3; d >= 0; --d) {
        const i64 i = bi % b.dims[d];
        bi /= b.dims[d];
        o.q += i * b.q[d];
        o.k += i * b.k[d];
        o.v += i * b.v[d];
        o.m += i * b.m[d];
    }
    return o;
}

__device__ __forceinline__ f32 att_warp_max(f32 v) {
    for (int s = 16; s > 0; s >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, s));
    return v;
}
__device__ __forceinline__ f32 att_warp_sum(f32 v) {
    for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
    return v;
}

// Whether every score of rows r0.. and columns c0.. (a rows x cols tile) is -inf: outside the
// matrix or masked with -inf (a causal mask's upper triangle). The whole block gets the answer.
// M: the mask's element type (f32, or bf16 in 16-bit plans).
template <typename M>
__device__ __forceinline__ bool att_tile_dead_n(const M* mask, i64 mo, i64 r0, i64 c0, i64 T, i64 S, i64 mt, i64 ms, int rows, int cols) {
    int live = 0;
    if (mask) {
        for (int e = threadIdx.x; e < rows * cols; e += blockDim.x) {
            const i64 r = r0 + e / cols, c = c0 + e % cols;
            if (r < T && c < S && Num<M>::load(mask[mo + r * mt + c * ms]) != -ATT_INF) live = 1;
        }
    } else {
        live = 1;
    }
    return __syncthreads_or(live) == 0;
}

// The score of (row, col) after scale and mask; -inf outside the matrix.
template <typename M>
__device__ __forceinline__ f32 att_score(f32 dot, f32 scale, const M* mask, i64 mo, i64 row, i64 col, i64 T, i64 S, i64 mt, i64 ms) {
    if (row >= T || col >= S) return -ATT_INF;
    f32 x = dot * scale;
    if (mask) x += Num<M>::load(mask[mo + row * mt + col * ms]);
    return x;
}

