// Pools over [N, C, H, W] planes (engine/src/ops/pool.rs; CPU kernels
// engine/src/backend/cpu/pool.rs); 1-D windows run with H = 1. GlobalAveragePool and its
// gradient are reductions (kernels/reduce.cu).
//
//   max_pool_T(const T* x, T* y, i64* idx, Win2d w, i64 n)           n = planes * out_h * out_w
//       the first maximum of each window (a NaN wins), and its flat index into x in idx (may be
//       null); a window entirely in the padding gives -inf and index -1
//   max_pool_grad_T(const T* dy, const i64* idx, T* dx, i64 n, i64 out_plane, i64 in_plane, i32* err)
//       dx (zeroed by the caller) += dy at the saved indices (float atomics: windows overlap);
//       an index outside its own (n, c) plane is dropped and sets *err (err may be null)
//   avg_pool_T(const T* x, T* y, Win2d w, i64 n, i32 count_include_pad)
//   avg_pool_grad_T(const T* dy, T* dx, Win2d w, i64 n, i32 count_include_pad)   n = dx's size
//       gathered: each dx element sums dy / divisor over the windows that contain it
// The divisor counts the taps inside the input (with count_include_pad, inside the padded input).
// T: max_pool f32 f64 bf16 f16; the gradient f32 f64 (atomics); avg_pool(_grad) f32 f64 bf16 f16.

#include "prelude.cuh"

// The divisor of output (oi, oj) of an average pool.
__device__ __forceinline__ i64 avg_divisor(const Win2d& w, i64 oi, i64 oj, bool include_pad) {
    const i64 lo_h = include_pad ? -w.pad_h : 0, hi_h = include_pad ? w.in_h + w.pad_end_h : w.in_h;
    const i64 lo_w = include_pad ? -w.pad_w : 0, hi_w = include_pad ? w.in_w + w.pad_end_w : w.in_w;
    i64 ch = 0, cw = 0;
    for (i64 k = 0; k < w.k_h; ++k) {
        const i64 p = oi * w.stride_h - w.pad_h + k * w.dil_h;
        ch += (p >= lo_h && p < hi_h);
    }
    for (i64 k = 0; k < w.k_w; ++k) {
        const i64 p = oj * w.stride_w - w.pad_w + k * w.dil_w;
        cw += (p >= lo_w && p < hi_w);
    }
    return ch * cw > 0 ? ch * cw : 1;
}

template <typename T> __device__ __forceinline__ void max_pool(const T* x, T* y, i64* idx, const Win2d& w, i64 n) {
    typedef typename Num<T>::Acc A;
    const i64 ohw = w.out_h * w.out_w, ip = w.in_h * w.in_w;
    ORT_GRID_LOOP(e, n) {
        const i64 o = e % ohw, p = e / ohw;
        const i64 oi = o / w.out_w, oj = o - oi * w.out_w;
        A best = -m_inf<A>();
        i64 at = -1;
        for_each_window_tap(w, oi, oj, [&](i64 ih, i64 iw) {
            const i64 src = p * ip + ih * w.in_w + iw;
            const A v = Num<T>::load(x[src]);
            if (at < 0 || v > best || (m_isnan(v) && !m_isnan(best))) {
                best = v;
                at = src;
            }
        });
        y[e] = Num<T>::store(best);
        if (idx) idx[e] = at;
    }
}

template <typename T>
__device__ __forceinline__ void max_pool_grad(const T* dy, const i64* idx, T* dx, i64 n, i64 out_plane, i64 in_plane, i32* err) {
    ORT_GRID_LOOP(e, n) {
        const i64 i = idx[e];
        if (i < 0) continue;  // a window entirely in the padding selected nothing
        const i64 base = (e / out_plane) * in_plane;
        if (i < base || i >= base + in_plane) {
            if (err) *err = 1;
            continue;
        }
        atomic_add(dx + i, dy[e]);
    }
}

template <typename T> __device__ __forceinline__ void avg_pool(const T* x, T* y, const Win2d& w, i64 n, bool include_pad) {
    typedef typename Num<T>::Acc A;
    const i64 ohw = w.out_h * w.out_w, ip = w.in_h * w.in_w;
    ORT_GRID_LOOP(e, n) {
        const i64 o = e % ohw, p = e / ohw;
        const i64 oi = o / w.out_w, oj = o - oi * w.out_w;
        A s = 0;
        for_each_window_tap(w, oi, oj, [&](i64 ih, i64 iw) { s += Num<T>::load(x[p * ip + ih * w.in_w + iw]); });
        y[e] = Num<T>::store(s / (A)avg_divisor(w, oi, oj, include_pad));
    }
}

template <typename T> __device__ __forceinline__ void avg_pool_grad(const T* dy, T* dx, const Win2d& w, i64 n, bool include_pad) {
    typedef typename Num<T>::Acc A;
    const i64 ohw = w.out_h * w.out_w;
    ORT_GRID_LOOP(e, n) {
        const i64 iw = e % w.in_w, t = e / w.in_w;
        const i64 ih = t % w.in_h, p = t / w.in_h;
        A s = 0;
        for_each_window_source(w, ih, iw, [&](i64, i64, i64 oi, i64 oj) {
            s += Num<T>::load(dy[p * ohw + oi * w.out_w + oj]) / (A)avg_divisor(w, oi, oj, include_pad);
        });
        dx[e] = Num<T>::store(s);
    }
}

#define POOL(op, T)                                                                           \
    extern "C" __global__ void max_pool_##T(const T* x, T* y, i64* idx, Win2d w, i64 n) { max_pool<T>(x, y, idx, w, n); } \
    extern "C" __global__ void avg_pool_##T(const T* x, T* y, Win2d w, i64 n, i32 include_pad) {       \
        avg_pool<T>(x, y, w, n, include_pad != 0);                                            \
    }                                                                                         \
    extern "C" __global__ void avg_pool_grad_##T(const T* dy, T* dx, Win2d w, i64 n, i32 include_pad) { \
        avg_pool_grad<T>(dy, dx, w, n, include_pad != 0);                                     \
    }
ORT_FLOATS(POOL, _)

#define POOL_GRAD(op, T)                                                                      \
    extern "C" __global__ void max_pool_grad_##T(const T* dy, const i64* idx, T* dx, i64 n, i64 out_plane, i64 in_plane, i32* err) { \
        max_pool_grad<T>(dy, idx, dx, n, out_plane, in_plane, err);                           \
    }
POOL_GRAD(_, f32)
POOL_GRAD(_, f64)
