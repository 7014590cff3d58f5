// Shared by the attention kernel families (kernels/attention.cu: SIMT f32; kernels/attention_mma.cu:
// tensor cores): the kernels' shape argument, batch offsets, warp reductions, the masked,
// scaled score and the probabilities' dropout. Served from memory like prelude.cuh
// (engine/src/backend/cuda/registry.rs HEADERS).

#include "philox.cuh"

#define ATT_INF __int_as_float(0x7f800000)
#define ATT_NAN __int_as_float(0x7fc00000)

struct AttnShape {
    i64 dims[4];  // the full batch, padded with leading 1s
    i64 q[4];     // batch strides of each input (elements; 0 where broadcast)
    i64 k[4];
    i64 v[4];
    i64 m[4];
    i64 o[4];  // batch strides of O and dO, then of dQ, dKt, dV
    i64 gq[4];
    i64 gk[4];
    i64 gv[4];
    i64 T, S, D, Dv;
    i64 mask_t, mask_s;  // the mask's strides along T and S
    // strides inside the matrices (columns of Q, V, O contiguous): Q and dQ along T; Kt and dKt
    // along S and D (1 and S in layout BHSD, H·D and 1 in BSHD); V and dV along S; O and dO along T
    i64 q_t, k_s, k_d, v_s, o_t;
    // the probabilities' dropout (att_drop): the device address of its stream key, an int64
    // DropoutKey wrote (0: no dropout), its ratio and 1 / (1 - ratio)
    u64 drop_key;
    f32 drop_p, drop_scale;
};

struct AttnOff {
    i64 q, k, v, m, o, gq, gk, gv;
};

__device__ __forceinline__ AttnOff attn_offsets(const AttnShape& b, i64 bi) {
    AttnOff o = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int d = 3; d >= 0; --d) {
        const i64 i = bi % b.dims[d];
        bi /= b.dims[d];
        o.q += i * b.q[d];
        o.k += i * b.k[d];
        o.v += i * b.v[d];
        o.m += i * b.m[d];
        o.o += i * b.o[d];
        o.gq += i * b.gq[d];
        o.gk += i * b.gk[d];
        o.gv += i * b.gv[d];
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

// The dropout of one batch matrix's probabilities (engine/src/ops/attention.rs, AttnShape's
// drop_*). Its element (row, col) is element flat = (bi·T + row)·S + col of the full batch's
// [.., T, S] probabilities, and a Dropout of that tensor keyed as the DropoutKey's key
// (kernels/dropout.cu: word flat % 4 of Philox counter flat / 4, a 24-bit uniform at or above
// the ratio) keeps it: the fused kernels multiply a kept probability by 1 / (1 - ratio) and a
// dropped one by 0, exactly where the unfused graph's Dropout would have. Without dropout
// every factor is 1.
struct AttDrop {
    u64 key;
    i64 base, S;  // bi·T·S, and S
    // a word keeps its element when word >= thr: uniform24(word) >= ratio exactly, since
    // (word >> 8)·2^-24 >= ratio ⇔ word >> 8 >= ceil(ratio·2^24) (ratio·2^24 is exact in f32,
    // and below 2^24 for a ratio under 1, so the shift cannot overflow)
    u32 thr;
    f32 scale;
    bool on;
};
__device__ __forceinline__ AttDrop att_drop(const AttnShape& a, i64 bi) {
    AttDrop d;
    d.on = a.drop_key != 0;
    d.key = d.on ? *reinterpret_cast<const u64*>(a.drop_key) : 0;
    d.base = bi * a.T * a.S;
    d.S = a.S;
    d.thr = (u32)ceilf(a.drop_p * 16777216.f) << 8;
    d.scale = a.drop_scale;
    return d;
}
__device__ __forceinline__ f32 att_drop_keep(const AttDrop& d, u32 word) { return word >= d.thr ? d.scale : 0.f; }
// The factor of element (row, col).
__device__ __forceinline__ f32 att_drop_at(const AttDrop& d, i64 row, i64 col) {
    if (!d.on) return 1.f;
    const u64 flat = (u64)(d.base + row * d.S + col);
    return att_drop_keep(d, philox_word(philox_words(d.key, flat >> 2), (int)(flat & 3)));
}
// The keep bits of the 4 elements of a counter (bit k: word k's).
__device__ __forceinline__ u32 att_drop_nibble(const AttDrop& d, u64 counter) {
    const U4 r = philox_words(d.key, counter);
    return (u32)(r.x >= d.thr) | (u32)(r.y >= d.thr) << 1 | (u32)(r.z >= d.thr) << 2 | (u32)(r.w >= d.thr) << 3;
}

// Where the tensor-core and flash kernels' dropout draws: an element's keep bit is one word of
// a Philox counter that covers 4 consecutive elements of a row, and an mma accumulator
// fragment spreads those elements over several lanes (8 consecutive keys of a query row over
// the 4 lanes of a quad in the forward and dQ kernels, 16 consecutive keys of a query over the
// 8 lanes of a column in the transposed dK/dV products). So the lanes that hold a run of
// elements draw its counters between them, one or two each, and OR their keep bits together
// by shuffles: a quarter of a draw per element, where a draw per pair of adjacent keys
// (forward, dQ) or per element (dK/dV) would draw each counter two or four times over.

// The keep bits of keys c0 .. c0 + 63 of query `row` (bit c: key c0 + c kept), for each lane of
// the quad `qd` belongs to. Key c0 + c is word (skew + c) % 4 of counter f0 / 4 + (skew + c) / 4
// for f0 = flat(row, c0) and skew = f0 % 4: the run spans 16 counters, 17 unless skew is 0;
// lane qd draws counters qd, qd + 4, qd + 8 and qd + 12 (and lane 0 the 17th), each a nibble
// of bits placed without a shift that depends on the lane until the quad's OR. Every lane of
// the warp calls it.
__device__ __forceinline__ u64 att_drop_row_bits(const AttDrop& d, i64 row, i64 c0, int qd) {
    const u64 f0 = (u64)(d.base + row * d.S + c0);
    const int skew = (int)(f0 & 3);
    const u64 m0 = (f0 >> 2) + (u64)qd;
    u64 lo = 0;  // bit skew + c (c < 64 - skew)
#pragma unroll
    for (int n = 0; n < 4; ++n) lo |= (u64)att_drop_nibble(d, m0 + 4 * n) << (16 * n);
    lo <<= 4 * qd;
    u32 hi = skew != 0 && qd == 0 ? att_drop_nibble(d, m0 + 16) : 0u;  // bits 64 .. 67
    lo |= __shfl_xor_sync(0xffffffffu, lo, 1);
    lo |= __shfl_xor_sync(0xffffffffu, lo, 2);
    hi |= __shfl_xor_sync(0xffffffffu, hi, 1);
    hi |= __shfl_xor_sync(0xffffffffu, hi, 2);
    return skew != 0 ? lo >> skew | (u64)hi << (64 - skew) : lo;
}

// x[mt] (a warp's 16 x 64 mma accumulators: rows row0 + 16mt + g and + 8, keys
// c0 + 8j + 2qd + c) times the dropout's factors (the tensor-core and flash kernels).
template <int MT>
__device__ __forceinline__ void att_drop_rows(f32 x[MT][8][4], const AttDrop& drop, i64 row0, i64 c0, int g, int qd) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u64 bits = att_drop_row_bits(drop, row0 + 16 * mt + g + 8 * h, c0, qd) >> (2 * qd);
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) x[mt][j][2 * h + c] *= (bits >> (8 * j + c)) & 1ull ? drop.scale : 0.f;
        }
}

// The keep bits of keys key0 .. key0 + 15 for queries q and q + 1 (bit 16·dq + kk: query
// q + dq, key key0 + kk), for each lane of the column (the 8 lanes of quad index qd, g = 0..7)
// holding them in a transposed product: lanes g = 0..3 draw query q's 4 counters (lane 0 a
// fifth unless flat(q, key0) is a multiple of 4), lanes 4..7 query q + 1's. Every lane of the
// warp calls it.
__device__ __forceinline__ u32 att_drop_col_bits(const AttDrop& d, i64 q, i64 key0, int g) {
    const int dq = g >> 2, part = g & 3;
    const u64 f0 = (u64)(d.base + (q + dq) * d.S + key0);
    const int skew = (int)(f0 & 3);
    u32 v = att_drop_nibble(d, (f0 >> 2) + (u64)part) << (4 * part);  // bit skew + kk
    if (skew != 0 && part == 0) v |= att_drop_nibble(d, (f0 >> 2) + 4) << 16;
    u32 bits = (v >> skew & 0xffffu) << (16 * dq);
    bits |= __shfl_xor_sync(0xffffffffu, bits, 4);
    bits |= __shfl_xor_sync(0xffffffffu, bits, 8);
    return bits | __shfl_xor_sync(0xffffffffu, bits, 16);
}

// The transposed products of the dK/dV kernels: x[mt] (a warp's 16 x 8·NJ accumulators: keys
// key0 + 16mt + g and + 8, queries q0 + 8j + 2qd + c) times the dropout's factors. Returns
// which elements are kept: bit (mt·NJ + j)·4 + e (MT·NJ·4 <= 32), for `att_drop_kept`.
template <int MT, int NJ>
__device__ __forceinline__ u32 att_drop_keys(f32 x[MT][NJ][4], const AttDrop& drop, i64 key0, i64 q0, int g, int qd) {
    u32 kept = 0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const u32 bits = att_drop_col_bits(drop, q0 + 8 * j + 2 * qd, key0 + 16 * mt, g) >> g;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const u32 k = (bits >> (16 * (e & 1) + 8 * (e >> 1))) & 1u;
                kept |= k << ((mt * NJ + j) * 4 + e);
                x[mt][j][e] *= k ? drop.scale : 0.f;
            }
        }
    return kept;
}
// x∘Z from the bits `att_drop_keys` returned: kept elements times 1 / (1 - ratio), others 0.
template <int MT, int NJ>
__device__ __forceinline__ void att_drop_kept(f32 x[MT][NJ][4], u32 kept, const AttDrop& drop) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) x[mt][j][e] = (kept >> ((mt * NJ + j) * 4 + e)) & 1u ? x[mt][j][e] * drop.scale : 0.f;
}

// A mask value at or below this is PyTorch's finfo(float32).min (-3.40e38; bf16's -3.39e38), the
// "minus infinity" of Hugging Face's causal masks (GPT-2 exports Where(causal, 0, finfo.min)).
#define ATT_MASKED_MIN (-3.0e38f)
// A row whose running max (forward) or LSE (backward) is above this has a real score: for it,
// a score at or below ATT_MASKED_MIN is over 2e38 below and its exp is exactly 0.
#define ATT_SETTLED (-1.0e38f)

// No row is settled (only -inf counts as masked): the SIMT kernels.
struct AttNoneSettled {
    __device__ __forceinline__ bool operator()(i64) const { return false; }
};
// Every row of the block is settled or not, as one (the forward: running maxima in registers).
struct AttAllSettled {
    bool all;
    __device__ __forceinline__ bool operator()(i64) const { return all; }
};
// Row r is settled when its LSE is (the backward kernels; lse at the batch entry's rows).
struct AttLseSettled {
    const f32* lse;
    __device__ __forceinline__ bool operator()(i64 r) const { return lse[r] > ATT_SETTLED; }
};

// Whether the rows x cols tile at rows r0.., columns c0.. adds nothing: every score is -inf
// (outside the matrix, or masked with -inf: a causal mask's upper triangle) or masked with
// finfo.min in a row that is `settled` (has a real score: exp of the difference is exactly 0; a
// row masked everywhere by finfo.min keeps its tiles and gets PyTorch's uniform weights). The
// whole block gets the answer. M: the mask's element type (f32, or bf16 in 16-bit plans).
template <typename M, typename Settled>
__device__ __forceinline__ bool att_tile_dead_n(const M* mask, i64 mo, i64 r0, i64 c0, i64 T, i64 S, i64 mt, i64 ms, int rows, int cols,
                                                Settled settled) {
    int live = 0;
    if (mask) {
        for (int e = threadIdx.x; e < rows * cols; e += blockDim.x) {
            const i64 r = r0 + e / cols, c = c0 + e % cols;
            if (r >= T || c >= S) continue;
            const f32 x = Num<M>::load(mask[mo + r * mt + c * ms]);
            if (x != -ATT_INF && !(x <= ATT_MASKED_MIN && settled(r))) live = 1;
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

