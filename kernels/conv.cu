// Conv's data rearrangements around cuBLAS (engine/src/ops/conv.rs; CPU kernels
// engine/src/backend/cpu/conv.rs): the host multiplies the weight with the im2col matrix, one
// strided-batched gemm per group over the samples of a chunk, and for the input gradient
// multiplies the transposed weight with dy into a column matrix that col2im folds back.
//
// Layouts (w.channels = C, kk = k_h * k_w, ohw = out_h * out_w): x [S, C, in_h, in_w] and
// col [S, C * kk, ohw] with row (c * k_h + ki) * k_w + kj, so a group's rows are one block.
//
//   im2col_T(const T* x, T* col, Win2d w, i64 n)      n = S * C * kk * ohw
//       col[s][(c, ki, kj)][(oi, oj)] = x[s][c][oi * stride_h + ki * dil_h - pad_h][...], 0 in
//       the padding
//   col2im_T(const T* col, T* dx, Win2d w, i64 n)     n = S * C * in_h * in_w
//       the adjoint, gathered: each dx element sums the column entries that read it (no atomics,
//       every element written once)
// T: f32 f64 bf16 f16 (sums in the compute type).

#include "prelude.cuh"

template <typename T> __device__ __forceinline__ void im2col(const T* x, T* col, const Win2d& w, i64 n) {
    const i64 ohw = w.out_h * w.out_w, kk = w.k_h * w.k_w;
    ORT_GRID_LOOP(e, n) {
        const i64 o = e % ohw, r = e / ohw;  // r: sample * C * kk + row
        const i64 tap = r % kk, sc = r / kk;  // sc: sample * C + channel
        const i64 oi = o / w.out_w, oj = o - oi * w.out_w, ki = tap / w.k_w, kj = tap - ki * w.k_w;
        const i64 ih = oi * w.stride_h + ki * w.dil_h - w.pad_h, iw = oj * w.stride_w + kj * w.dil_w - w.pad_w;
        const bool inside = ih >= 0 && ih < w.in_h && iw >= 0 && iw < w.in_w;
        col[e] = inside ? x[(sc * w.in_h + ih) * w.in_w + iw] : Num<T>::store(0);
    }
}

template <typename T> __device__ __forceinline__ void col2im(const T* col, T* dx, const Win2d& w, i64 n) {
    typedef typename Num<T>::Acc A;
    const i64 ohw = w.out_h * w.out_w, kk = w.k_h * w.k_w;
    ORT_GRID_LOOP(e, n) {
        const i64 iw = e % w.in_w, t = e / w.in_w;
        const i64 ih = t % w.in_h, sc = t / w.in_h;
        const T* rows = col + sc * kk * ohw;
        A acc = 0;
        for_each_window_source(w, ih, iw, [&](i64 ki, i64 kj, i64 oi, i64 oj) {
            acc += Num<T>::load(rows[(ki * w.k_w + kj) * ohw + oi * w.out_w + oj]);
        });
        dx[e] = Num<T>::store(acc);
    }
}

#define CONV(op, T)                                                                           \
    extern "C" __global__ void im2col_##T(const T* x, T* col, Win2d w, i64 n) { im2col<T>(x, col, w, n); } \
    extern "C" __global__ void col2im_##T(const T* col, T* dx, Win2d w, i64 n) { col2im<T>(col, dx, w, n); }
ORT_FLOATS(CONV, _)
