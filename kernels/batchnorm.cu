// BatchNormalization and its gradient (engine/src/ops/batchnorm.rs; CPU kernels
// engine/src/backend/cpu/batchnorm.rs) over x [N, C, plane...]: per-channel statistics in f64
// (as the CPU kernels), then element-wise passes. Channel k of sample s is the contiguous run
// x[(s·C + k)·plane ...].
//
//   batch_norm_stats_T(const T* x, const T* mean_in, const T* var_in, f64* stats, i64 n, i64 c, i64 plane, i32 training)
//       stats[2k] = mean, stats[2k+1] = biased variance of channel k: from x in training mode
//       (one block per channel, two passes), else the running mean and variance
//   batch_norm_apply_T(const T* x, const T* scale, const T* bias, const T* mean_in, const T* var_in,
//                      const f64* stats, T* y, T* mean_out, T* var_out, i64 total, i64 c, i64 plane,
//                      f64 eps, f64 momentum, f64 var_factor)
//       y = (x − mean)·scale/√(var + ε) + bias (a grid-stride loop over max(total, c)); the
//       threads k < c also write the running
//       statistics when mean_out / var_out are not null: in·momentum + batch·(1 − momentum),
//       the batch variance times var_factor (n/(n−1): PyTorch's unbiased running variance)
//   batch_norm_grad_sums_T(const T* dy, const T* x, const f64* stats, f64* sums, i64 n, i64 c, i64 plane, f64 eps)
//       sums[2k] = Σ dy, sums[2k+1] = Σ dy·x̂ over channel k (one block per channel)
//   batch_norm_grad_T(const T* dy, const T* x, const T* scale, const f64* stats, const f64* sums,
//                     T* dx, T* dscale, T* dbias, i64 total, i64 c, i64 plane, f64 eps, i32 training)
//       dx = scale·rstd·(dy − Σdy/count − x̂·Σdy·x̂/count) in training mode, scale·rstd·dy
//       otherwise; the threads k < c write dscale = Σdy·x̂ and dbias = Σdy
// T: f32 f64 bf16 f16.

#include "prelude.cuh"

// Σ f(v) over channel k's elements, for the whole block.
template <typename T, typename F>
__device__ __forceinline__ f64 channel_sum(const T* x, i64 n, i64 c, i64 plane, i64 k, f64* scratch, F f) {
    f64 s = 0;
    const i64 count = n * plane;
    for (i64 i = threadIdx.x; i < count; i += blockDim.x) {
        const i64 at = ((i / plane) * c + k) * plane + i % plane;
        s += f(at);
    }
    return block_reduce<OpSum>(s, scratch);
}

template <typename T>
__device__ __forceinline__ void bn_stats(const T* x, const T* mean_in, const T* var_in, f64* stats, i64 n, i64 c, i64 plane, bool training) {
    ORT_SHARED(f64, scratch, [32]);
    if (!training) {
        ORT_GRID_LOOP(k, c) {
            stats[2 * k] = (f64)Num<T>::load(mean_in[k]);
            stats[2 * k + 1] = (f64)Num<T>::load(var_in[k]);
        }
        return;
    }
    const f64 count = (f64)(n * plane > 0 ? n * plane : 1);
    for (i64 k = blockIdx.x; k < c; k += gridDim.x) {
        const f64 mean = channel_sum(x, n, c, plane, k, scratch, [&](i64 at) { return (f64)Num<T>::load(x[at]); }) / count;
        const f64 q = channel_sum(x, n, c, plane, k, scratch, [&](i64 at) {
            const f64 d = (f64)Num<T>::load(x[at]) - mean;
            return d * d;
        });
        if (threadIdx.x == 0) {
            stats[2 * k] = mean;
            stats[2 * k + 1] = q / count;
        }
    }
}

template <typename T>
__device__ __forceinline__ void bn_apply(const T* x, const T* scale, const T* bias, const T* mean_in, const T* var_in, const f64* stats,
                                         T* y, T* mean_out, T* var_out, i64 total, i64 c, i64 plane, f64 eps, f64 momentum,
                                         f64 var_factor) {
    ORT_GRID_LOOP(e, total > c ? total : c) {
        if (e < total) {
            const i64 k = (e / plane) % c;
            const f64 a = (f64)Num<T>::load(scale[k]) * rsqrt(stats[2 * k + 1] + eps);
            y[e] = Num<T>::store((typename Num<T>::Acc)(((f64)Num<T>::load(x[e]) - stats[2 * k]) * a + (f64)Num<T>::load(bias[k])));
        }
        if (e < c) {
            if (mean_out) mean_out[e] = Num<T>::store((typename Num<T>::Acc)((f64)Num<T>::load(mean_in[e]) * momentum + stats[2 * e] * (1 - momentum)));
            if (var_out)
                var_out[e] = Num<T>::store(
                    (typename Num<T>::Acc)((f64)Num<T>::load(var_in[e]) * momentum + stats[2 * e + 1] * var_factor * (1 - momentum)));
        }
    }
}

template <typename T>
__device__ __forceinline__ void bn_grad_sums(const T* dy, const T* x, const f64* stats, f64* sums, i64 n, i64 c, i64 plane, f64 eps) {
    ORT_SHARED(f64, scratch, [32]);
    for (i64 k = blockIdx.x; k < c; k += gridDim.x) {
        const f64 mean = stats[2 * k], rstd = rsqrt(stats[2 * k + 1] + eps);
        const f64 sd = channel_sum(dy, n, c, plane, k, scratch, [&](i64 at) { return (f64)Num<T>::load(dy[at]); });
        const f64 sdh = channel_sum(dy, n, c, plane, k, scratch, [&](i64 at) {
            return (f64)Num<T>::load(dy[at]) * ((f64)Num<T>::load(x[at]) - mean) * rstd;
        });
        if (threadIdx.x == 0) {
            sums[2 * k] = sd;
            sums[2 * k + 1] = sdh;
        }
    }
}

template <typename T>
__device__ __forceinline__ void bn_grad(const T* dy, const T* x, const T* scale, const f64* stats, const f64* sums, T* dx, T* dscale,
                                        T* dbias, i64 total, i64 c, i64 plane, f64 eps, bool training) {
    typedef typename Num<T>::Acc A;
    const i64 per_channel = c > 0 ? total / c : 0;
    const f64 count = (f64)(per_channel > 0 ? per_channel : 1);
    ORT_GRID_LOOP(e, total > c ? total : c) {
        if (e < total) {
            const i64 k = (e / plane) % c;
            const f64 mean = stats[2 * k], rstd = rsqrt(stats[2 * k + 1] + eps);
            const f64 g = (f64)Num<T>::load(scale[k]) * rstd, d = (f64)Num<T>::load(dy[e]);
            f64 v = g * d;
            if (training) {
                const f64 h = ((f64)Num<T>::load(x[e]) - mean) * rstd;
                v = g * (d - sums[2 * k] / count - h * sums[2 * k + 1] / count);
            }
            dx[e] = Num<T>::store((A)v);
        }
        if (e < c) {
            dscale[e] = Num<T>::store((A)sums[2 * e + 1]);
            dbias[e] = Num<T>::store((A)sums[2 * e]);
        }
    }
}

#define BATCH_NORM(op, T)                                                                     \
    extern "C" __global__ void batch_norm_stats_##T(const T* x, const T* mean_in, const T* var_in, f64* stats, i64 n, i64 c, i64 plane, \
                                                    i32 training) {                           \
        bn_stats<T>(x, mean_in, var_in, stats, n, c, plane, training != 0);                   \
    }                                                                                         \
    extern "C" __global__ void batch_norm_apply_##T(const T* x, const T* scale, const T* bias, const T* mean_in, const T* var_in, \
                                                    const f64* stats, T* y, T* mean_out, T* var_out, i64 total, i64 c, i64 plane, \
                                                    f64 eps, f64 momentum, f64 var_factor) {  \
        bn_apply<T>(x, scale, bias, mean_in, var_in, stats, y, mean_out, var_out, total, c, plane, eps, momentum, var_factor); \
    }                                                                                         \
    extern "C" __global__ void batch_norm_grad_sums_##T(const T* dy, const T* x, const f64* stats, f64* sums, i64 n, i64 c, i64 plane, \
                                                        f64 eps) {                            \
        bn_grad_sums<T>(dy, x, stats, sums, n, c, plane, eps);                                \
    }                                                                                         \
    extern "C" __global__ void batch_norm_grad_##T(const T* dy, const T* x, const T* scale, const f64* stats, const f64* sums, T* dx, \
                                                   T* dscale, T* dbias, i64 total, i64 c, i64 plane, f64 eps, i32 training) { \
        bn_grad<T>(dy, x, scale, stats, sums, dx, dscale, dbias, total, c, plane, eps, training != 0); \
    }
ORT_FLOATS(BATCH_NORM, _)
