// Fused attention (engine/src/ops/attention.rs; CPU reference engine/src/backend/cpu/attention.rs):
// O = softmax(scale · Q·Kt + M) · V per batch matrix, without materialising the [T, S] scores:
// the forward keeps a running row maximum and sum over key tiles (online softmax) and saves
// only LSE = log Σ exp(row) per row; the backward recomputes the probabilities from LSE, one
// kernel for dQ (a block per 32 query rows) and one for dKt and dV (a block per 32 keys), so
// nothing is accumulated with atomics (deterministic).
//
//   attention_fwd_T(const T* q, const T* kt, const T* v, const T* mask, T* o, f32* lse,
//                   AttnShape a, f32 scale, i32 nan_guard)
//   attention_bwd_dq_T(const T* dout, const T* q, const T* kt, const T* v, const T* mask,
//                      const T* o, const f32* lse, T* dq, AttnShape a, f32 scale)
//   attention_bwd_dkv_T(the same, with T* dkt, T* dv in place of dq)
//
// Layout BHSD: q is [.., T, D], kt [.., D, S] (K transposed, as the exporters write Q·Kᵀ), v
// [.., S, Dv], the optional additive mask broadcast to [.., T, S] with element strides mask_t,
// mask_s (0 where broadcast). Batch dims are padded to 4; each input has its own batch strides in
// `a` (0 on broadcast dims). o, lse, dq, dkt, dv are contiguous in the full batch (gradients of
// broadcast inputs are summed afterwards by the graph). Layout BSHD: the same matrices with the
// heads inside the rows (q [B, T, H, D], k [B, S, H, D], ...): `a` carries every tensor's batch
// strides and the strides inside its matrices (attention.cuh), which the loads and stores use. A row whose scores are all -inf gives 0 when
// nan_guard (the exporters' `Where(IsNaN(softmax), 0, softmax)`), else NaN as softmax does,
// and LSE = -inf; its gradient is 0. With dropout (AttnShape drop_*, attention.cuh att_drop) the
// forward multiplies each probability by its keep factor before the product with V (the row's
// sum and LSE are the softmax's), and the backward regenerates the factors: dV from P∘Z, and
// dS = P∘(Z∘dP − Δ) with dP = dO·Vᵀ and Δ = Σ dO·O as before.
// Launch: 128 threads (4 warps of 8 rows or keys), a 1-D grid of batch · ceil(T / 32) blocks
// (dq, fwd) or batch · ceil(S / 32) (dkv), dynamic shared memory for the regions each kernel
// lays out (the dispatcher computes the same sizes). 32 x 32 tiles whose mask is all -inf (a
// causal mask's upper triangle) are skipped. D, Dv <= 128. T: f32.

#include "prelude.cuh"
#include "attention.cuh"

#define ATT_TILE 32
#define ATT_LD 33   // padded row of a transposed tile: no bank conflicts
#define ATT_PLD 36  // row of the probability tile: float4-aligned
#define ATT_A4(n) (((n) + 3) & ~3)  // shared-memory regions start 16-byte aligned
#define ATT_DMAX 128

// acc[r] = Σ_d A[(w·8 + r)·lda + d] · B[d·ATT_LD + lane]: 8 rows of a row-major tile times column
// `lane` of a d-major tile. Rows of A are read as float4 where they are 16-byte aligned.
__device__ __forceinline__ void att_dot8(const f32* A, int lda, const f32* B, int D, int w, int lane, f32 acc[8]) {
#pragma unroll
    for (int r = 0; r < 8; ++r) acc[r] = 0.f;
    const f32* a = A + (w * 8) * lda;
    int d = 0;
    if ((lda & 3) == 0 && (reinterpret_cast<u64>(a) & 15) == 0) {
        for (; d + 4 <= D; d += 4) {
            const f32 b0 = B[d * ATT_LD + lane], b1 = B[(d + 1) * ATT_LD + lane];
            const f32 b2 = B[(d + 2) * ATT_LD + lane], b3 = B[(d + 3) * ATT_LD + lane];
#pragma unroll
            for (int r = 0; r < 8; ++r) {
                const float4 av = *reinterpret_cast<const float4*>(a + r * lda + d);
                acc[r] = fmaf(av.x, b0, acc[r]);
                acc[r] = fmaf(av.y, b1, acc[r]);
                acc[r] = fmaf(av.z, b2, acc[r]);
                acc[r] = fmaf(av.w, b3, acc[r]);
            }
        }
    }
    for (; d < D; ++d) {
        const f32 bv = B[d * ATT_LD + lane];
#pragma unroll
        for (int r = 0; r < 8; ++r) acc[r] = fmaf(a[r * lda + d], bv, acc[r]);
    }
}

// acc[r][i] += Σ_{j < n} P[(w·8 + r)·ATT_PLD + j] · X[j·ldx + lane + 32 i], columns < width
// (NI = 2 when width <= 64, else 4); P is read as float4 (its rows are 16-byte aligned).
template <int NI>
__device__ __forceinline__ void att_acc8_n(const f32* P, const f32* X, int ldx, int n, int width, int w, int lane, f32 acc[8][4]) {
    const f32* p = P + (w * 8) * ATT_PLD;
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        f32 x[4][NI];
#pragma unroll
        for (int jj = 0; jj < 4; ++jj)
#pragma unroll
            for (int i = 0; i < NI; ++i) x[jj][i] = (lane + 32 * i < width) ? X[(j + jj) * ldx + lane + 32 * i] : 0.f;
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            const float4 pv = *reinterpret_cast<const float4*>(p + r * ATT_PLD + j);
#pragma unroll
            for (int i = 0; i < NI; ++i) {
                acc[r][i] = fmaf(pv.x, x[0][i], acc[r][i]);
                acc[r][i] = fmaf(pv.y, x[1][i], acc[r][i]);
                acc[r][i] = fmaf(pv.z, x[2][i], acc[r][i]);
                acc[r][i] = fmaf(pv.w, x[3][i], acc[r][i]);
            }
        }
    }
    for (; j < n; ++j) {
        f32 x[NI];
#pragma unroll
        for (int i = 0; i < NI; ++i) x[i] = (lane + 32 * i < width) ? X[j * ldx + lane + 32 * i] : 0.f;
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            const f32 pv = p[r * ATT_PLD + j];
#pragma unroll
            for (int i = 0; i < NI; ++i) acc[r][i] = fmaf(pv, x[i], acc[r][i]);
        }
    }
}
__device__ __forceinline__ void att_acc8(const f32* P, const f32* X, int ldx, int n, int width, int w, int lane, f32 acc[8][4]) {
    if (width <= 64)
        att_acc8_n<2>(P, X, ldx, n, width, w, lane, acc);
    else
        att_acc8_n<4>(P, X, ldx, n, width, w, lane, acc);
}

// Row-major [32][width] tile (rows r0.., row stride `ld` in memory) into shared memory with row
// stride `lds`; rows past `rows` are zero.
__device__ __forceinline__ void att_load_rows(f32* dst, int lds, const f32* src, i64 ld, i64 r0, i64 rows, int width) {
    for (int e = threadIdx.x; e < ATT_TILE * width; e += blockDim.x) {
        const int r = e / width, c = e % width;
        dst[r * lds + c] = (r0 + r < rows) ? src[(r0 + r) * ld + c] : 0.f;
    }
}

// The transpose of such a tile: dst[c·ATT_LD + r] = src[(r0 + r)·ld + c].
__device__ __forceinline__ void att_load_rows_t(f32* dst, const f32* src, i64 ld, i64 r0, i64 rows, int width) {
    for (int e = threadIdx.x; e < ATT_TILE * width; e += blockDim.x) {
        const int r = e / width, c = e % width;
        dst[c * ATT_LD + r] = (r0 + r < rows) ? src[(r0 + r) * ld + c] : 0.f;
    }
}

// Keys c0.. of Kt (element (d, key) at kt[d·k_d + key·k_s]) into dst[d·ld_d + c·ld_c], zero past
// S: walked along whichever of the two is contiguous in memory (keys in BHSD, d in BSHD).
__device__ __forceinline__ void att_load_k(f32* dst, int ld_d, int ld_c, const f32* kt, const AttnShape& a, i64 c0, int D) {
    const bool keys_inner = a.k_s == 1;
    for (int e = threadIdx.x; e < ATT_TILE * D; e += blockDim.x) {
        const int d = keys_inner ? e / ATT_TILE : e % D, c = keys_inner ? e % ATT_TILE : e / D;
        dst[d * ld_d + c * ld_c] = (c0 + c < a.S) ? kt[d * a.k_d + (c0 + c) * a.k_s] : 0.f;
    }
}

// Columns c0.. of Kt as a d-major tile: dst[d·ATT_LD + c].
__device__ __forceinline__ void att_load_cols(f32* dst, const f32* kt, const AttnShape& a, i64 c0, int D) {
    att_load_k(dst, ATT_LD, 1, kt, a, c0, D);
}

// The same columns key-major: dst[c·ldd + d].
__device__ __forceinline__ void att_load_cols_t(f32* dst, int ldd, const f32* kt, const AttnShape& a, i64 c0, int D) {
    att_load_k(dst, 1, ldd, kt, a, c0, D);
}

// Whether every score of a 32 x 32 tile is -inf (att_tile_dead_n).
__device__ __forceinline__ bool att_tile_dead(const f32* mask, i64 mo, i64 r0, i64 c0, i64 T, i64 S, i64 mt, i64 ms) {
    return att_tile_dead_n(mask, mo, r0, c0, T, S, mt, ms, ATT_TILE, ATT_TILE, AttNoneSettled{});
}

extern "C" __global__ void __launch_bounds__(128) attention_fwd_f32(const f32* q, const f32* kt, const f32* v, const f32* mask, f32* o,
                                                                    f32* lse, AttnShape a, f32 scale, i32 nan_guard) {
    ORT_DYNAMIC_SHARED(f32, att_smem);
    const i64 T = a.T, S = a.S, D = a.D, Dv = a.Dv, mask_t = a.mask_t, mask_s = a.mask_s;
    const int d_ = (int)D, dv_ = (int)Dv;
    f32* qs = att_smem;                                        // [32][D]
    f32* kv = qs + ATT_A4(ATT_TILE * d_);                      // K tile [D][33], then V tile [32][Dv]
    f32* ps = kv + ATT_A4(max(d_ * ATT_LD, ATT_TILE * dv_));   // [32][36]
    const i64 tiles = (T + ATT_TILE - 1) / ATT_TILE;
    const i64 bi = blockIdx.x / tiles, t0 = (blockIdx.x % tiles) * ATT_TILE;
    const AttnOff off = attn_offsets(a, bi);
    const AttDrop drop = att_drop(a, bi);
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    att_load_rows(qs, d_, q + off.q, a.q_t, t0, T, d_);
    f32 m[8], l[8], acc[8][4];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        m[r] = -ATT_INF;
        l[r] = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[r][i] = 0.f;
    }
    for (i64 s0 = 0; s0 < S; s0 += ATT_TILE) {
        __syncthreads();  // the previous V tile is read
        if (att_tile_dead(mask, off.m, t0, s0, T, S, mask_t, mask_s)) continue;  // adds nothing
        att_load_cols(kv, kt + off.k, a, s0, d_);
        __syncthreads();
        f32 s[8];
        att_dot8(qs, d_, kv, d_, w, lane, s);
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            const f32 x = att_score(s[r], scale, mask, off.m, t0 + w * 8 + r, s0 + lane, T, S, mask_t, mask_s);
            const f32 mnew = fmaxf(m[r], att_warp_max(x));
            const f32 p = (mnew == -ATT_INF) ? 0.f : expf(x - mnew);
            const f32 corr = (mnew == -ATT_INF) ? 1.f : expf(m[r] - mnew);
            l[r] = l[r] * corr + att_warp_sum(p);
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[r][i] *= corr;
            m[r] = mnew;
            ps[(w * 8 + r) * ATT_PLD + lane] = p * att_drop_at(drop, t0 + w * 8 + r, s0 + lane);
        }
        __syncthreads();  // the K tile is read
        att_load_rows(kv, dv_, v + off.v, a.v_s, s0, S, dv_);
        __syncthreads();
        att_acc8(ps, kv, dv_, (int)min((i64)ATT_TILE, S - s0), dv_, w, lane, acc);
    }
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        const i64 row = t0 + w * 8 + r;
        if (row >= T) continue;
        const bool empty = m[r] == -ATT_INF;
        const f32 inv = empty ? (nan_guard ? 0.f : ATT_NAN) : 1.f / l[r];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int d = lane + 32 * i;
            if (d < dv_) o[off.o + row * a.o_t + d] = empty && nan_guard ? 0.f : acc[r][i] * inv;
        }
        if (lane == 0) lse[bi * T + row] = empty ? -ATT_INF : m[r] + logf(l[r]);
    }
}

// Σ_d dO·O of 8 rows of a warp (the softmax gradient's row term); dout, o at the batch entry,
// rows o_t apart.
__device__ __forceinline__ void att_delta8(const f32* dout, const f32* o, i64 o_t, i64 T, i64 Dv, i64 t0, int w, int lane, f32 delta[8]) {
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        const i64 row = t0 + w * 8 + r;
        f32 s = 0.f;
        if (row < T)
            for (i64 d = lane; d < Dv; d += 32) s += dout[row * o_t + d] * o[row * o_t + d];
        delta[r] = att_warp_sum(s);
    }
}

extern "C" __global__ void __launch_bounds__(128) attention_bwd_dq_f32(const f32* dout, const f32* q, const f32* kt, const f32* v,
                                                                       const f32* mask, const f32* o, const f32* lse, f32* dq,
                                                                       AttnShape a, f32 scale) {
    ORT_DYNAMIC_SHARED(f32, att_smem);
    const i64 T = a.T, S = a.S, D = a.D, Dv = a.Dv, mask_t = a.mask_t, mask_s = a.mask_s;
    const int d_ = (int)D, dv_ = (int)Dv;
    f32* qs = att_smem;                                                  // [32][D]
    f32* dos = qs + ATT_A4(ATT_TILE * d_);                               // [32][Dv]
    f32* kv = dos + ATT_A4(ATT_TILE * dv_);                              // K [D][33] | Vᵀ [Dv][33] | K [32][D+1]
    f32* ps = kv + ATT_A4(max(max(d_, dv_) * ATT_LD, ATT_TILE * (d_ + 1)));  // [32][36]
    const i64 tiles = (T + ATT_TILE - 1) / ATT_TILE;
    const i64 bi = blockIdx.x / tiles, t0 = (blockIdx.x % tiles) * ATT_TILE;
    const AttnOff off = attn_offsets(a, bi);
    const AttDrop drop = att_drop(a, bi);
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    att_load_rows(qs, d_, q + off.q, a.q_t, t0, T, d_);
    att_load_rows(dos, dv_, dout + off.o, a.o_t, t0, T, dv_);
    f32 delta[8], lrow[8], acc[8][4];
    att_delta8(dout + off.o, o + off.o, a.o_t, T, Dv, t0, w, lane, delta);
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        const i64 row = t0 + w * 8 + r;
        lrow[r] = row < T ? lse[bi * T + row] : -ATT_INF;
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[r][i] = 0.f;
    }
    for (i64 s0 = 0; s0 < S; s0 += ATT_TILE) {
        __syncthreads();
        if (att_tile_dead(mask, off.m, t0, s0, T, S, mask_t, mask_s)) continue;  // P = 0 there
        att_load_cols(kv, kt + off.k, a, s0, d_);
        __syncthreads();
        f32 p[8];
        att_dot8(qs, d_, kv, d_, w, lane, p);
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            const f32 x = att_score(p[r], scale, mask, off.m, t0 + w * 8 + r, s0 + lane, T, S, mask_t, mask_s);
            p[r] = (lrow[r] == -ATT_INF || x == -ATT_INF) ? 0.f : expf(x - lrow[r]);
        }
        __syncthreads();
        att_load_rows_t(kv, v + off.v, a.v_s, s0, S, dv_);  // Vᵀ: [Dv][33]
        __syncthreads();
        f32 dp[8];
        att_dot8(dos, dv_, kv, dv_, w, lane, dp);
#pragma unroll
        for (int r = 0; r < 8; ++r) ps[(w * 8 + r) * ATT_PLD + lane] = p[r] * (att_drop_at(drop, t0 + w * 8 + r, s0 + lane) * dp[r] - delta[r]);
        __syncthreads();
        att_load_cols_t(kv, d_ + 1, kt + off.k, a, s0, d_);  // K: [32][D+1]
        __syncthreads();
        att_acc8(ps, kv, d_ + 1, (int)min((i64)ATT_TILE, S - s0), d_, w, lane, acc);
    }
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        const i64 row = t0 + w * 8 + r;
        if (row >= T) continue;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int d = lane + 32 * i;
            if (d < d_) dq[off.gq + row * a.q_t + d] = acc[r][i] * scale;
        }
    }
}

// A block owns 32 keys (warp w: keys w·8..+8, each lane a query row of the current row tile).
extern "C" __global__ void __launch_bounds__(128) attention_bwd_dkv_f32(const f32* dout, const f32* q, const f32* kt, const f32* v,
                                                                        const f32* mask, const f32* o, const f32* lse, f32* dkt,
                                                                        f32* dv, AttnShape a, f32 scale) {
    ORT_DYNAMIC_SHARED(f32, att_smem);
    const i64 T = a.T, S = a.S, D = a.D, Dv = a.Dv, mask_t = a.mask_t, mask_s = a.mask_s;
    const int d_ = (int)D, dv_ = (int)Dv;
    f32* ks = att_smem;                                           // K tile key-major [32][D]
    f32* vs = ks + ATT_A4(ATT_TILE * d_);                         // V tile [32][Dv]
    f32* x = vs + ATT_A4(ATT_TILE * dv_);                         // Qᵀ [D][33] | dOᵀ [Dv][33] | dO [32][Dv] | Q [32][D]
    f32* ps = x + ATT_A4(max(max(d_, dv_) * ATT_LD, ATT_TILE * max(d_, dv_)));  // Pᵀ or dSᵀ [32 keys][36]
    ORT_SHARED(f32, rows_lse, [ATT_TILE]); ORT_SHARED(f32, rows_delta, [ATT_TILE]);
    const i64 tiles = (S + ATT_TILE - 1) / ATT_TILE;
    const i64 bi = blockIdx.x / tiles, s0 = (blockIdx.x % tiles) * ATT_TILE;
    const AttnOff off = attn_offsets(a, bi);
    const AttDrop drop = att_drop(a, bi);
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    att_load_cols_t(ks, d_, kt + off.k, a, s0, d_);
    att_load_rows(vs, dv_, v + off.v, a.v_s, s0, S, dv_);
    f32 acc_k[8][4], acc_v[8][4];
#pragma unroll
    for (int r = 0; r < 8; ++r)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc_k[r][i] = acc_v[r][i] = 0.f;
    for (i64 t0 = 0; t0 < T; t0 += ATT_TILE) {
        __syncthreads();
        if (att_tile_dead(mask, off.m, t0, s0, T, S, mask_t, mask_s)) continue;  // P = 0 there
        // per-row LSE and Δ = Σ dO·O of this row tile (warp w: rows w·8..+8)
        {
            f32 delta[8];
            att_delta8(dout + off.o, o + off.o, a.o_t, T, Dv, t0, w, lane, delta);
            if (lane < 8) {
                const i64 row = t0 + w * 8 + lane;
                rows_lse[w * 8 + lane] = row < T ? lse[bi * T + row] : -ATT_INF;
            }
#pragma unroll
            for (int r = 0; r < 8; ++r)
                if (lane == r) rows_delta[w * 8 + r] = delta[r];
        }
        att_load_rows_t(x, q + off.q, a.q_t, t0, T, d_);  // Qᵀ: [D][33]
        __syncthreads();
        f32 p[8];
        att_dot8(ks, d_, x, d_, w, lane, p);  // p[r] = K[key w·8 + r] · Q[row lane]
        const i64 row = t0 + lane;
        const f32 lr = rows_lse[lane];
        f32 z[8];  // the dropout's factors
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            const f32 sc = att_score(p[r], scale, mask, off.m, row, s0 + w * 8 + r, T, S, mask_t, mask_s);
            p[r] = (lr == -ATT_INF || sc == -ATT_INF) ? 0.f : expf(sc - lr);
            z[r] = att_drop_at(drop, row, s0 + w * 8 + r);
            ps[(w * 8 + r) * ATT_PLD + lane] = p[r] * z[r];
        }
        __syncthreads();
        att_load_rows(x, dv_, dout + off.o, a.o_t, t0, T, dv_);  // dO: [32][Dv]
        __syncthreads();
        const int n = (int)min((i64)ATT_TILE, T - t0);
        att_acc8(ps, x, dv_, n, dv_, w, lane, acc_v);  // dV[key] += Σ_row P∘Z · dO[row]
        __syncthreads();
        att_load_rows_t(x, dout + off.o, a.o_t, t0, T, dv_);  // dOᵀ: [Dv][33]
        __syncthreads();
        f32 dp[8];
        att_dot8(vs, dv_, x, dv_, w, lane, dp);  // dP[row lane][key] = V[key] · dO[row]
        const f32 dl = rows_delta[lane];
#pragma unroll
        for (int r = 0; r < 8; ++r) ps[(w * 8 + r) * ATT_PLD + lane] = p[r] * (z[r] * dp[r] - dl);
        __syncthreads();
        att_load_rows(x, d_, q + off.q, a.q_t, t0, T, d_);  // Q: [32][D]
        __syncthreads();
        att_acc8(ps, x, d_, n, d_, w, lane, acc_k);  // dK[key] += Σ_row dS · Q[row]
    }
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        const i64 key = s0 + w * 8 + r;
        if (key >= S) continue;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int d = lane + 32 * i;
            if (d < d_) dkt[off.gk + d * a.k_d + key * a.k_s] = acc_k[r][i] * scale;
            if (d < dv_) dv[off.gv + key * a.v_s + d] = acc_v[r][i];
        }
    }
}
