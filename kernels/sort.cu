// A stable least-significant-digit radix sort of u32 keys carrying u32 values, 8 bits a pass
// (engine/src/backend/cuda/ops/radix_sort.rs queues the passes; GatherGrad sorts its indices
// with it so that repeated rows are summed in a fixed order). A pass over n keys in tiles of
// RADIX_TILE keys:
//
//   radix_hist_u32(const u32* keys, u32* hist, i64 n, i32 shift, i64 tiles)
//       a block a tile: hist[d * tiles + tile] = how many of the tile's keys have digit
//       d = (key >> shift) & 255 (integer counts: any order gives the same numbers)
//   radix_scan_u32(u32* hist, i64 count)
//       hist's exclusive prefix sum, in place (one block): digit-major, so hist[d * tiles + tile]
//       becomes where tile's first key of digit d goes
//   radix_scatter_u32(const u32* keys, const u32* vals, u32* keys_out, u32* vals_out,
//                     const u32* hist, i64 n, i32 shift, i64 tiles)
//       a block of RADIX_THREADS threads a tile: each key (and its value) to its digit's slot
//       plus its rank among the tile's earlier keys of that digit, so keys of equal digits keep
//       their order (stable)
//
// Blocks of radix_hist and radix_scatter walk the tiles with a grid-stride loop; radix_scatter
// needs blockDim.x = RADIX_THREADS.

#include "prelude.cuh"

#define RADIX_TILE 1024
#define RADIX_THREADS 256
#define RADIX_DIGITS 256

extern "C" __global__ void radix_hist_u32(const u32* keys, u32* hist, i64 n, i32 shift, i64 tiles) {
    __shared__ u32 count[RADIX_DIGITS];
    for (i64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        for (int d = threadIdx.x; d < RADIX_DIGITS; d += blockDim.x) count[d] = 0;
        __syncthreads();
        const i64 base = tile * RADIX_TILE;
        for (int i = threadIdx.x; i < RADIX_TILE && base + i < n; i += blockDim.x) atomicAdd(&count[(keys[base + i] >> shift) & 255u], 1u);
        __syncthreads();
        for (int d = threadIdx.x; d < RADIX_DIGITS; d += blockDim.x) hist[d * tiles + tile] = count[d];
        __syncthreads();
    }
}

extern "C" __global__ void radix_scan_u32(u32* hist, i64 count) {
    __shared__ u32 sums[1024];
    const int t = threadIdx.x, threads = blockDim.x;
    // thread t owns hist[lo, hi): its sum, then the block's scan of the sums
    const i64 per = (count + threads - 1) / threads;
    const i64 lo = min(count, (i64)t * per), hi = min(count, lo + per);
    u32 own = 0;
    for (i64 i = lo; i < hi; ++i) own += hist[i];
    sums[t] = own;
    __syncthreads();
    for (int step = 1; step < threads; step <<= 1) {
        const u32 add = t >= step ? sums[t - step] : 0u;
        __syncthreads();
        sums[t] += add;
        __syncthreads();
    }
    u32 run = t == 0 ? 0u : sums[t - 1];
    for (i64 i = lo; i < hi; ++i) {
        const u32 v = hist[i];
        hist[i] = run;
        run += v;
    }
}

extern "C" __global__ void radix_scatter_u32(const u32* keys, const u32* vals, u32* keys_out, u32* vals_out, const u32* hist, i64 n, i32 shift,
                                             i64 tiles) {
    __shared__ u32 next[RADIX_DIGITS];
    __shared__ u32 digit[RADIX_THREADS];
    const int t = threadIdx.x;
    for (i64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        for (int d = t; d < RADIX_DIGITS; d += RADIX_THREADS) next[d] = hist[d * tiles + tile];
        // the tile in rounds of RADIX_THREADS consecutive keys, a key a thread, in order
        for (int r = 0; r < RADIX_TILE; r += RADIX_THREADS) {
            const i64 i = tile * RADIX_TILE + r + t;
            const bool live = i < n;
            const u32 key = live ? keys[i] : 0u;
            const u32 d = live ? (key >> shift) & 255u : (u32)RADIX_DIGITS;
            digit[t] = d;
            __syncthreads();
            u32 rank = 0;
            bool last = true;
            for (int u = 0; u < RADIX_THREADS; ++u) {
                const bool same = digit[u] == d;
                if (u < t) rank += same;
                else if (u > t && same) last = false;
            }
            if (live) {
                const u32 at = next[d] + rank;
                keys_out[at] = key;
                vals_out[at] = vals[i];
            }
            // every thread has read next[] and digit[] before the round's last key of each
            // digit moves its digit on
            __syncthreads();
            if (live && last) next[d] += rank + 1;
            __syncthreads();
        }
    }
}
