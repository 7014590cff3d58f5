#pragma once
// Fused attention for bf16 and f16 tensors in the FlashAttention-2 manner
// (engine/src/ops/attention.rs semantics; kernels/attention_mma.cu computes the same for every
// case and stays the fallback): the dispatcher (ops/attention_flash.rs `variant`) sends here bf16
// or f16 Q, K, V, O (the products in that type, f32 accumulation) with heads of 32, 64, 80, 96 or
// 128 (any multiple of 16 compiles: FA_INSTANCES at the end picks these) whose rows are 16-byte
// aligned, keys d-contiguous (layout BSHD, as the attention_layout pass leaves
// them), and no mask or the computed causal one. What differs from attention_mma.cu:
//
// - tiles go from global to shared memory by cp.async (16 bytes a thread, zero-filled past the
//   matrix), the next key (or query) tile in flight while the current one is multiplied: two
//   buffers, one barrier pair per tile;
// - every tile stays in its natural row-major [row][d] layout, and ldmatrix (.trans where the
//   product needs the other orientation) reads the mma.sync fragments from it: no transposed
//   copies, a quarter of the shared-memory load instructions;
// - exp2 with scale · log2 e folded into its FMA (the scale must be > 0); the causal mask is tested only on
//   the tiles that cross the diagonal or the matrix's end, and the causal loops stop (or start)
//   at the diagonal instead of testing every tile;
// - blocks with the most tiles start first (causal: the last query tiles of the forward and dQ,
//   the first key tiles of dK/dV), heads interleaved;
// - Δ = Σ dO·O is computed once per query row by the dQ kernel, which writes it for the dK/dV
//   kernel (launched after it on the same stream);
// - key padding (`kp`, an attention_mask's flags, with the causal mask or none): a key whose flag
//   is 0 is hidden, and a query with no visible key (causal: one before the first visible key;
//   without a mask: every query of a batch entry whose keys are all padding) gets equal
//   weights over all S keys, as PyTorch's softmax of its scores, all finfo.min, gives it: the
//   kernels give that query the score 0 for every key (p = 1, LSE = ln S, so the backward's
//   p = 1/S) and walk every key tile for it. The forward and dQ warps gather a key tile's 64
//   flags by two ballots, the dK/dV threads read their key rows' flags once; a tile that hides
//   no key and holds no such query skips the mask, as in the kernels without padding.
//
// - the probabilities' dropout (DROP, AttnShape drop_*: kernels/attention.cuh att_drop): the
//   forward multiplies each probability by its keep factor before the product with V (the
//   row's sum and LSE stay the softmax's); the backward regenerates the factors for dV from P∘Z
//   and dS = P∘(Z∘dP − Δ), Δ = Σ dO·O as before.
//
// These are the templates: attention_flash.cu instantiates them without key padding,
// attention_flash_padded.cu with it (PAD = true, names ending `_kp_P`), and
// attention_flash_dropout.cu and attention_flash_padded_dropout.cu both with DROP (names ending
// `_dp_P`, `_kp_dp_P`): compile-time flags, so that each instance keeps only the registers and
// spills of what it does (the plain kernels are the same code as without the flags).
//
//   attention_flash_fwd_dHD[r128]_P(q, k, v, o, lse, AttnShape a, f32 scale, i32 causal, kp)
//   attention_flash_bwd_dq_dHD[r128]_P(dout, q, k, v, o, lse, delta, dq, a, scale, causal, kp)
//   attention_flash_bwd_dkv_dHD[r128]_P(dout, q, k, v, lse, delta, dk, dv, a, scale, causal, kp)
//
// kp: null, or u8 flags read at kp + off.m + key · a.mask_s (the dispatcher puts the flags'
// strides in the mask's fields: these kernels read no mask).
//
// P: bf16 or f16, the tensors' type and the products'.
//
// k / dk: element (key, d) at [key·k_s + d] (k_d = 1). Launch: 128 threads; the forward and dQ
// kernels take blocks of 64 query rows (16 a warp) or, r128 (heads of 32 and 64), 128 (32 a warp: each
// fragment of the other operand read by ldmatrix serves two row tiles), a 1-D grid of
// batch · ceil(T / rows) blocks; the dK/dV kernel blocks of 64 or (r128) 128 keys,
// batch · ceil(S / keys). Dynamic shared memory: the tiles each kernel's first lines lay out,
// 64 rows of HD + 8 16-bit elements each (the dispatcher, ops/attention_flash.rs, computes the
// same). Every row has a key (no mask, or causal with T = S; with key padding, a row without one
// gets equal weights), so no row is empty and nan_guard has nothing to do.

// (the including file has included prelude.cuh, attention.cuh and attention_mma_stage.cuh)

#define FA_LOG2E 1.4426950408889634f

#include "attention_flash_fragments.cuh"

// ---- tiles ----

template <int HD> struct FaTile {
    static constexpr int LD = HD + AM_PAD;       // elements per shared row: 16-byte aligned, ldmatrix without bank conflicts
    static constexpr int ELEMS = AM_TILE * LD;  // one 64-row tile
};

// Rows r0..r0 + ROWS - 1 of the 16-bit matrix at src (rows ld apart, HD contiguous) into the
// row-major tiles at dst by cp.async, zeros from row `rows` on. 16-byte chunks, consecutive
// threads along a row.
template <int HD, int ROWS = AM_TILE, typename P> __device__ __forceinline__ void fa_load(u16* dst, const P* src, i64 ld, i64 r0, i64 rows) {
    constexpr int CPR = HD / 8;
#pragma unroll
    for (int i = 0; i < ROWS * CPR / 128; ++i) {
        const int c = threadIdx.x + 128 * i, r = c / CPR, k = (c % CPR) * 8;
        const bool in = r0 + r < rows;
        fa_cp_async<16>(dst + r * FaTile<HD>::LD + k, in ? src + (r0 + r) * ld + k : src, in ? 16 : 0);
    }
}

// 64 floats of a per-row vector (lse or Δ at the batch entry) from row r0, zeros past `rows`:
// threads `first`..first + 63.
__device__ __forceinline__ void fa_load_row_floats(f32* dst, const f32* src, i64 r0, i64 rows, int first) {
    const int r = (int)threadIdx.x - first;
    if (r < 0 || r >= AM_TILE) return;
    const bool in = r0 + r < rows;
    fa_cp_async<4>(dst + r, in ? src + r0 + r : src, in ? 4 : 0);
}

// Where a block of `block_rows` rows (or keys) is: its batch matrix and first row, heads
// interleaved so that blocks of one tile index run together, the tile order reversed where
// `last_first` (the heaviest tiles of a causal forward or dQ are the last ones).
struct FaPlace {
    i64 bi, r0;
    AttnOff off;
    int w, lane, g, qd;
};
__device__ __forceinline__ FaPlace fa_place(const AttnShape& a, i64 extent, bool last_first, int block_rows) {
    FaPlace p;
    const i64 heads = a.dims[0] * a.dims[1] * a.dims[2] * a.dims[3], tiles = (extent + block_rows - 1) / block_rows;
    const i64 tile = blockIdx.x / heads;
    p.bi = blockIdx.x % heads;
    p.r0 = (last_first ? tiles - 1 - tile : tile) * block_rows;
    p.off = attn_offsets(a, p.bi);
    p.w = threadIdx.x >> 5;
    p.lane = threadIdx.x & 31;
    p.g = p.lane >> 2;
    p.qd = p.lane & 3;
    return p;
}

// The key padding of a block's batch entry: the flags there (null: none), their stride, S, and
// `uni`: the queries below it have no visible key (the header says what they get).
struct FaPad {
    const u8* kp;
    i64 ks;
    int S, uni;
};

// The first key whose flag is set (S if none), for every thread of the block (4 warps).
__device__ __forceinline__ int fa_first_key(const u8* kp, i64 ks, int S) {
    ORT_SHARED(int, warp_first, [4]);
    int first = S;
    for (int j = threadIdx.x; j < S; j += blockDim.x)
        if (kp[j * ks]) {
            first = j;
            break;
        }
    for (int o = 16; o > 0; o >>= 1) first = min(first, __shfl_xor_sync(0xffffffffu, first, o));
    if ((threadIdx.x & 31) == 0) warp_first[threadIdx.x >> 5] = first;
    __syncthreads();
    return min(min(warp_first[0], warp_first[1]), min(warp_first[2], warp_first[3]));
}

// The block's FaPad: with PAD (the key-padding instances), from the flags (every thread must
// call it: it has a barrier); else none, known at compile time. Causal, the queries before the
// first visible key see none; otherwise a query sees none only where no key is visible.
template <bool PAD> __device__ __forceinline__ FaPad fa_pad(const u8* kp, const AttnShape& a, i64 mo, int S, int T, bool causal) {
    if (!PAD) return FaPad{nullptr, 0, S, 0};
    const int first = fa_first_key(kp + mo, a.mask_s, S);
    return FaPad{kp + mo, a.mask_s, S, causal ? min(first, T) : (first < S ? 0 : T)};
}

// The visibility of key tile s0's 64 keys to a warp (bit i: key s0 + i is no padding, or lies
// past S, where the tile's bounds test hides it): each lane reads two flags, a ballot gathers each
// half. Every lane of the warp calls it.
__device__ __forceinline__ u64 fa_keys_visible(const FaPad& pad, int s0, int lane) {
    const int k0 = s0 + lane, k1 = k0 + 32;
    const bool v0 = k0 >= pad.S || pad.kp[k0 * pad.ks] != 0, v1 = k1 >= pad.S || pad.kp[k1 * pad.ks] != 0;
    return (u64)__ballot_sync(0xffffffffu, v0) | (u64)__ballot_sync(0xffffffffu, v1) << 32;
}

// The visibility of a dK/dV thread's key rows key0 + 16mt + g + 8h (bit 2mt + h), and at bit 31
// whether any key row of its warp is padding. Every lane of the warp calls it.
template <int MT> __device__ __forceinline__ u32 fa_rows_visible(const FaPad& pad, int key0, int g) {
    u32 vis = 0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int key = key0 + 16 * mt + g + 8 * h;
            if (key >= pad.S || pad.kp[key * pad.ks]) vis |= 1u << (2 * mt + h);
        }
    return vis | (__ballot_sync(0xffffffffu, vis != (1u << 2 * MT) - 1) != 0 ? 1u << 31 : 0u);
}

// s (16 x 8·NJ of one warp: its rows r0 + g, + 8, its columns c0 + 8j + 2qd + (e & 1)) with -inf
// from column `cols` on and, where causal, where the key is past the query, or (PAD) the key is
// padding; 0 for a query below `uni` (no visible key: every key of it, equal weights). Rows are
// queries and columns keys, or (KEY_ROWS, the dK/dV kernel's transposed scores) rows are keys and
// columns queries. `vis`: the keys' visibility, bit 8j + (e & 1) for column j, e (the tile's
// fa_keys_visible shifted right by 2qd), or KEY_ROWS bit h for row g + 8h. Only a tile that
// reaches past the diagonal or the matrix, or (PAD) holds a padded key or a query below `uni`,
// needs it. Scores stay unscaled: the scale (> 0, the dispatcher checks) goes into the exp2's FMA.
template <bool KEY_ROWS, bool PAD, int NJ = 8>
__device__ __forceinline__ void fa_mask(f32 s[NJ][4], bool causal, int r0, int c0, int cols, int g, int qd, int uni, u64 vis) {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = r0 + g + 8 * (e >> 1), c = c0 + 8 * j + 2 * qd + (e & 1);
            const int query = KEY_ROWS ? c : r, key = KEY_ROWS ? r : c;
            const bool hidden = PAD && !(vis >> (KEY_ROWS ? e >> 1 : 8 * j + (e & 1)) & 1u);
            if (c >= cols)
                s[j][e] = -ATT_INF;
            else if (PAD && query < uni)
                s[j][e] = 0.f;
            else if ((causal && key > query) || hidden)
                s[j][e] = -ATT_INF;
        }
}

// s[m][j] (16 x 8 accumulators, j < NJ) = A · Bᵀ over HD: A the 16 x HD fragments of rows
// a_r0 + 16m (m < MT) of tile `at` (or a_regs[m]), B the 8·NJ rows from bt (both row-major, HD
// contiguous). Each B fragment serves the warp's MT row tiles.
template <typename P, int HD, int MT, int NJ = 8>
__device__ __forceinline__ void fa_dots(f32 s[MT][NJ][4], const u16* at, int a_r0, const u32 (*a_regs)[HD / 16][4], const u16* bt,
                                        int lane) {
    constexpr int LD = FaTile<HD>::LD;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[m][j][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        u32 a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            if (a_regs) {
#pragma unroll
                for (int i = 0; i < 4; ++i) a[m][i] = a_regs[m][kk][i];
            } else {
                fa_a(a[m], at, LD, a_r0 + 16 * m, 16 * kk, lane);
            }
        }
#pragma unroll
        for (int j = 0; j < NJ; j += 2) {
            u32 b[4];
            fa_b_rows(b, bt, LD, 8 * j, 16 * kk, lane);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                AmProd<P>::mma(s[m][j], a[m], b[0], b[1]);
                AmProd<P>::mma(s[m][j + 1], a[m], b[2], b[3]);
            }
        }
    }
}

// acc[m][n] (16 x 8, n < HD / 8) += P[m] · X: P the warp's MT 16 x 8·NJ accumulator tiles
// (rounded to P as A fragments), X the 8·NJ rows from xt (k = its rows, n = d).
template <typename P, int HD, int MT, int NJ = 8>
__device__ __forceinline__ void fa_accumulate(f32 acc[MT][HD / 8][4], const f32 p[MT][NJ][4], const u16* xt, int lane) {
#pragma unroll
    for (int kk = 0; kk < NJ / 2; ++kk) {
        u32 a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) am_c_to_a<P>(a[m], p[m][2 * kk], p[m][2 * kk + 1]);
#pragma unroll
        for (int n = 0; n < HD / 8; n += 2) {
            u32 b[4];
            fa_b_cols(b, xt, FaTile<HD>::LD, 16 * kk, 8 * n, lane);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                AmProd<P>::mma(acc[m][n], a[m], b[0], b[1]);
                AmProd<P>::mma(acc[m][n + 1], a[m], b[2], b[3]);
            }
        }
    }
}

template <int HD, int MT> __device__ __forceinline__ void fa_zero(f32 acc[MT][HD / 8][4]) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < HD / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.f;
}

// Rows row0 + 16m + g, + 8 of acc[m] · mul[m] (rows below `rows` only) as P pairs at
// dst + row·ld + d.
template <int HD, int MT, typename P>
__device__ __forceinline__ void fa_store(P* dst, i64 ld, const f32 acc[MT][HD / 8][4], const f32 mul[MT][2], i64 row0, i64 rows, int g,
                                         int qd) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 row = row0 + 16 * m + g + 8 * h;
            if (row >= rows) continue;
            u32* out = reinterpret_cast<u32*>(dst + row * ld + 2 * qd);
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) out[4 * n] = AmProd<P>::pack(acc[m][n][2 * h] * mul[m][h], acc[m][n][2 * h + 1] * mul[m][h]);
        }
}

// A forward or dQ block of 64 · MT query rows (warp w: rows 16·MT·w..+16·MT): where it is, T and
// S, its first row t0, its warp's first row, the key tiles it walks (causal: up to its last
// row's diagonal), and K and V at its batch entry. Lengths are below 2^30 (the dispatcher checks).
template <typename P> struct FaRows {
    FaPlace at;
    int T, S, t0, row0, tiles;
    const P *kb, *vb;
};
template <int MT, typename P> __device__ __forceinline__ FaRows<P> fa_rows(const AttnShape& a, const P* k, const P* v, i32 causal) {
    const FaPlace at = fa_place(a, a.T, causal != 0, AM_TILE * MT);
    const int T = (int)a.T, S = (int)a.S, t0 = (int)at.r0;
    const int s_end = causal ? min(S, t0 + AM_TILE * MT) : S;
    return FaRows<P>{at, T, S, t0, t0 + 16 * MT * at.w, (s_end + AM_TILE - 1) / AM_TILE, k + at.off.k, v + at.off.v};
}

// Whether key tile s0 needs the mask for a warp whose rows start at row0: it reaches past the
// matrix, or (causal) past the warp's first row.
__device__ __forceinline__ bool fa_tile_masked(int s0, int S, bool causal, int row0) {
    return s0 + AM_TILE > S || (causal && s0 + AM_TILE - 1 > row0);
}
// Whether a causal key tile starts past the warp's last row: nothing in it for this warp (only
// with MT > 1, whose block's last tile lies past its first warps' rows).
template <int MT> __device__ __forceinline__ bool fa_tile_dead(int s0, bool causal, int row0) {
    return MT > 1 && causal && s0 > row0 + 16 * MT - 1;
}

// The forward's and dQ's mask of a warp's MT row tiles of scores s against key tile s0, applied
// only where the tile needs it: it reaches past the matrix or the diagonal (fa_tile_masked), or
// (PAD) it hides a key (`vis`: the tile's fa_keys_visible) or the warp holds a query without a
// visible key.
template <int MT, bool PAD>
__device__ __forceinline__ void fa_mask_rows(f32 s[MT][8][4], bool causal, int row0, int s0, int S, int g, int qd, const FaPad& pad, u64 vis) {
    if ((PAD && (~vis != 0 || row0 < pad.uni)) || fa_tile_masked(s0, S, causal, row0))
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) fa_mask<false, PAD>(s[mt], causal, row0 + 16 * mt, s0, S, g, qd, pad.uni, vis >> 2 * qd);
}

// Tile j + 1 of K and V (of `tiles`) into the buffers tile j - 1 used (the caller's barrier after
// that tile lets them be refilled), then the wait that leaves this thread's part of tile j
// landed (the caller's next barrier publishes the block's).
template <int HD, typename P>
__device__ __forceinline__ void fa_next_kv(u16* ks, u16* vs, const P* kb, const P* vb, const AttnShape& a, int j, int tiles, int S) {
    constexpr int E = FaTile<HD>::ELEMS;
    if (j + 1 < tiles) {
        const int nb = (j + 1) & 1;
        fa_load<HD>(ks + nb * E, kb, a.k_s, (j + 1) * AM_TILE, S);
        fa_load<HD>(vs + nb * E, vb, a.v_s, (j + 1) * AM_TILE, S);
        fa_commit();
        fa_wait<1>();
    } else {
        fa_wait<0>();
    }
}

// ---- forward ----

template <int HD, int MT, bool PAD, bool DROP, typename P>
__device__ __forceinline__ void fa_fwd(const P* q, const P* k, const P* v, P* o, f32* lse, const AttnShape& a, f32 scale,
                                       i32 causal, const u8* kp) {
    ORT_DYNAMIC_SHARED(u16, smem);
    constexpr int LD = FaTile<HD>::LD, E = FaTile<HD>::ELEMS;
    u16* qs = smem;         // Q [64 · MT][HD]
    u16* ks = qs + MT * E;  // K [2][64 keys][HD]
    u16* vs = ks + 2 * E;   // V [2][64 keys][HD]
    const auto [at, T, S, t0, row0, causal_tiles, kb, vb] = fa_rows<MT>(a, k, v, causal);
    const int lane = at.lane, g = at.g, qd = at.qd;
    const FaPad pad = fa_pad<PAD>(kp, a, at.off.m, S, T, causal != 0);
    const int tiles = PAD && t0 < pad.uni ? (S + AM_TILE - 1) / AM_TILE : causal_tiles;  // rows without a visible key see every key
    const bool skips = causal != 0 && (!PAD || row0 >= pad.uni);
    const AttDrop drop = DROP ? att_drop(a, at.bi) : AttDrop{};
    fa_load<HD, AM_TILE * MT>(qs, q + at.off.q, a.q_t, t0, T);
    fa_load<HD>(ks, kb, a.k_s, 0, S);
    fa_load<HD>(vs, vb, a.v_s, 0, S);
    fa_commit();
    const f32 sl2 = scale * FA_LOG2E;
    f32 m[MT][2], l[MT][2], acc[MT][HD / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) m[mt][h] = -ATT_INF, l[mt][h] = 0.f;
    fa_zero<HD, MT>(acc);
    u32 qa[MT][HD / 16][4];
    for (int j = 0; j < tiles; ++j) {
        const int buf = j & 1;
        fa_next_kv<HD>(ks, vs, kb, vb, a, j, tiles, S);
        __syncthreads();
        if (j == 0)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int kk = 0; kk < HD / 16; ++kk) fa_a(qa[mt][kk], qs, LD, row0 - t0 + 16 * mt, 16 * kk, lane);
        const int s0 = j * AM_TILE;
        if (!fa_tile_dead<MT>(s0, skips, row0)) {
            const u64 vis = PAD ? fa_keys_visible(pad, s0, lane) : ~0ull;
            f32 s[MT][8][4];
            fa_dots<P, HD, MT>(s, nullptr, 0, qa, ks + buf * E, lane);
            fa_mask_rows<MT, PAD>(s, causal != 0, row0, s0, S, g, qd, pad, vis);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                f32 mx[2] = {m[mt][0], m[mt][1]};
#pragma unroll
                for (int jj = 0; jj < 8; ++jj)
#pragma unroll
                    for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[mt][jj][e]);
                f32 base[2], corr[2], sum[2] = {0.f, 0.f};
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    mx[h] = am_quad_max(mx[h]);
                    base[h] = mx[h] == -ATT_INF ? 0.f : mx[h] * sl2;  // a row with no key yet: p and corr stay 0
                    corr[h] = fa_exp2(m[mt][h] * sl2 - base[h]);
                    m[mt][h] = mx[h];
                }
#pragma unroll
                for (int jj = 0; jj < 8; ++jj)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const f32 p = fa_exp2(fmaf(s[mt][jj][e], sl2, -base[e >> 1]));
                        s[mt][jj][e] = p;
                        sum[e >> 1] += p;
                    }
#pragma unroll
                for (int h = 0; h < 2; ++h) l[mt][h] = l[mt][h] * corr[h] + am_quad_sum(sum[h]);
#pragma unroll
                for (int n = 0; n < HD / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[mt][n][e] *= corr[e >> 1];
            }
            if (DROP) att_drop_rows<MT>(s, drop, row0, s0, g, qd);  // P∘Z
            fa_accumulate<P, HD, MT>(acc, s, vs + buf * E, lane);
        }
        __syncthreads();  // this buffer is read: the next iteration but one refills it
    }
    f32 inv[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) inv[mt][h] = 1.f / l[mt][h];
    fa_store<HD, MT>(o + at.off.o, a.o_t, acc, inv, row0, T, g, qd);
    if (qd == 0)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const i64 row = row0 + 16 * mt + g + 8 * h;
                if (row < T) lse[at.bi * T + row] = m[mt][h] * scale + logf(l[mt][h]);
            }
}

// ---- backward: dQ (and Δ) ----

template <int HD, int MT, bool PAD, bool DROP, typename P>
__device__ __forceinline__ void fa_bwd_dq(const P* dout, const P* q, const P* k, const P* v, const P* o, const f32* lse,
                                          f32* delta, P* dq, const AttnShape& a, f32 scale, i32 causal, const u8* kp) {
    ORT_DYNAMIC_SHARED(u16, smem);
    constexpr int E = FaTile<HD>::ELEMS, ROWS = AM_TILE * MT;
    u16* qs = smem;          // Q [64 · MT][HD]
    u16* dos = qs + MT * E;  // dO [64 · MT][HD]
    u16* ks = dos + MT * E;  // K [2][64 keys][HD]
    u16* vs = ks + 2 * E;    // V [2][64 keys][HD]
    ORT_SHARED(f32, delta_s, [ROWS]);
    const auto [at, T, S, t0, row0, causal_tiles, kb, vb] = fa_rows<MT>(a, k, v, causal);
    const int w = at.w, lane = at.lane, g = at.g, qd = at.qd, wr = row0 - t0;
    const FaPad pad = fa_pad<PAD>(kp, a, at.off.m, S, T, causal != 0);
    const int tiles = PAD && t0 < pad.uni ? (S + AM_TILE - 1) / AM_TILE : causal_tiles;
    const bool skips = causal != 0 && (!PAD || row0 >= pad.uni);
    const AttDrop drop = DROP ? att_drop(a, at.bi) : AttDrop{};
    fa_load<HD, ROWS>(qs, q + at.off.q, a.q_t, t0, T);
    fa_load<HD, ROWS>(dos, dout + at.off.o, a.o_t, t0, T);
    fa_load<HD>(ks, kb, a.k_s, 0, S);
    fa_load<HD>(vs, vb, a.v_s, 0, S);
    fa_commit();
#pragma unroll
    for (int i = 0; i < MT; ++i) am_delta_rows<HD>(delta_s + AM_TILE * i, dout + at.off.o, o + at.off.o, a.o_t, T, t0 + AM_TILE * i, w, lane);
    __syncthreads();
    for (int r = threadIdx.x; r < ROWS; r += blockDim.x)
        if (t0 + r < T) delta[at.bi * T + t0 + r] = delta_s[r];
    const f32 sl2 = scale * FA_LOG2E;
    f32 lse2[MT][2], drow[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 row = row0 + 16 * mt + g + 8 * h;
            lse2[mt][h] = row < T ? lse[at.bi * T + row] * FA_LOG2E : 0.f;
            drow[mt][h] = delta_s[wr + 16 * mt + g + 8 * h];
        }
    f32 acc[MT][HD / 8][4];
    fa_zero<HD, MT>(acc);
    for (int j = 0; j < tiles; ++j) {
        const int buf = j & 1;
        fa_next_kv<HD>(ks, vs, kb, vb, a, j, tiles, S);
        __syncthreads();
        const int s0 = j * AM_TILE;
        if (!fa_tile_dead<MT>(s0, skips, row0)) {
            const u16 *kt = ks + buf * E, *vt = vs + buf * E;
            const u64 vis = PAD ? fa_keys_visible(pad, s0, lane) : ~0ull;
            f32 p[MT][8][4], dp[MT][8][4];
            fa_dots<P, HD, MT>(p, qs, wr, nullptr, kt, lane);
            fa_mask_rows<MT, PAD>(p, causal != 0, row0, s0, S, g, qd, pad, vis);
            fa_dots<P, HD, MT>(dp, dos, wr, nullptr, vt, lane);  // dP = dO · Vᵀ
            if (DROP) att_drop_rows<MT>(dp, drop, row0, s0, g, qd);  // Z∘dP
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int jj = 0; jj < 8; ++jj)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const f32 pe = fa_exp2(fmaf(p[mt][jj][e], sl2, -lse2[mt][e >> 1]));
                        dp[mt][jj][e] = pe * (dp[mt][jj][e] - drow[mt][e >> 1]);  // dS
                    }
            fa_accumulate<P, HD, MT>(acc, dp, kt, lane);  // dQ += dS · K
        }
        __syncthreads();
    }
    f32 mul[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) mul[mt][0] = mul[mt][1] = scale;
    fa_store<HD, MT>(dq + at.off.gq, a.q_t, acc, mul, row0, T, g, qd);
}

// ---- backward: dK, dV ----

// A block owns 64 · MT keys (warp w: keys 16·MT·w..+16·MT as the rows of its products) and walks
// the query tiles of 64 rows (causal: from its own diagonal on), each in MT parts of 64 / MT
// queries (the accumulators of 16·MT keys leave registers for that many score columns):
// Sᵀ = K·Qᵀ, Pᵀ, dV += Pᵀ·dO, dPᵀ = V·dOᵀ, dSᵀ, dK += dSᵀ·Q.
template <int HD, int MT, bool PAD, bool DROP, typename P>
__device__ __forceinline__ void fa_bwd_dkv(const P* dout, const P* q, const P* k, const P* v, const f32* lse,
                                           const f32* delta, P* dk, P* dv, const AttnShape& a, f32 scale, i32 causal, const u8* kp) {
    ORT_DYNAMIC_SHARED(u16, smem);
    constexpr int LD = FaTile<HD>::LD, E = FaTile<HD>::ELEMS, QP = AM_TILE / MT, NJ = QP / 8;
    u16* ks = smem;            // K [64 · MT keys][HD]
    u16* vs = ks + MT * E;     // V [64 · MT keys][HD]
    u16* qs = vs + MT * E;     // Q [2][64 rows][HD]
    u16* dos = qs + 2 * E;     // dO [2][64 rows][HD]
    f32* lse_s = reinterpret_cast<f32*>(dos + 2 * E);  // LSE [2][64]
    f32* dl_s = lse_s + 2 * AM_TILE;                    // Δ [2][64]
    const FaPlace at = fa_place(a, a.S, false, AM_TILE * MT);
    const int T = (int)a.T, S = (int)a.S, s0 = (int)at.r0, wk = 16 * MT * at.w, key0 = s0 + wk;  // < 2^31 (the dispatcher checks)
    const int lane = at.lane, g = at.g, qd = at.qd;
    const P *qb = q + at.off.q, *dob = dout + at.off.o;
    const f32 *lb = lse + at.bi * T, *db = delta + at.bi * T;
    const FaPad pad = fa_pad<PAD>(kp, a, at.off.m, S, T, causal != 0);
    const u32 key_vis = PAD ? fa_rows_visible<MT>(pad, key0, g) : ~0u;
    // the query parts from which on the padding masks nothing: none where a key of the warp is
    // padding, else those past the queries without a visible key
    const int pad_below = key_vis >> 31 ? T : pad.uni;
    const AttDrop drop = DROP ? att_drop(a, at.bi) : AttDrop{};
    // causal: rows before the block's first key see none of its keys, unless they see every key
    const int t_begin = causal && (!PAD || pad.uni == 0) ? s0 : 0;
    const int tiles = (T - t_begin + AM_TILE - 1) / AM_TILE;
    fa_load<HD, AM_TILE * MT>(ks, k + at.off.k, a.k_s, s0, S);
    fa_load<HD, AM_TILE * MT>(vs, v + at.off.v, a.v_s, s0, S);
    if (tiles > 0) {
        fa_load<HD>(qs, qb, a.q_t, t_begin, T);
        fa_load<HD>(dos, dob, a.o_t, t_begin, T);
        fa_load_row_floats(lse_s, lb, t_begin, T, 0);
        fa_load_row_floats(dl_s, db, t_begin, T, AM_TILE);
    }
    fa_commit();
    const f32 sl2 = scale * FA_LOG2E;
    f32 acc_k[MT][HD / 8][4], acc_v[MT][HD / 8][4];
    fa_zero<HD, MT>(acc_k);
    fa_zero<HD, MT>(acc_v);
    for (int j = 0; j < tiles; ++j) {
        const int buf = j & 1;
        const int t0 = t_begin + j * AM_TILE;
        if (j + 1 < tiles) {
            const int nb = buf ^ 1;
            fa_load<HD>(qs + nb * E, qb, a.q_t, t0 + AM_TILE, T);
            fa_load<HD>(dos + nb * E, dob, a.o_t, t0 + AM_TILE, T);
            fa_load_row_floats(lse_s + nb * AM_TILE, lb, t0 + AM_TILE, T, 0);
            fa_load_row_floats(dl_s + nb * AM_TILE, db, t0 + AM_TILE, T, AM_TILE);
            fa_commit();
            fa_wait<1>();
        } else {
            fa_wait<0>();
        }
        __syncthreads();
#pragma unroll
        for (int part = 0; part < MT; ++part) {
            const int tq = t0 + QP * part;  // the part's first query
            if (causal && tq + QP - 1 < key0 && (!PAD || tq >= pad.uni)) continue;  // every key of the warp past every query of the part
            const u16 *qt = qs + buf * E + QP * part * LD, *dot = dos + buf * E + QP * part * LD;
            const f32 *lr = lse_s + buf * AM_TILE + QP * part, *dr = dl_s + buf * AM_TILE + QP * part;
            f32 p[MT][NJ][4], dp[MT][NJ][4];
            fa_dots<P, HD, MT, NJ>(p, ks, wk, nullptr, qt, lane);  // Sᵀ: element (key, query 8j + 2qd + (e & 1))
            if ((PAD && tq < pad_below) || tq + QP > T || (causal && tq < key0 + 16 * MT - 1))
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) fa_mask<true, PAD, NJ>(p[mt], causal != 0, key0 + 16 * mt, tq, T, g, qd, pad.uni, key_vis >> 2 * mt);
            fa_dots<P, HD, MT, NJ>(dp, vs, wk, nullptr, dot, lane);  // dPᵀ = V · dOᵀ
            const u32 kept = DROP ? att_drop_keys<MT, NJ>(dp, drop, key0, tq, g, qd) : 0u;  // Z∘dPᵀ
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = 8 * jj + 2 * qd + (e & 1);
                        const f32 pe = fa_exp2(fmaf(p[mt][jj][e], sl2, -lr[r] * FA_LOG2E));
                        p[mt][jj][e] = pe;
                        dp[mt][jj][e] = pe * (dp[mt][jj][e] - dr[r]);  // dSᵀ
                    }
            if (DROP) att_drop_kept<MT, NJ>(p, kept, drop);  // P∘Z
            fa_accumulate<P, HD, MT, NJ>(acc_v, p, dot, lane);  // dV += (P∘Z)ᵀ · dO
            fa_accumulate<P, HD, MT, NJ>(acc_k, dp, qt, lane);  // dK += dSᵀ · Q
        }
        __syncthreads();
    }
    f32 one[MT][2], mul[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) one[mt][0] = one[mt][1] = 1.f, mul[mt][0] = mul[mt][1] = scale;
    fa_store<HD, MT>(dk + at.off.gk, a.k_s, acc_k, mul, key0, S, g, qd);
    fa_store<HD, MT>(dv + at.off.gv, a.v_s, acc_v, one, key0, S, g, qd);
}

// One forward and one dQ kernel of MT m16 row tiles a warp (64 · MT query rows a block), named
// with SUFFIX, for tensors (and products) of the 16-bit type P; BLOCKS: blocks an SM must hold
// (ptxas keeps their registers to fit); PAD: with key padding (every kernel takes `kp`; those
// without PAD ignore it); DROP: with the probabilities' dropout (those without it ignore
// AttnShape's drop_*).
#define FA_ROW_KERNELS(HD, MT, SUFFIX, BLOCKS, P, PAD, DROP)                                                                                      \
    extern "C" __global__ void __launch_bounds__(128, BLOCKS) attention_flash_fwd_d##HD##SUFFIX##_##P(                                 \
        const P* q, const P* k, const P* v, P* o, f32* lse, AttnShape a, f32 scale, i32 causal, const u8* kp) {                        \
        fa_fwd<HD, MT, PAD, DROP>(q, k, v, o, lse, a, scale, causal, kp);                                                                     \
    }                                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128, BLOCKS) attention_flash_bwd_dq_d##HD##SUFFIX##_##P(                              \
        const P* dout, const P* q, const P* k, const P* v, const P* o, const f32* lse, f32* delta, P* dq, AttnShape a, f32 scale,    \
        i32 causal, const u8* kp) {                                                                                                 \
        fa_bwd_dq<HD, MT, PAD, DROP>(dout, q, k, v, o, lse, delta, dq, a, scale, causal, kp);                                                 \
    }
// One dK/dV kernel of MT m16 key tiles a warp (64 · MT keys a block).
#define FA_DKV_KERNEL(HD, MT, SUFFIX, P, PAD, DROP)                                                                                            \
    extern "C" __global__ void __launch_bounds__(128) attention_flash_bwd_dkv_d##HD##SUFFIX##_##P(                                 \
        const P* dout, const P* q, const P* k, const P* v, const f32* lse, const f32* delta, P* dk, P* dv, AttnShape a, f32 scale,   \
        i32 causal, const u8* kp) {                                                                                                 \
        fa_bwd_dkv<HD, MT, PAD, DROP>(dout, q, k, v, lse, delta, dk, dv, a, scale, causal, kp);                                              \
    }

// Every head size's kernels for the 16-bit type P, named with TAG after the block size (empty,
// _kp, _dp, _kp_dp: one per file, so that the four files instantiate the same blocks and launch
// bounds). Heads of 64, 64-row blocks: 3 blocks (12 warps) an SM at 168 registers a thread, where
// unbounded ptxas takes 182 (forward) and 203 (dQ), which leave 2; the price is 24 bytes of dQ
// spills (NVRTC 13.0, bf16). 128-row blocks (r128: 32 rows or keys a warp, each fragment of the
// other operand read from shared memory once for two row tiles: the forward's and dQ's
// shared-memory traffic per FLOP halved, dK/dV's cut by a third): 255 registers, 2 blocks an SM.
// Heads of 32 only in 128-row blocks, 2 an SM (196-255 registers; at 3, 168 registers, the dQ
// kernels with dropout spilled 192 bytes); heads of 80 and 96 in 64-row blocks, 2 an SM (200-255
// registers, no spills); heads of 128, 1.
#define FA_INSTANCES(P, TAG, PAD, DROP)                    \
    FA_ROW_KERNELS(32, 2, r128##TAG, 2, P, PAD, DROP)      \
    FA_ROW_KERNELS(64, 1, TAG, 3, P, PAD, DROP)            \
    FA_ROW_KERNELS(64, 2, r128##TAG, 2, P, PAD, DROP)      \
    FA_ROW_KERNELS(80, 1, TAG, 2, P, PAD, DROP)            \
    FA_ROW_KERNELS(96, 1, TAG, 2, P, PAD, DROP)            \
    FA_ROW_KERNELS(128, 1, TAG, 1, P, PAD, DROP)           \
    FA_DKV_KERNEL(32, 2, r128##TAG, P, PAD, DROP)          \
    FA_DKV_KERNEL(64, 1, TAG, P, PAD, DROP)                \
    FA_DKV_KERNEL(64, 2, r128##TAG, P, PAD, DROP)          \
    FA_DKV_KERNEL(80, 1, TAG, P, PAD, DROP)                \
    FA_DKV_KERNEL(96, 1, TAG, P, PAD, DROP)                \
    FA_DKV_KERNEL(128, 1, TAG, P, PAD, DROP)
