// RMS normalisation forward (saving 1/rms per row for the backward) and its backward
// (engine/src/ops/rms_norm.rs, made by passes/fuse_rms_norm.rs; CPU kernels
// engine/src/backend/cpu/rms_norm.rs, which sum in f64: here A = f32, f64 for f64). The input is
// [rows, n], normalised over n: y = x r [· scale], r = 1 / sqrt(mean(x²) + eps). These are
// layernorm.cu's kernels with the mean left out (norm_rows.cuh, RMS = true): the same launches
// (engine/src/backend/cuda/ops/norm.rs), rows of n <= 1024 a warp each, longer ones a block each.
//   rms_norm_T(const T* x, const T* scale, T* y, A* inv_rms, i64 rows, i64 n, f32 eps)
//                                                          scale may be null (no weight)
//   rms_norm_grad_T(const T* dy, const T* x, const T* scale, const A* inv_rms, T* dx, A* partial,
//                   i64 rows, i64 n)
//       dx = r (g - h mean(g h)), g = dy scale, h = x r (= r g - x r³ Σ(g x) / n); scale may be
//       null; with `partial` non-null, block b writes partial[b][n], the sums of dy h over the
//       rows it handled (zeros where none): dscale, after layernorm.cu's
//       layer_norm_grad_params_reduce_T with parts = 1. The launch's dynamic shared memory is
//       layernorm.cu's with one row of partials (rows up to 1024: blockDim.x / 32 * n A values).
// T: f32 f64 bf16 f16.

#include "prelude.cuh"
#include "norm_rows.cuh"

#define RMS_NORM(op, T)                                                                                                   \
    extern "C" __global__ void rms_norm_##T(const T* x, const T* scale, T* y, Num<T>::Acc* inv_rms, i64 rows, i64 n,     \
                                            f32 eps) {                                                                    \
        ln_fwd<T, T, true>(x, scale, nullptr, y, nullptr, inv_rms, rows, n, eps);                                         \
    }                                                                                                                     \
    extern "C" __global__ void rms_norm_grad_##T(const T* dy, const T* x, const T* scale, const Num<T>::Acc* inv_rms,     \
                                                 T* dx, Num<T>::Acc* partial, i64 rows, i64 n) {                          \
        ln_grad<T, T, T, true>(dy, x, scale, nullptr, inv_rms, dx, partial, 1, rows, n);                                  \
    }
ORT_FLOATS(RMS_NORM, _)
