// LayerNormalization forward (saving the row mean and 1/std for the backward) and its backward
// (engine/src/ops/norm.rs; CPU kernels engine/src/backend/cpu/norm.rs, which accumulate the
// row statistics in f64: here f32, f64 for f64, with a two-pass variance). The input is
// [rows, n], normalised over n. Mean and rstd are `A` = f32 (f64 for f64), as the CPU's
// optional Mean / InvStdDev outputs.
//
// Rows of n <= LN_WARP_MAX (1024) go one warp per row, the row in registers and its sums by warp
// shuffles (no block barrier; all of a lane's loads in flight at once; norm.rs launches 8 rows
// to a block of 256 threads, grid-stride over the row groups, or for the dx kernel summing the
// parameter gradients 4 rows to a block of 128); longer rows one block per row
// (grid-stride over rows; blockDim.x a multiple of 32, at most 256: the registers of the warp
// path leave no more). The kernels below take either launch and pick by n:
//   layer_norm_T(const T* x, const T* scale, const T* bias, T* y, A* mean, A* rstd,
//                i64 rows, i64 n, f32 eps)                 bias, mean, rstd may be null
//   layer_norm_stats_T(const T* x, A* mean, A* rstd, i64 rows, i64 n, f32 eps)
//                                                          (the backward's input when the
//                                                          forward's statistics were not kept)
//   layer_norm_grad_T(const T* dy, const T* x, const T* scale, const A* mean, const A* rstd,
//                     T* dx, A* partial, i64 parts, i64 rows, i64 n)
//                                                          dx = rstd (g - mean(g) - h mean(g h)),
//                                                          g = dy scale, h = (x - mean) rstd
// dscale = sum over rows of dy h and dbias = sum of dy, without atomics (deterministic), summed
// by the dx kernel from the dy and x it has loaded (one read of each, as llm.c's
// layernorm_backward): with `partial` non-null, block b writes partial[b][parts][n], the sums
// over the rows it handled (zeros where none) of dy h, dy and, with parts = 3, of dx as stored
// (the column sums of dx: a following Linear's bias gradient, passes/layer_norm_grad_col_sum.rs);
// parts is 2 or 3. Rows of n <= LN_WARP_MAX: each warp sums its rows' columns into its slice
// [parts][n] of the block's dynamic shared memory (blockDim.x / 32 * parts * n A values: the
// launch's `shared`), a lane the columns it owns; then the block adds the slices in warp order.
// Longer rows: a thread owns columns tid + blockDim.x k of every row and sums them in its
// block's partial row in global memory (no shared memory). With partial null the launch needs
// no shared memory and parts is not read.
//   layer_norm_grad_params_reduce_T(const A* partial, T* dscale, T* dbias, T* dsum, i64 parts,
//                                   i64 chunks, i64 n)
//       dscale[j] = sum over c < chunks of partial[c][0][j], dbias of partial[c][1][j], dsum
//       (parts = 3) of partial[c][2][j]; blockDim.x = 32 k (k <= 32 chunk lanes: lane tx a
//       column, lane ty the chunks ty, ty + k, ...; the k lanes' sums then added in order),
//       block b the columns [32 b, +32) (grid-stride over the ceil(n / 32) groups); dscale,
//       dbias or dsum may be null
// T: f32 f64 bf16 f16.
// Mixed precision (passes/layer_norm_half.rs), x f32 and y / dy 16-bit (H: bf16 f16), the same
// arithmetic (the f32 y rounded once on store; dy widened exactly on load):
//   layer_norm_f32_y_H(const f32* x, const f32* scale, const f32* bias, H* y, f32* mean, f32* rstd,
//                      i64 rows, i64 n, f32 eps)
//   layer_norm_grad_f32_dy_H(const H* dy, ...)             as layer_norm_grad_f32
// The residual stream's gradient summed in (passes/layer_norm_grad_sum.rs), dy D: f32 bf16 f16:
//   layer_norm_grad_acc_f32_dy_D_H(const D* dy, const f32* x, const f32* scale, const f32* mean,
//                                  const f32* rstd, const f32* dres, f32* dx, H* dxh, f32* partial,
//                                  i64 parts, i64 rows, i64 n)
//       dx = layer_norm_grad_f32's dx + dres (one f32 add, as the Add kernel), dxh = dx rounded
//       to H (as the cast kernel), partial as layer_norm_grad_f32's; dres, dxh and partial may be
//       null

#include "prelude.cuh"
#include "norm_rows.cuh"

#define LAYER_NORM(op, T)                                                                     \
    extern "C" __global__ void layer_norm_##T(const T* x, const T* scale, const T* bias, T* y, \
                                              Num<T>::Acc* mean, Num<T>::Acc* rstd, i64 rows, i64 n, f32 eps) { \
        ln_fwd<T>(x, scale, bias, y, mean, rstd, rows, n, eps);                               \
    }                                                                                         \
    extern "C" __global__ void layer_norm_stats_##T(const T* x, Num<T>::Acc* mean, Num<T>::Acc* rstd, i64 rows, i64 n, f32 eps) { \
        ln_fwd<T, T>(x, nullptr, nullptr, nullptr, mean, rstd, rows, n, eps);                 \
    }                                                                                         \
    extern "C" __global__ void layer_norm_grad_##T(const T* dy, const T* x, const T* scale, const Num<T>::Acc* mean, \
                                                   const Num<T>::Acc* rstd, T* dx, Num<T>::Acc* partial, i64 parts, \
                                                   i64 rows, i64 n) {                         \
        ln_grad<T>(dy, x, scale, mean, rstd, dx, partial, parts, rows, n);                    \
    }                                                                                         \
    extern "C" __global__ void layer_norm_grad_params_reduce_##T(const Num<T>::Acc* partial, T* dscale, T* dbias, \
                                                                 T* dsum, i64 parts, i64 chunks, i64 n) { \
        ln_params_reduce<T>(partial, dscale, dbias, dsum, parts, chunks, n);                  \
    }
ORT_FLOATS(LAYER_NORM, _)

#define LAYER_NORM_HALF_IO(H)                                                                  \
    extern "C" __global__ void layer_norm_f32_y_##H(const f32* x, const f32* scale, const f32* bias, H* y, f32* mean, \
                                                    f32* rstd, i64 rows, i64 n, f32 eps) {          \
        ln_fwd<f32, H>(x, scale, bias, y, mean, rstd, rows, n, eps);                              \
    }                                                                                              \
    extern "C" __global__ void layer_norm_grad_f32_dy_##H(const H* dy, const f32* x, const f32* scale, const f32* mean, \
                                                          const f32* rstd, f32* dx, f32* partial, i64 parts, i64 rows, \
                                                          i64 n) {                                 \
        ln_grad<f32, H>(dy, x, scale, mean, rstd, dx, partial, parts, rows, n);                   \
    }
LAYER_NORM_HALF_IO(bf16)
LAYER_NORM_HALF_IO(f16)

// LayerNormGrad summing the residual stream's gradient and rounding a 16-bit copy
// (passes/layer_norm_grad_sum.rs): dy D (f32, bf16, f16), dxh H (bf16, f16).
#define LAYER_NORM_GRAD_ACC(D, H)                                                                 \
    extern "C" __global__ void layer_norm_grad_acc_f32_dy_##D##_##H(const D* dy, const f32* x, const f32* scale, \
                                                                   const f32* mean, const f32* rstd, const f32* dres, \
                                                                   f32* dx, H* dxh, f32* partial, i64 parts, i64 rows, \
                                                                   i64 n) {                       \
        ln_grad<f32, D, H>(dy, x, scale, mean, rstd, dx, partial, parts, rows, n, dres, dxh);       \
    }
LAYER_NORM_GRAD_ACC(f32, bf16)
LAYER_NORM_GRAD_ACC(f32, f16)
LAYER_NORM_GRAD_ACC(bf16, bf16)
LAYER_NORM_GRAD_ACC(bf16, f16)
LAYER_NORM_GRAD_ACC(f16, bf16)
LAYER_NORM_GRAD_ACC(f16, f16)
