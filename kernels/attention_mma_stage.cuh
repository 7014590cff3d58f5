// How the tensor-core attention kernels (kernels/attention_mma.cu, kernels/attention_flash.cuh)
// fill their shared 16-bit tiles and per-row scratch, and the warp-level pieces both use: the
// mma.sync product, accumulators as operands, quad reductions; the tile constants and the f32 ->
// 16-bit pair conversion, Q/K/V/dO tiles
// staged row-major and/or transposed (16-byte loads where rows are 16-byte aligned, scalar loops
// otherwise), Δ = Σ dO·O per row, and whether a 64 x 64 tile of the mask adds nothing. Included
// after prelude.cuh and attention.cuh; served from memory like them (registry.rs HEADERS).
//
// The products' 16-bit type P: bf16 for bf16 tensors and for f32 ones at bf16 precision, f16 for
// f16 tensors and for f32 ones at f16 precision (fp16 sessions: no bf16 rounding of their
// values, and f16's 10-bit mantissa for P and dS).

#define AM_TILE 64  // rows (fwd, dq) or keys (dkv) per block, and the loop's tile
#define AM_PAD 8    // 16-bit elements of padding per shared row (16 bytes)
#define AM_LDT (AM_TILE + AM_PAD)  // row of a tile whose rows are 64 long

// The products' type P: its bits from an f32 (round to nearest), two f32 as a pair (lo in the
// low half), and c += a · b (16 x 8 x 16, P operands, f32 accumulators). PTX names the type
// ("bf16", "f16"); EMU_F16 is cuda-emu's operand flag.
template <typename P> struct AmProd;
#ifdef ORT_CPU_EMU
#define AM_PROD_PACK(P, PTX) return (u32)ort_emu_f32_to_##P(lo) | ((u32)ort_emu_f32_to_##P(hi) << 16);
#define AM_PROD_MMA(PTX, EMU_F16) ort_emu_mma_m16n8k16(c, a, b0, b1, EMU_F16);
#else
#define AM_PROD_PACK(P, PTX)                                                 \
    u32 r;                                                                   \
    asm("cvt.rn." PTX "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); \
    return r;
#define AM_PROD_MMA(PTX, EMU_F16)                                                                                              \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};" \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                                           \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
#define AM_PROD(P, PTX, EMU_F16)                                                                                    \
    template <> struct AmProd<P> {                                                                                  \
        static __device__ __forceinline__ u16 bits(f32 x) { return f32_to_##P(x).bits; }                            \
        static __device__ __forceinline__ u32 pack(f32 lo, f32 hi) { AM_PROD_PACK(P, PTX) }                         \
        static __device__ __forceinline__ void mma(f32 c[4], const u32 a[4], u32 b0, u32 b1) { AM_PROD_MMA(PTX, EMU_F16) } \
    };
AM_PROD(bf16, "bf16", 0)
AM_PROD(f16, "f16", 1)

// Accumulators c[j] (16 x 8 tiles j, j + 1 side by side) as the A fragment of a 16 x 16 operand.
template <typename P> __device__ __forceinline__ void am_c_to_a(u32 a[4], const f32 c0[4], const f32 c1[4]) {
    a[0] = AmProd<P>::pack(c0[0], c0[1]);
    a[1] = AmProd<P>::pack(c0[2], c0[3]);
    a[2] = AmProd<P>::pack(c1[0], c1[1]);
    a[3] = AmProd<P>::pack(c1[2], c1[3]);
}

// Σ over the row of the quad's 4 threads (the lanes holding one accumulator row).
__device__ __forceinline__ f32 am_quad_sum(f32 v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ f32 am_quad_max(f32 v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// dst[r·ld + c] = src[(r0 + r)·ld_src + c] as P for 64 rows and `width` columns; zeros past `rows`.
template <typename P, typename E>
__device__ __forceinline__ void am_stage_rows(u16* dst, int ld, const E* src, i64 ld_src, i64 r0, i64 rows, int width) {
    for (int e = threadIdx.x; e < AM_TILE * width; e += blockDim.x) {
        const int r = e / width, c = e % width;
        dst[r * ld + c] = AmProd<P>::bits(r0 + r < rows ? Num<E>::load(src[(r0 + r) * ld_src + c]) : 0.f);
    }
}

// The transpose: dst[c·AM_LDT + r] = src[(r0 + r)·ld_src + c].
template <typename P, typename E>
__device__ __forceinline__ void am_stage_rows_t(u16* dst, const E* src, i64 ld_src, i64 r0, i64 rows, int width) {
    for (int e = threadIdx.x; e < AM_TILE * width; e += blockDim.x) {
        const int r = e / width, c = e % width;
        dst[c * AM_LDT + r] = AmProd<P>::bits(r0 + r < rows ? Num<E>::load(src[(r0 + r) * ld_src + c]) : 0.f);
    }
}

// Keys c0.. of Kt (element (d, key) at kt[d·k_d + key·k_s]) into dst[d·ld_d + c·ld_c] as P,
// zero past S: walked along whichever of the two is contiguous in memory (keys in layout BHSD,
// d in BSHD).
template <typename P, typename E>
__device__ __forceinline__ void am_stage_k(u16* dst, int ld_d, int ld_c, const E* kt, const AttnShape& a, i64 c0, int D) {
    const bool keys_inner = a.k_s == 1;
    for (int e = threadIdx.x; e < AM_TILE * D; e += blockDim.x) {
        const int d = keys_inner ? e / AM_TILE : e % D, c = keys_inner ? e % AM_TILE : e / D;
        dst[d * ld_d + c * ld_c] = AmProd<P>::bits(c0 + c < a.S ? Num<E>::load(kt[d * a.k_d + (c0 + c) * a.k_s]) : 0.f);
    }
}

// Columns c0.. of Kt d-major: dst[d·AM_LDT + c].
template <typename P, typename E>
__device__ __forceinline__ void am_stage_cols(u16* dst, const E* kt, const AttnShape& a, i64 c0, int D) {
    am_stage_k<P>(dst, AM_LDT, 1, kt, a, c0, D);
}

// The same columns key-major: dst[c·ld + d].
template <typename P, typename E>
__device__ __forceinline__ void am_stage_cols_t(u16* dst, int ld, const E* kt, const AttnShape& a, i64 c0, int D) {
    am_stage_k<P>(dst, 1, ld, kt, a, c0, D);
}

// ---- 16-byte staging: the common case, rows 16-byte aligned. With the scalar loops above
// alone GPT-2 124M's attention ran at 14 TFLOP/s on an H200: each thread waited for its 2-byte
// loads one after another, 32 a 64 x 64 tile ----

// Whether rows of p, ld elements apart, all start 16-byte aligned.
template <typename E>
__device__ __forceinline__ bool am_aligned16(const E* p, i64 ld) {
    return ((reinterpret_cast<unsigned long long>(p) | (unsigned long long)(ld * (i64)sizeof(E))) & 15ull) == 0;
}

// 16 bytes of E: V elements; as pairs of the products' type P (W words: a 16-bit E's own bits,
// which must be P; f32 rounded to nearest); as f32s; and the W words stored at a 16-bit tile's
// row.
template <typename A, typename B> struct AmSame { static constexpr bool value = false; };
template <typename A> struct AmSame<A, A> { static constexpr bool value = true; };
template <typename E> struct AmChunk;
template <typename E> struct AmChunk16 {
    static constexpr int V = 8, W = 4;
    template <typename P> static __device__ __forceinline__ void words(const uint4& v, u32 w[W]) {
        static_assert(AmSame<P, E>::value, "16-bit tensors multiply in their own type");
        w[0] = v.x;
        w[1] = v.y;
        w[2] = v.z;
        w[3] = v.w;
    }
    static __device__ __forceinline__ void floats(const uint4& v, f32 f[V]) {
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            f[2 * k] = Num<E>::load(E{(u16)(w[k] & 0xffffu)});
            f[2 * k + 1] = Num<E>::load(E{(u16)(w[k] >> 16)});
        }
    }
    static __device__ __forceinline__ void store(u16* dst, const u32 w[W]) { *reinterpret_cast<uint4*>(dst) = uint4{w[0], w[1], w[2], w[3]}; }
};
template <> struct AmChunk<bf16> : AmChunk16<bf16> {};
template <> struct AmChunk<f16> : AmChunk16<f16> {};
template <> struct AmChunk<f32> {
    static constexpr int V = 4, W = 2;
    template <typename P> static __device__ __forceinline__ void words(const uint4& v, u32 w[W]) {
        w[0] = AmProd<P>::pack(__uint_as_float(v.x), __uint_as_float(v.y));
        w[1] = AmProd<P>::pack(__uint_as_float(v.z), __uint_as_float(v.w));
    }
    static __device__ __forceinline__ void floats(const uint4& v, f32 f[V]) {
        f[0] = __uint_as_float(v.x);
        f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z);
        f[3] = __uint_as_float(v.w);
    }
    static __device__ __forceinline__ void store(u16* dst, const u32 w[W]) { *reinterpret_cast<uint2*>(dst) = uint2{w[0], w[1]}; }
};

// Rows r0..r0 + 63 of the matrix at src (rows ld elements apart, HD contiguous columns; zeros
// from row `rows` on) as P into dst (row-major, rows HD + AM_PAD apart) and/or dst_t (the
// transpose: element (r, c) at c·AM_LDT + r); a null destination is skipped. Thread t owns row
// t % 64 and every other 16-byte chunk of it, and issues all its loads before its first store.
// Rows that are not 16-byte aligned take the scalar loops.
template <int HD, typename P, typename E>
__device__ __forceinline__ void am_stage(u16* dst, u16* dst_t, const E* src, i64 ld, i64 r0, i64 rows) {
    if (!am_aligned16(src, ld)) {
        if (dst) am_stage_rows<P>(dst, HD + AM_PAD, src, ld, r0, rows, HD);
        if (dst_t) am_stage_rows_t<P>(dst_t, src, ld, r0, rows, HD);
        return;
    }
    constexpr int V = AmChunk<E>::V, W = AmChunk<E>::W, PER = AM_TILE * HD / V / 128;
    static_assert(PER * 128 * V == AM_TILE * HD, "a 64-row tile is whole chunks for 128 threads");
    const int r = threadIdx.x & (AM_TILE - 1), first = threadIdx.x >> 6;
    const bool in = r0 + r < rows;
    const E* row = src + (in ? (r0 + r) * ld : 0);
    uint4 buf[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) buf[i] = in ? *reinterpret_cast<const uint4*>(row + (first + 2 * i) * V) : uint4{0u, 0u, 0u, 0u};
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int c = (first + 2 * i) * V;
        u32 w[W];
        AmChunk<E>::template words<P>(buf[i], w);
        if (dst) AmChunk<E>::store(dst + r * (HD + AM_PAD) + c, w);
        if (dst_t)
#pragma unroll
            for (int k = 0; k < W; ++k) {
                dst_t[(c + 2 * k) * AM_LDT + r] = (u16)(w[k] & 0xffffu);
                dst_t[(c + 2 * k + 1) * AM_LDT + r] = (u16)(w[k] >> 16);
            }
    }
}

// Keys c0..c0 + 63 of Kᵀ (zeros from key S on) into ks (key-major [64][HD + AM_PAD]) and/or kd
// (d-major [HD][AM_LDT]): in layout BSHD (d contiguous) the keys are rows for am_stage.
template <int HD, typename P, typename E>
__device__ __forceinline__ void am_stage_keys(u16* ks, u16* kd, const E* kt, const AttnShape& a, i64 c0) {
    if (a.k_d == 1) {
        am_stage<HD, P>(ks, kd, kt, a.k_s, c0, a.S);
        return;
    }
    if (ks) am_stage_cols_t<P>(ks, HD + AM_PAD, kt, a, c0, HD);
    if (kd) am_stage_cols<P>(kd, kt, a, c0, HD);
}

// Δ = Σ dO·O of rows t0.. of the tile into delta[64] (warp w: rows w, w + 4, ...); dout, o at
// the batch entry, rows o_t apart.
template <typename E>
__device__ __forceinline__ void am_delta(f32* delta, const E* dout, const E* o, i64 o_t, i64 T, int Dv, i64 t0, int w, int lane) {
    for (int r = w; r < AM_TILE; r += 4) {
        const i64 row = t0 + r;
        f32 s = 0.f;
        if (row < T)
            for (int d = lane; d < Dv; d += 32) s += Num<E>::load(dout[row * o_t + d]) * Num<E>::load(o[row * o_t + d]);
        s = att_warp_sum(s);
        if (lane == 0) delta[r] = s;
    }
}

// am_delta with 16-byte loads where the rows allow: thread t sums half of row t / 2 (all its
// loads issued first), the neighbouring lane the other half.
template <int HD, typename E>
__device__ __forceinline__ void am_delta_rows(f32* delta, const E* dout, const E* o, i64 o_t, i64 T, i64 t0, int w, int lane) {
    if (!am_aligned16(dout, o_t) || !am_aligned16(o, o_t)) {
        am_delta(delta, dout, o, o_t, T, HD, t0, w, lane);
        return;
    }
    constexpr int V = AmChunk<E>::V, PER = HD / 2 / V;
    const int r = threadIdx.x >> 1, half = threadIdx.x & 1;
    const i64 row = t0 + r;
    f32 sum = 0.f;
    if (row < T) {
        const E* pd = dout + row * o_t + half * (HD / 2);
        const E* po = o + row * o_t + half * (HD / 2);
        uint4 bd[PER], bo[PER];
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            bd[i] = *reinterpret_cast<const uint4*>(pd + i * V);
            bo[i] = *reinterpret_cast<const uint4*>(po + i * V);
        }
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            f32 fd[V], fo[V];
            AmChunk<E>::floats(bd[i], fd);
            AmChunk<E>::floats(bo[i], fo);
#pragma unroll
            for (int j = 0; j < V; ++j) sum += fd[j] * fo[j];
        }
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if (half == 0) delta[r] = sum;
}

// att_tile_dead_n for a 64 x 64 tile: where the tile lies inside the matrix and the mask's rows
// are 16-byte aligned with contiguous columns, thread t reads row t % 64 as 8 float4 loads issued
// at once and asks `settled` once; else the scalar scan.
template <typename Settled>
__device__ __forceinline__ bool am_tile_dead(const f32* mask, i64 mo, i64 r0, i64 c0, const AttnShape& a, Settled settled, i32 causal) {
    if (causal) return c0 > r0 + AM_TILE - 1;  // every key past every query: the same for the whole block
    if (!mask || a.mask_s != 1 || r0 + AM_TILE > a.T || c0 + AM_TILE > a.S || !am_aligned16(mask + mo + c0, a.mask_t))
        return att_tile_dead_n(mask, mo, r0, c0, a.T, a.S, a.mask_t, a.mask_s, AM_TILE, AM_TILE, settled);
    const int r = threadIdx.x & (AM_TILE - 1), first = threadIdx.x >> 6;
    const f32* row = mask + mo + (r0 + r) * a.mask_t + c0;
    float4 m[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) m[i] = *reinterpret_cast<const float4*>(row + (first + 2 * i) * 4);
    bool live = false, at_min = false;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const f32 x[4] = {m[i].x, m[i].y, m[i].z, m[i].w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (x[k] == -ATT_INF) continue;
            if (x[k] <= ATT_MASKED_MIN)
                at_min = true;
            else
                live = true;  // NaN too
        }
    }
    if (!live && at_min && !settled(r0 + r)) live = true;
    return __syncthreads_or(live) == 0;
}
