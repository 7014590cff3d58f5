// Gather (embedding lookups) and GatherElements with their scatter-add gradients
// (engine/src/ops/movement.rs; CPU kernels engine/src/backend/cpu/movement.rs).
//
// Indices are i64 (what PyTorch exports; int32 indices are cast first) and may be negative
// (counted from the end of the axis). An index out of range cannot fail a kernel: its output
// is 0 (its gradient is dropped) and *err is set to 1 (err may be null); the executor checks
// err after the step and reports the node, as the CPU kernel does.
//
//   gather_W(const W* x, const i64* idx, W* y, i64 n, i64 dim, i64 n_idx, i64 inner, i32* err)
//       x viewed as [outer, dim, inner], y as [outer, n_idx, inner], n = outer * n_idx * inner;
//       by element width W: u8 u16 u32 u64
//   GatherGrad without atomics (engine/src/backend/cuda/ops/gather.rs), so that a step gives
//   the same bits every run, and the CPU's (rows summed in position order from 0):
//   gather_grad_keys_i64(const i64* idx, u32* keys, u32* pos, i64 n_idx, i64 dim, i32* err)
//       keys[j] = idx[j] normalised into [0, dim) (dim where out of range: sorted last and
//       summed nowhere), pos[j] = j; then sorted by key, stably (kernels/sort.cu)
//   gather_grad_rows_T(const T* dy, const u32* keys, const u32* pos, T* dx, A* partials, i64 outer, i64 n_idx, i64 dim, i64 inner)
//       a warp a (outer slice, sorted slot, 32 columns): where the slot starts a run of equal
//       keys below dim, or one of its segments of ROWS_PER_SEGMENT slots, each lane sums its
//       column of dy's rows at those positions, in position order, in the accumulation type A
//       from 0 (f32; f64 for f64), and writes it to dx's row `key` (a run of one segment; dx
//       zeroed by the caller: rows no index names) or to the segment's row of partials
//       (outer × 2·ceil(n_idx / ROWS_PER_SEGMENT) rows of `inner`). T: f32 f64 bf16 f16
//   gather_grad_runs_T(const u32* keys, const A* partials, T* dx, i64 outer, i64 n_idx, i64 dim, i64 inner)
//       then, a warp a (outer slice, slot, 32 columns) starting a run of more than one
//       segment: the segments' partials added in order from 0, written to dx's row `key`
//   gather_grad_small_T(const T* dy, const i64* idx, T* dx, i64 outer, i64 n_idx, i64 dim, i64 inner, i32* err)
//       the same sums without the sort, for a few indices (a select's one): a warp a (outer
//       slice, position, 32 columns) scans the indices before and after its position
//   gather_elements_W(const W* x, const i64* idx, W* y, Strides s, i64 n, i32 axis, i64 dim, i32* err)
//       s.dims is the index tensor's shape (and y's), s.stride[0] the strides of x, s.base[0] 0:
//       y[p] = x[coords of p, with idx[p] on `axis`]
//   gather_elements_grad_T(const T* dy, const i64* idx, T* dx, Strides s, i64 n, i32 axis, i64 dim, i32* err)
//   gather_nd_W(const W* x, const i64* idx, W* y, Strides s, i64 n, i64 slice, i64 tuples, i64 batch_block, i32* err)
//       GatherND (engine/src/ops/gather_nd.rs): s.rank is the tuple length k and s.dims the k
//       data dimensions a tuple indexes (only those fields are read); output element
//       t·slice + j is x[(t / tuples)·batch_block + offset(tuple t)·slice + j]
//   gather_nd_grad_T(const T* dy, const i64* idx, T* dx, Strides s, i64 n, i64 slice, i64 tuples, i64 batch_block, i32* err)
//       dx (zeroed by the caller) += dy scattered back (float atomics)

#include "prelude.cuh"

// The index normalised into [0, dim), or -1 (and *err set) when out of range.
__device__ __forceinline__ i64 checked_index(i64 id, i64 dim, i32* err) {
    if (id < 0) id += dim;
    if (id < 0 || id >= dim) {
        if (err) *err = 1;
        return -1;
    }
    return id;
}

// Source offset of element e of the gather output, or -1.
__device__ __forceinline__ i64 gather_src(i64 e, const i64* idx, i64 dim, i64 n_idx, i64 inner, i32* err) {
    const i64 k = e % inner, t = e / inner;
    const i64 j = t % n_idx, outer = t / n_idx;
    const i64 id = checked_index(idx[j], dim, err);
    return id < 0 ? -1 : (outer * dim + id) * inner + k;
}

// Offset in x of element p of a GatherElements output, or -1.
__device__ __forceinline__ i64 elements_src(const Strides& s, i64 p, const i64* idx, int axis, i64 dim, i32* err) {
    const i64 id = checked_index(idx[p], dim, err);
    if (id < 0) return -1;
    i64 off = 0, rest = p;
#pragma unroll 1
    for (int d = s.rank - 1; d >= 0; --d) {
        const i64 q = rest / s.dims[d], c = rest - q * s.dims[d];
        rest = q;
        off += (d == axis ? id : c) * s.stride[0][d];
    }
    return off;
}

// Source offset of element e of a GatherND output, or -1.
__device__ __forceinline__ i64 nd_src(i64 e, const i64* idx, const Strides& s, i64 slice, i64 tuples, i64 batch_block, i32* err) {
    const i64 t = e / slice, j = e - t * slice;
    i64 off = 0;
#pragma unroll 1
    for (int d = 0; d < s.rank; ++d) {
        const i64 id = checked_index(idx[t * s.rank + d], s.dims[d], err);
        if (id < 0) return -1;
        off = off * s.dims[d] + id;
    }
    return (t / tuples) * batch_block + off * slice + j;
}

#define GATHER(op, W)                                                                         \
    extern "C" __global__ void gather_##W(const W* x, const i64* idx, W* y, i64 n, i64 dim, i64 n_idx, i64 inner, i32* err) { \
        ORT_GRID_LOOP(e, n) {                                                                 \
            const i64 src = gather_src(e, idx, dim, n_idx, inner, err);                       \
            y[e] = src < 0 ? (W)0 : x[src];                                                   \
        }                                                                                     \
    }                                                                                         \
    extern "C" __global__ void gather_elements_##W(const W* x, const i64* idx, W* y, Strides s, i64 n, i32 axis, i64 dim, i32* err) { \
        ORT_GRID_LOOP(p, n) {                                                                 \
            const i64 src = elements_src(s, p, idx, axis, dim, err);                          \
            y[p] = src < 0 ? (W)0 : x[src];                                                   \
        }                                                                                     \
    }                                                                                         \
    extern "C" __global__ void gather_nd_##W(const W* x, const i64* idx, W* y, Strides s, i64 n, i64 slice, i64 tuples, i64 batch_block, \
                                             i32* err) {                                      \
        ORT_GRID_LOOP(e, n) {                                                                 \
            const i64 src = nd_src(e, idx, s, slice, tuples, batch_block, err);               \
            y[e] = src < 0 ? (W)0 : x[src];                                                   \
        }                                                                                     \
    }
ORT_WIDTHS(GATHER, _)

extern "C" __global__ void gather_grad_keys_i64(const i64* idx, u32* keys, u32* pos, i64 n_idx, i64 dim, i32* err) {
    ORT_GRID_LOOP(j, n_idx) {
        const i64 id = checked_index(idx[j], dim, err);
        keys[j] = (u32)(id < 0 ? dim : id);
        pos[j] = (u32)j;
    }
}

// The first slot past `s` whose key is not `key` (keys sorted).
__device__ __forceinline__ i64 run_end(const u32* keys, i64 s, i64 n, u32 key) {
    i64 lo = s + 1, hi = n;
    while (lo < hi) {
        const i64 mid = lo + (hi - lo) / 2;
        if (keys[mid] == key) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// GatherGrad's work items, a warp each: (outer slice o, slot s of the n_idx, 32 columns);
// f(o, s, k) for each lane's column k below inner, over a grid-stride loop of warps.
template <typename F> __device__ __forceinline__ void for_each_row_tile(i64 outer, i64 n_idx, i64 inner, F f) {
    const i64 tiles = (inner + 31) / 32, items = outer * n_idx * tiles;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    const int lane = threadIdx.x & 31;
    for (i64 w = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); w < items; w += warps) {
        const i64 tile = w % tiles, rest = w / tiles;
        const i64 k = tile * 32 + lane;
        if (k < inner) f(rest / n_idx, rest % n_idx, k);
    }
}

// A run of equal keys longer than this (a padding token's, BERT's all-zero token types) is
// summed a segment of this many rows at a time, the segments on warps of their own, and then
// the segments' sums in order (gather_grad_runs_T): the CPU adds in the same order
// (engine/src/ops/movement.rs `GATHER_GRAD_SEGMENT`, which must equal it).
#define ROWS_PER_SEGMENT 32

// The first slot of the run that holds slot s (keys sorted).
__device__ __forceinline__ i64 run_begin(const u32* keys, i64 s, u32 key) {
    i64 lo = 0, hi = s;
    while (lo < hi) {
        const i64 mid = lo + (hi - lo) / 2;
        if (keys[mid] == key) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

// Where the sum of the segment starting at slot s is kept, among an outer slice's
// 2 * ceil(n_idx / ROWS_PER_SEGMENT) rows of partials: a run's full segments are disjoint
// ROWS_PER_SEGMENT-slot spans, so their s / ROWS_PER_SEGMENT differ, and so do those of the
// last segments of runs longer than one segment (more than ROWS_PER_SEGMENT slots apart).
__device__ __forceinline__ i64 partial_row(i64 s, bool last) {
    return 2 * (s / ROWS_PER_SEGMENT) + (last ? 1 : 0);
}

template <typename T>
__device__ __forceinline__ void gather_grad_rows(const T* dy, const u32* keys, const u32* pos, T* dx, typename Num<T>::Acc* partials,
                                                 i64 outer, i64 n_idx, i64 dim, i64 inner) {
    typedef typename Num<T>::Acc A;
    const i64 rows = 2 * ((n_idx + ROWS_PER_SEGMENT - 1) / ROWS_PER_SEGMENT);
    for_each_row_tile(outer, n_idx, inner, [&](i64 o, i64 s, i64 k) {
        const u32 key = keys[s];
        if ((i64)key >= dim) return;
        bool whole = true;
        if (s > 0 && keys[s - 1] == key) {
            // inside a run: s starts a segment where the run began a multiple of its length before
            if (s < ROWS_PER_SEGMENT || keys[s - ROWS_PER_SEGMENT] != key) return;
            if ((s - run_begin(keys, s, key)) % ROWS_PER_SEGMENT) return;
            whole = false;
        }
        const i64 span = min(n_idx, s + ROWS_PER_SEGMENT);
        const i64 stop = run_end(keys, s, span, key);
        const bool last = stop < span || span == n_idx || keys[span] != key;
        const T* src = dy + o * n_idx * inner + k;
        A acc = 0;
#pragma unroll 8
        for (i64 r = s; r < stop; ++r) acc += Num<T>::load(src[(i64)pos[r] * inner]);
        if (whole && last) dx[(o * dim + key) * inner + k] = Num<T>::store(acc);
        else partials[(o * rows + partial_row(s, last)) * inner + k] = acc;
    });
}

// The runs longer than a segment: their segments' sums (gather_grad_rows_T) added in order.
template <typename T>
__device__ __forceinline__ void gather_grad_runs(const u32* keys, const typename Num<T>::Acc* partials, T* dx, i64 outer, i64 n_idx,
                                                 i64 dim, i64 inner) {
    typedef typename Num<T>::Acc A;
    const i64 rows = 2 * ((n_idx + ROWS_PER_SEGMENT - 1) / ROWS_PER_SEGMENT);
    for_each_row_tile(outer, n_idx, inner, [&](i64 o, i64 s, i64 k) {
        const u32 key = keys[s];
        if ((i64)key >= dim || (s > 0 && keys[s - 1] == key)) return;
        if (s + ROWS_PER_SEGMENT >= n_idx || keys[s + ROWS_PER_SEGMENT] != key) return;
        const i64 end = run_end(keys, s, n_idx, key);
        const A* part = partials + o * rows * inner + k;
        A acc = 0;
        // the bound is known before the loop: the loads of several segments are in flight at once
#pragma unroll 8
        for (i64 t = s; t < end; t += ROWS_PER_SEGMENT) acc += part[partial_row(t, t + ROWS_PER_SEGMENT >= end) * inner];
        dx[(o * dim + key) * inner + k] = Num<T>::store(acc);
    });
}

// A few indices (at most ops/gather.rs `SMALL`): no sort. Where position j is the first of its
// index, the lanes sum dy's rows at j and every later position of that index, in order.
template <typename T>
__device__ __forceinline__ void gather_grad_small(const T* dy, const i64* idx, T* dx, i64 outer, i64 n_idx, i64 dim, i64 inner, i32* err) {
    typedef typename Num<T>::Acc A;
    for_each_row_tile(outer, n_idx, inner, [&](i64 o, i64 j, i64 k) {
        const i64 id = checked_index(idx[j], dim, err);
        if (id < 0) return;
        for (i64 e = 0; e < j; ++e)
            if (checked_index(idx[e], dim, nullptr) == id) return;
        const T* src = dy + o * n_idx * inner + k;
        A acc = 0;
        for (i64 e = j; e < n_idx; ++e)
            if (checked_index(idx[e], dim, nullptr) == id) acc += Num<T>::load(src[e * inner]);
        dx[(o * dim + id) * inner + k] = Num<T>::store(acc);
    });
}

#define GATHER_GRAD_ROWS(op, T)                                                               \
    extern "C" __global__ void gather_grad_rows_##T(const T* dy, const u32* keys, const u32* pos, T* dx, Num<T>::Acc* partials, \
                                                    i64 outer, i64 n_idx, i64 dim, i64 inner) { \
        gather_grad_rows<T>(dy, keys, pos, dx, partials, outer, n_idx, dim, inner);           \
    }                                                                                         \
    extern "C" __global__ void gather_grad_runs_##T(const u32* keys, const Num<T>::Acc* partials, T* dx, i64 outer, i64 n_idx,    \
                                                    i64 dim, i64 inner) {                     \
        gather_grad_runs<T>(keys, partials, dx, outer, n_idx, dim, inner);                    \
    }                                                                                         \
    extern "C" __global__ void gather_grad_small_##T(const T* dy, const i64* idx, T* dx, i64 outer, i64 n_idx, i64 dim, i64 inner, \
                                                     i32* err) {                              \
        gather_grad_small<T>(dy, idx, dx, outer, n_idx, dim, inner, err);                     \
    }
ORT_FLOATS(GATHER_GRAD_ROWS, _)

#define GATHER_GRAD(op, T)                                                                    \
    extern "C" __global__ void gather_elements_grad_##T(const T* dy, const i64* idx, T* dx, Strides s, i64 n, i32 axis, i64 dim, i32* err) { \
        ORT_GRID_LOOP(p, n) {                                                                 \
            const i64 dst = elements_src(s, p, idx, axis, dim, err);                          \
            if (dst >= 0) atomic_add(dx + dst, dy[p]);                                        \
        }                                                                                     \
    }                                                                                         \
    extern "C" __global__ void gather_nd_grad_##T(const T* dy, const i64* idx, T* dx, Strides s, i64 n, i64 slice, i64 tuples,       \
                                                  i64 batch_block, i32* err) {                \
        ORT_GRID_LOOP(e, n) {                                                                 \
            const i64 dst = nd_src(e, idx, s, slice, tuples, batch_block, err);               \
            if (dst >= 0) atomic_add(dx + dst, dy[e]);                                        \
        }                                                                                     \
    }
GATHER_GRAD(_, f32)
GATHER_GRAD(_, f64)
