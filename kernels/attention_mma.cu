// Fused attention on tensor cores (engine/src/ops/attention.rs; the SIMT f32 kernels in
// kernels/attention.cu compute the same, and the CPU kernel is the reference of both): the same
// arguments, outputs and semantics (layouts BHSD and BSHD through AttnShape's strides, additive
// mask with strides, nan_guard, LSE saved, the backward as one kernel for dQ and one for dKt and
// dV, no atomics), for 16-bit tensors and for sessions whose f32 matmuls run at 16-bit precision
// (`precision="bf16"` or `"fp16"`): Q·Kᵀ, P·V and the backward's four products are mma.sync
// m16n8k16 with 16-bit operands P (attention_mma_stage.cuh: bf16 or f16, rounded to nearest from
// f32 tensors, and P / dS from their f32 values) and f32 accumulation; softmax statistics, LSE,
// Δ and the outputs' arithmetic are f32. The probabilities' dropout (AttnShape drop_*) as in
// kernels/attention.cu: P∘Z into the product with V (and dV), dS = P∘(Z∘dP − Δ).
//
//   attention_mma_fwd_dHD_T(q, kt, v, mask, o, lse, AttnShape a, f32 scale, i32 nan_guard, i32 causal)
//   attention_mma_bwd_dq_dHD_T(dout, q, kt, v, mask, o, lse, dq, a, scale, causal)
//   attention_mma_bwd_dkv_dHD_T(dout, q, kt, v, mask, o, lse, dkt, dv, a, scale, causal)
//
// T: f32 (bf16 products), f32f16 (f32 tensors, f16 products), bf16, f16.
//
// `causal` (T = S): the mask is computed, not read (mask is then null): a key past its query is
// -inf, every other score unmasked. The dispatcher sets it where the mask is a constant whose
// every entry is 0 up to the diagonal and -inf or finfo.min past it, for which this gives the
// same outputs bit for bit (finfo.min's exp is exactly 0 in a row that has a real score, and
// every row has its diagonal).
//
// HD = D = Dv, 64 or 128. Launch: 128 threads (4 warps, 16 rows each), a 1-D grid of
// batch · ceil(T / 64) blocks (fwd, dq) or batch · ceil(S / 64) (dkv), dynamic shared memory
// of the 16-bit tiles each kernel lays out (the dispatcher computes the same sizes: am_smem_*).
// 64 x 64 tiles whose mask is all -inf are skipped.
//
// Fragments (PTX ISA, mma.m16n8k16, .bf16 and .f16 alike): with g = lane / 4 and q = lane % 4,
// A (16 x 16) holds rows g, g + 8 at k = 2q, 2q + 1 and 2q + 8, 2q + 9; B (16 x 8) holds column g
// at k = 2q, 2q + 1, 2q + 8, 2q + 9; C (16 x 8) holds rows g, g + 8 at columns 2q, 2q + 1. So two C
// tiles side by side are one A fragment: P and dS go from accumulators to operands without
// shared memory.
// Operands are read from shared tiles whose k dimension is contiguous (a pair is one 32-bit load).

#include "prelude.cuh"
#include "attention.cuh"
#include "attention_mma_stage.cuh"

__device__ __forceinline__ u32 am_pair(const u16* t, int ld, int r, int k) { return *reinterpret_cast<const u32*>(t + r * ld + k); }

// The A fragment of rows r0.. and k0.. of a k-contiguous tile.
__device__ __forceinline__ void am_load_a(u32 a[4], const u16* t, int ld, int r0, int k0, int g, int q) {
    a[0] = am_pair(t, ld, r0 + g, k0 + 2 * q);
    a[1] = am_pair(t, ld, r0 + g + 8, k0 + 2 * q);
    a[2] = am_pair(t, ld, r0 + g, k0 + 2 * q + 8);
    a[3] = am_pair(t, ld, r0 + g + 8, k0 + 2 * q + 8);
}

// The B fragment of columns n0.. (tile rows) and k0.. of an n-major, k-contiguous tile.
__device__ __forceinline__ void am_load_b(u32& b0, u32& b1, const u16* t, int ld, int n0, int k0, int g, int q) {
    b0 = am_pair(t, ld, n0 + g, k0 + 2 * q);
    b1 = am_pair(t, ld, n0 + g, k0 + 2 * q + 8);
}

// S = A · Bᵀ for one warp: 16 rows (the A fragments `a`, HD/16 k-steps) by the 64 rows of the
// n-major tile `bt` (k = HD contiguous): s[j] is the 16 x 8 tile of columns 8j.
template <int HD, typename P> __device__ __forceinline__ void am_scores(f32 s[8][4], const u32 a[HD / 16][4], const u16* bt, int g, int q) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            u32 b0, b1;
            am_load_b(b0, b1, bt, HD + AM_PAD, 8 * j, 16 * kk, g, q);
            AmProd<P>::mma(s[j], a[kk], b0, b1);
        }
    }
}

// acc[n] += P · X for one warp: P the 16 x 64 accumulators p (as A fragments), X the tile `xt`
// stored n-major [HD][AM_LDT] (k = the 64 contiguous): acc[n] is the 16 x 8 tile of columns 8n.
template <int HD, typename P> __device__ __forceinline__ void am_accumulate(f32 acc[HD / 8][4], const f32 p[8][4], const u16* xt, int g, int q) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        u32 a[4];
        am_c_to_a<P>(a, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            u32 b0, b1;
            am_load_b(b0, b1, xt, AM_LDT, 8 * n, 16 * kk, g, q);
            AmProd<P>::mma(acc[n], a, b0, b1);
        }
    }
}

// The score of (row, col) as att_score gives it, with the causal mask computed where `causal`.
__device__ __forceinline__ f32 am_score(f32 dot, f32 scale, const f32* mask, i64 mo, i64 row, i64 col, const AttnShape& a, i32 causal) {
    if (causal) return (row >= a.T || col >= a.S || col > row) ? -ATT_INF : dot * scale;
    return att_score(dot, scale, mask, mo, row, col, a.T, a.S, a.mask_t, a.mask_s);
}

// Where a block and a thread are: the batch matrix bi, the block's first row (or key) r0, the
// inputs' offsets, the warp w, the lane's accumulator coordinates (g, qd) and its two rows (or
// keys) r0 + 16w + g and that + 8.
struct AmPlace {
    i64 bi, r0;
    AttnOff off;
    int w, lane, g, qd;
    i64 own[2];
};

__device__ __forceinline__ AmPlace am_place(const AttnShape& a, i64 extent) {
    AmPlace p;
    const i64 tiles = (extent + AM_TILE - 1) / AM_TILE;
    p.bi = blockIdx.x / tiles;
    p.r0 = (blockIdx.x % tiles) * AM_TILE;
    p.off = attn_offsets(a, p.bi);
    p.w = threadIdx.x >> 5;
    p.lane = threadIdx.x & 31;
    p.g = p.lane >> 2;
    p.qd = p.lane & 3;
    p.own[0] = p.r0 + 16 * p.w + p.g;
    p.own[1] = p.own[0] + 8;
    return p;
}

template <int HD, typename E, typename P>
__device__ __forceinline__ void am_fwd(const E* q, const E* kt, const E* v, const f32* mask, E* o, f32* lse, const AttnShape& a, f32 scale,
                                       i32 nan_guard, i32 causal) {
    ORT_DYNAMIC_SHARED(u16, am_smem);
    constexpr int LD = HD + AM_PAD;
    const i64 T = a.T, S = a.S;
    u16* qs = am_smem;            // Q [64][HD]
    u16* ks = qs + AM_TILE * LD;  // K key-major [64][HD]
    u16* vt = ks + AM_TILE * LD;  // Vᵀ [HD][64]
    const AmPlace at = am_place(a, T);
    const i64 bi = at.bi, t0 = at.r0, *rows = at.own;
    const AttnOff off = at.off;
    const AttDrop drop = att_drop(a, bi);
    const int w = at.w, g = at.g, qd = at.qd;
    am_stage<HD, P>(qs, nullptr, q + off.q, a.q_t, t0, T);
    __syncthreads();
    u32 qa[HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) am_load_a(qa[kk], qs, LD, 16 * w, 16 * kk, g, qd);
    f32 m[2] = {-ATT_INF, -ATT_INF}, l[2] = {0.f, 0.f}, acc[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
    for (i64 s0 = 0; s0 < S; s0 += AM_TILE) {
        // a block-wide barrier too: the previous K and V tiles are read
        const bool settled = (rows[0] >= T || m[0] > ATT_SETTLED) && (rows[1] >= T || m[1] > ATT_SETTLED);
        const AttAllSettled all{__syncthreads_and(settled) != 0};
        if (am_tile_dead(mask, off.m, t0, s0, a, all, causal)) continue;  // adds nothing
        am_stage_keys<HD, P>(ks, nullptr, kt + off.k, a, s0);
        am_stage<HD, P>(nullptr, vt, v + off.v, a.v_s, s0, S);
        __syncthreads();
        f32 s[8][4];
        am_scores<HD, P>(s, qa, ks, g, qd);
        f32 mx[2] = {m[0], m[1]};
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const f32 x = am_score(s[j][e], scale, mask, off.m, rows[e >> 1], s0 + 8 * j + 2 * qd + (e & 1), a, causal);
                s[j][e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        f32 sum[2] = {0.f, 0.f}, corr[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = am_quad_max(mx[h]);
            corr[h] = mx[h] == -ATT_INF ? 1.f : expf(m[h] - mx[h]);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int h = e >> 1;
                const f32 p = mx[h] == -ATT_INF ? 0.f : expf(s[j][e] - mx[h]);
                s[j][e] = p;
                sum[h] += p;
            }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            l[h] = l[h] * corr[h] + am_quad_sum(sum[h]);
            m[h] = mx[h];
        }
#pragma unroll
        for (int n = 0; n < HD / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[n][e] *= corr[e >> 1];
        if (drop.on) att_drop_rows<1>(&s, drop, rows[0] - g, s0, g, qd);  // P∘Z
        am_accumulate<HD, P>(acc, s, vt, g, qd);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const i64 row = rows[h];
        if (row >= T) continue;
        const bool empty = m[h] == -ATT_INF;
        const f32 inv = empty ? (nan_guard ? 0.f : ATT_NAN) : 1.f / l[h];
#pragma unroll
        for (int n = 0; n < HD / 8; ++n)
#pragma unroll
            for (int c = 0; c < 2; ++c) o[off.o + row * a.o_t + 8 * n + 2 * qd + c] = Num<E>::store(empty && nan_guard ? 0.f : acc[n][2 * h + c] * inv);
        if (qd == 0) lse[bi * T + row] = empty ? -ATT_INF : m[h] + logf(l[h]);
    }
}

// P of one warp's 16 rows against the 64 keys of tile s0 (s: the scores' dot products, in place),
// from the rows' LSE: 0 where masked, outside the matrix or in an empty row.
__device__ __forceinline__ void am_probs(f32 s[8][4], const i64 rows[2], const f32 lrow[2], i64 s0, int qd, f32 scale, const f32* mask, i64 mo,
                                         const AttnShape& a, i32 causal) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const f32 x = am_score(s[j][e], scale, mask, mo, rows[e >> 1], s0 + 8 * j + 2 * qd + (e & 1), a, causal);
            const f32 lr = lrow[e >> 1];
            s[j][e] = (lr == -ATT_INF || x == -ATT_INF) ? 0.f : expf(x - lr);
        }
}

template <int HD, typename E, typename P>
__device__ __forceinline__ void am_bwd_dq(const E* dout, const E* q, const E* kt, const E* v, const f32* mask, const E* o,
                                          const f32* lse, E* dq, const AttnShape& a, f32 scale, i32 causal) {
    ORT_DYNAMIC_SHARED(u16, am_smem);
    constexpr int LD = HD + AM_PAD;
    const i64 T = a.T, S = a.S;
    u16* qs = am_smem;             // Q [64][HD]
    u16* dos = qs + AM_TILE * LD;  // dO [64][HD]
    u16* ks = dos + AM_TILE * LD;  // K key-major [64][HD]
    u16* vs = ks + AM_TILE * LD;   // V [64 keys][HD]
    u16* kd = vs + AM_TILE * LD;   // K d-major [HD][64]
    ORT_SHARED(f32, delta, [AM_TILE]);
    const AmPlace at = am_place(a, T);
    const i64 bi = at.bi, t0 = at.r0, *rows = at.own;
    const AttnOff off = at.off;
    const AttDrop drop = att_drop(a, bi);
    const int w = at.w, lane = at.lane, g = at.g, qd = at.qd;
    am_stage<HD, P>(qs, nullptr, q + off.q, a.q_t, t0, T);
    am_stage<HD, P>(dos, nullptr, dout + off.o, a.o_t, t0, T);
    am_delta_rows<HD>(delta, dout + off.o, o + off.o, a.o_t, T, t0, w, lane);
    __syncthreads();
    u32 qa[HD / 16][4], doa[HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        am_load_a(qa[kk], qs, LD, 16 * w, 16 * kk, g, qd);
        am_load_a(doa[kk], dos, LD, 16 * w, 16 * kk, g, qd);
    }
    const f32 lrow[2] = {rows[0] < T ? lse[bi * T + rows[0]] : -ATT_INF, rows[1] < T ? lse[bi * T + rows[1]] : -ATT_INF};
    const f32 drow[2] = {delta[16 * w + g], delta[16 * w + g + 8]};
    f32 acc[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
    for (i64 s0 = 0; s0 < S; s0 += AM_TILE) {
        __syncthreads();
        if (am_tile_dead(mask, off.m, t0, s0, a, AttLseSettled{lse + bi * T}, causal)) continue;  // P = 0 there
        am_stage_keys<HD, P>(ks, kd, kt + off.k, a, s0);
        am_stage<HD, P>(vs, nullptr, v + off.v, a.v_s, s0, S);
        __syncthreads();
        f32 p[8][4], dp[8][4];
        am_scores<HD, P>(p, qa, ks, g, qd);
        am_probs(p, rows, lrow, s0, qd, scale, mask, off.m, a, causal);
        am_scores<HD, P>(dp, doa, vs, g, qd);  // dP = dO · Vᵀ
        if (drop.on) att_drop_rows<1>(&dp, drop, rows[0] - g, s0, g, qd);  // Z∘dP
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[j][e] = p[j][e] * (dp[j][e] - drow[e >> 1]);  // dS
        am_accumulate<HD, P>(acc, dp, kd, g, qd);  // dQ += dS · K
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (rows[h] >= T) continue;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n)
#pragma unroll
            for (int c = 0; c < 2; ++c) dq[off.gq + rows[h] * a.q_t + 8 * n + 2 * qd + c] = Num<E>::store(acc[n][2 * h + c] * scale);
    }
}

// A block owns 64 keys (warp w: keys 16w..+16 as the rows of its products) and walks the query
// rows in tiles of 64: Sᵀ = K·Qᵀ, Pᵀ, dV += Pᵀ·dO, dPᵀ = V·dOᵀ, dSᵀ, dK += dSᵀ·Q.
template <int HD, typename E, typename P>
__device__ __forceinline__ void am_bwd_dkv(const E* dout, const E* q, const E* kt, const E* v, const f32* mask, const E* o,
                                           const f32* lse, E* dkt, E* dv, const AttnShape& a, f32 scale, i32 causal) {
    ORT_DYNAMIC_SHARED(u16, am_smem);
    constexpr int LD = HD + AM_PAD;
    const i64 T = a.T, S = a.S;
    u16* ks = am_smem;             // K key-major [64][HD]
    u16* vs = ks + AM_TILE * LD;   // V [64 keys][HD]
    u16* qs = vs + AM_TILE * LD;   // Q [64 rows][HD]
    u16* dos = qs + AM_TILE * LD;  // dO [64 rows][HD]
    u16* qt = dos + AM_TILE * LD;  // Qᵀ [HD][64 rows]
    u16* dot = qt + HD * AM_LDT;   // dOᵀ [HD][64 rows]
    ORT_SHARED(f32, lse_s, [AM_TILE]); ORT_SHARED(f32, delta, [AM_TILE]);
    const AmPlace at = am_place(a, S);
    const i64 bi = at.bi, s0 = at.r0, *keys = at.own;
    const AttnOff off = at.off;
    const AttDrop drop = att_drop(a, bi);
    const int w = at.w, lane = at.lane, g = at.g, qd = at.qd;
    am_stage_keys<HD, P>(ks, nullptr, kt + off.k, a, s0);
    am_stage<HD, P>(vs, nullptr, v + off.v, a.v_s, s0, S);
    __syncthreads();
    u32 ka[HD / 16][4], va[HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        am_load_a(ka[kk], ks, LD, 16 * w, 16 * kk, g, qd);
        am_load_a(va[kk], vs, LD, 16 * w, 16 * kk, g, qd);
    }
    f32 acc_k[HD / 8][4], acc_v[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_k[n][e] = acc_v[n][e] = 0.f;
    for (i64 t0 = 0; t0 < T; t0 += AM_TILE) {
        __syncthreads();
        if (am_tile_dead(mask, off.m, t0, s0, a, AttLseSettled{lse + bi * T}, causal)) continue;  // P = 0 there
        am_stage<HD, P>(qs, qt, q + off.q, a.q_t, t0, T);
        am_stage<HD, P>(dos, dot, dout + off.o, a.o_t, t0, T);
        am_delta_rows<HD>(delta, dout + off.o, o + off.o, a.o_t, T, t0, w, lane);
        for (int r = threadIdx.x; r < AM_TILE; r += blockDim.x) lse_s[r] = t0 + r < T ? lse[bi * T + t0 + r] : -ATT_INF;
        __syncthreads();
        f32 p[8][4], dp[8][4];
        am_scores<HD, P>(p, ka, qs, g, qd);   // Sᵀ: element (key, row 8j + 2qd + (e & 1))
        am_scores<HD, P>(dp, va, dos, g, qd);  // dPᵀ = V · dOᵀ
        const u32 kept = drop.on ? att_drop_keys<1, 8>(&dp, drop, keys[0] - g, t0, g, qd) : 0u;  // Z∘dPᵀ
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = 8 * j + 2 * qd + (e & 1);
                const f32 x = am_score(p[j][e], scale, mask, off.m, t0 + r, keys[e >> 1], a, causal);
                const f32 lr = lse_s[r];
                p[j][e] = (lr == -ATT_INF || x == -ATT_INF) ? 0.f : expf(x - lr);
                dp[j][e] = p[j][e] * (dp[j][e] - delta[r]);  // dSᵀ
            }
        if (drop.on) att_drop_kept<1, 8>(&p, kept, drop);  // P∘Z
        am_accumulate<HD, P>(acc_v, p, dot, g, qd);  // dV += (P∘Z)ᵀ · dO
        am_accumulate<HD, P>(acc_k, dp, qt, g, qd);  // dK += dSᵀ · Q
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const i64 key = keys[h];
        if (key >= S) continue;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int d = 8 * n + 2 * qd + c;
                dkt[off.gk + d * a.k_d + key * a.k_s] = Num<E>::store(acc_k[n][2 * h + c] * scale);
                dv[off.gv + key * a.v_s + d] = Num<E>::store(acc_v[n][2 * h + c]);
            }
    }
}

// One instance per head size, tensor type T (Q, Kᵀ, V, O and the gradients) and product type P,
// named NAME: f32 tensors rounded to bf16 (NAME f32) or f16 (f32f16) for the products, and the
// 16-bit plans' own bf16 and f16 tensors. LSE and the additive mask are f32 in all (a mask's
// large negative values would round to -inf in 16 bits).
#define AM_KERNELS(HD, T, P, NAME)                                                                                                 \
    extern "C" __global__ void __launch_bounds__(128) attention_mma_fwd_d##HD##_##NAME(const T* q, const T* kt, const T* v,         \
                                                                                      const f32* mask, T* o, f32* lse, AttnShape a,  \
                                                                                      f32 scale, i32 nan_guard, i32 causal) {      \
        am_fwd<HD, T, P>(q, kt, v, mask, o, lse, a, scale, nan_guard, causal);                                                     \
    }                                                                                                                              \
    extern "C" __global__ void __launch_bounds__(128) attention_mma_bwd_dq_d##HD##_##NAME(const T* dout, const T* q, const T* kt,   \
                                                                                         const T* v, const f32* mask, const T* o,    \
                                                                                         const f32* lse, T* dq, AttnShape a,       \
                                                                                         f32 scale, i32 causal) {                  \
        am_bwd_dq<HD, T, P>(dout, q, kt, v, mask, o, lse, dq, a, scale, causal);                                                   \
    }                                                                                                                              \
    extern "C" __global__ void __launch_bounds__(128) attention_mma_bwd_dkv_d##HD##_##NAME(                                       \
        const T* dout, const T* q, const T* kt, const T* v, const f32* mask, const T* o, const f32* lse, T* dkt, T* dv, AttnShape a, \
        f32 scale, i32 causal) {                                                                                                   \
        am_bwd_dkv<HD, T, P>(dout, q, kt, v, mask, o, lse, dkt, dv, a, scale, causal);                                             \
    }
AM_KERNELS(64, f32, bf16, f32)
AM_KERNELS(128, f32, bf16, f32)
AM_KERNELS(64, f32, f16, f32f16)
AM_KERNELS(128, f32, f16, f32f16)
AM_KERNELS(64, bf16, bf16, bf16)
AM_KERNELS(128, bf16, bf16, bf16)
AM_KERNELS(64, f16, f16, f16)
AM_KERNELS(128, f16, f16, f16)
