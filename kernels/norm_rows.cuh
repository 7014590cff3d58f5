#pragma once
// The row-normalisation templates layernorm.cu and rmsnorm.cu instantiate: a forward over rows
// of n (saving per-row statistics), a backward giving dx and, without atomics, per-block
// partial sums of the parameter gradients, and the reduction of those partials. `RMS` = true
// is the RMS normalisation (ops/rms_norm.rs): the mean is 0 (never computed nor read), the
// "rstd" is 1/sqrt(mean(x²) + eps), dx = rstd (g - h mean(g h)) without the mean(g) term, the
// partials hold dy h alone (parts = 1), and the scale may be null (1). The launch shapes, the
// partials' layout and the dx formula are layernorm.cu's, documented at its top.

#include "prelude.cuh"

// Mean and 1/sqrt(var + eps) of one row, on every thread of the block (RMS: mean 0, so
// 1/sqrt(mean(x²) + eps)).
template <typename T, typename A, bool RMS>
__device__ __forceinline__ void row_stats(const T* xr, i64 n, A eps, A* scratch, A& mean, A& rstd) {
    mean = (A)0;
    if (!RMS) {
        A s = (A)0;
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) s += Num<T>::load(xr[j]);
        mean = block_reduce<OpSum>(s, scratch) / (A)n;
    }
    A q = (A)0;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
        const A d = Num<T>::load(xr[j]) - mean;
        q += d * d;
    }
    const A var = block_reduce<OpSum>(q, scratch) / (A)n;
    rstd = (A)1 / m_sqrt(var + eps);
}

#define LN_WARP_MAX 1024                 // norm.rs WARP_ROW_MAX
#define LN_PER_LANE (LN_WARP_MAX / 32)  // elements of a row per lane: j = lane + 32 k

// Where a warp-per-row launch puts this warp: its first row, the row stride, its lane.
struct LnWarp {
    i64 first, stride;
    int lane;
};
// scale[j], or 1 without a scale (an RMSNorm without weight).
template <typename T> __device__ __forceinline__ typename Num<T>::Acc scale_at(const T* scale, i64 j) {
    return scale ? Num<T>::load(scale[j]) : (typename Num<T>::Acc)1;
}

__device__ __forceinline__ LnWarp ln_warp() {
    const int warps = blockDim.x >> 5;
    return LnWarp{(i64)blockIdx.x * warps + (threadIdx.x >> 5), (i64)gridDim.x * warps, (int)(threadIdx.x & 31)};
}

// The forward of a row of n <= LN_WARP_MAX by one warp: the same two-pass statistics as
// row_stats, from registers.
template <typename T, typename Y, bool RMS>
__device__ __forceinline__ void ln_fwd_warp(const T* x, const T* scale, const T* bias, Y* y, typename Num<T>::Acc* mean_out,
                                            typename Num<T>::Acc* rstd_out, i64 rows, i64 n, f32 eps) {
    typedef typename Num<T>::Acc A;
    const LnWarp w = ln_warp();
    for (i64 r = w.first; r < rows; r += w.stride) {
        const T* xr = x + r * n;
        A v[LN_PER_LANE];
        A s = (A)0;
#pragma unroll
        for (int k = 0; k < LN_PER_LANE; ++k) {
            const i64 j = w.lane + 32 * k;
            v[k] = j < n ? Num<T>::load(xr[j]) : (A)0;
            s += v[k];
        }
        const A mean = RMS ? (A)0 : warp_reduce<OpSum>(s) / (A)n;
        A q = (A)0;
#pragma unroll
        for (int k = 0; k < LN_PER_LANE; ++k) {
            const A d = v[k] - mean;
            if (w.lane + 32 * k < n) q += d * d;
        }
        const A rstd = (A)1 / m_sqrt(warp_reduce<OpSum>(q) / (A)n + (A)eps);
        if (w.lane == 0) {
            if (mean_out) mean_out[r] = mean;
            if (rstd_out) rstd_out[r] = rstd;
        }
        if (!y) continue;
#pragma unroll
        for (int k = 0; k < LN_PER_LANE; ++k) {
            const i64 j = w.lane + 32 * k;
            if (j >= n) break;
            A o = (v[k] - mean) * rstd * scale_at(scale, j);
            if (bias) o += Num<T>::load(bias[j]);
            y[r * n + j] = Num<Y>::store(o);
        }
    }
}

template <typename T, typename Y = T, bool RMS = false> __device__ __forceinline__ void ln_fwd(const T* x, const T* scale, const T* bias, Y* y,
                                                             typename Num<T>::Acc* mean_out, typename Num<T>::Acc* rstd_out,
                                                             i64 rows, i64 n, f32 eps) {
    typedef typename Num<T>::Acc A;
    if (n <= LN_WARP_MAX) {
        ln_fwd_warp<T, Y, RMS>(x, scale, bias, y, mean_out, rstd_out, rows, n, eps);
        return;
    }
    ORT_SHARED(A, scratch, [32]);
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * n;
        A mean, rstd;
        row_stats<T, A, RMS>(xr, n, (A)eps, scratch, mean, rstd);
        if (threadIdx.x == 0) {
            if (mean_out) mean_out[r] = mean;
            if (rstd_out) rstd_out[r] = rstd;
        }
        if (y) {
            for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
                A v = (Num<T>::load(xr[j]) - mean) * rstd * scale_at(scale, j);
                if (bias) v += Num<T>::load(bias[j]);
                y[r * n + j] = Num<Y>::store(v);
            }
        }
    }
}

// a + b rounded once, never fused with a product into an FMA (the Add kernel's sum of two
// stored values)
__device__ __forceinline__ f32 add_unfused(f32 a, f32 b) { return __fadd_rn(a, b); }
__device__ __forceinline__ f64 add_unfused(f64 a, f64 b) { return __dadd_rn(a, b); }
template <typename T> __device__ __forceinline__ T add_unfused(T a, T b) { return Num<T>::store(Num<T>::load(a) + Num<T>::load(b)); }

// The parameter gradients from the dx kernel's per-block partials (see the top of the file).
template <typename T>
__device__ __forceinline__ void ln_params_reduce(const typename Num<T>::Acc* partial, T* dscale, T* dbias, T* dsum, i64 parts,
                                                 i64 chunks, i64 n) {
    typedef typename Num<T>::Acc A;
    ORT_SHARED(A, red, [3][32][33]);
    T* const outs[3] = {dscale, dbias, parts > 2 ? dsum : nullptr};
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5, lanes = blockDim.x >> 5;
    const i64 groups = (n + 31) / 32;
    for (i64 group = blockIdx.x; group < groups; group += gridDim.x) {
        const i64 j = group * 32 + tx;
        A s[3] = {(A)0, (A)0, (A)0};
        if (j < n) {
            for (i64 c = ty; c < chunks; c += lanes) {
#pragma unroll
                for (int p = 0; p < 3; ++p)
                    if (p < parts) s[p] += partial[(c * parts + p) * n + j];
            }
        }
#pragma unroll
        for (int p = 0; p < 3; ++p) red[p][ty][tx] = s[p];
        __syncthreads();  // every chunk lane's sums written
        if (ty == 0 && j < n) {
#pragma unroll
            for (int p = 0; p < 3; ++p) {
                for (int k = 1; k < lanes; ++k) s[p] += red[p][k][tx];
                if (outs[p]) outs[p][j] = Num<T>::store(s[p]);
            }
        }
        __syncthreads();  // red read before the next group writes it
    }
}

// ln_grad for a row of n <= LN_WARP_MAX by one warp: g = dy scale and h in registers, the two
// sums by warp shuffles. With `sums` (this warp's slice [parts][n] of shared memory, or null) a
// lane adds dy h, dy and (parts = 3) the stored dx of its columns to it, row by row (RMS: dy h
// alone, parts = 1).
template <typename T, typename D, typename H, bool RMS>
__device__ __forceinline__ void ln_grad_warp(const D* dy, const T* x, const T* scale, const typename Num<T>::Acc* mean,
                                             const typename Num<T>::Acc* rstd, T* dx, i64 rows, i64 n, const T* dres, H* dxh,
                                             typename Num<T>::Acc* sums, i64 parts) {
    typedef typename Num<T>::Acc A;
    const LnWarp w = ln_warp();
    if (sums) {
        // each lane clears the columns it will add to: no other lane touches them
#pragma unroll
        for (int k = 0; k < LN_PER_LANE; ++k) {
            const i64 j = w.lane + 32 * k;
            if (j >= n) break;
            for (int p = 0; p < parts; ++p) sums[p * n + j] = (A)0;
        }
    }
    const bool dx_sums = sums && parts > 2;
    for (i64 r = w.first; r < rows; r += w.stride) {
        const D* dr = dy + r * n;
        const T* xr = x + r * n;
        const A mu = RMS ? (A)0 : mean[r], rs = rstd[r];
        A gv[LN_PER_LANE], hv[LN_PER_LANE];
        A a = (A)0, b = (A)0;
#pragma unroll
        for (int k = 0; k < LN_PER_LANE; ++k) {
            const i64 j = w.lane + 32 * k;
            const bool in = j < n;
            const A d = in ? Num<D>::load(dr[j]) : (A)0;
            gv[k] = d * (in ? scale_at(scale, j) : (A)0);
            hv[k] = in ? (Num<T>::load(xr[j]) - mu) * rs : (A)0;
            a += gv[k];
            b += gv[k] * hv[k];
            if (sums && in) {
                sums[j] += d * hv[k];
                if (!RMS) sums[n + j] += d;
            }
        }
        a = RMS ? (A)0 : warp_reduce<OpSum>(a) / (A)n;
        b = warp_reduce<OpSum>(b) / (A)n;
#pragma unroll
        for (int k = 0; k < LN_PER_LANE; ++k) {
            const i64 j = w.lane + 32 * k;
            if (j >= n) break;
            T d = Num<T>::store(rs * (gv[k] - a - hv[k] * b));
            if (dres) d = add_unfused(d, dres[r * n + j]);
            dx[r * n + j] = d;
            if (dxh) dxh[r * n + j] = Num<H>::store(Num<T>::load(d));
            if (dx_sums) sums[2 * n + j] += Num<T>::load(d);
        }
    }
}

// dres (the residual stream's gradient, added to dx) and dxh (a 16-bit copy of the result) may be
// null; only the accumulating kernels pass them (T = f32). partial: see the top of the file.
template <typename T, typename D = T, typename H = T, bool RMS = false>
__device__ __forceinline__ void ln_grad(const D* dy, const T* x, const T* scale, const typename Num<T>::Acc* mean,
                                        const typename Num<T>::Acc* rstd, T* dx, typename Num<T>::Acc* partial, i64 parts,
                                        i64 rows, i64 n, const T* dres = nullptr, H* dxh = nullptr) {
    typedef typename Num<T>::Acc A;
    if (n <= LN_WARP_MAX) {
        ORT_DYNAMIC_SHARED(unsigned char, ln_smem);
        A* slices = reinterpret_cast<A*>(ln_smem);
        A* mine = partial ? slices + (threadIdx.x >> 5) * parts * n : nullptr;
        ln_grad_warp<T, D, H, RMS>(dy, x, scale, mean, rstd, dx, rows, n, dres, dxh, mine, parts);
        if (!partial) return;
        __syncthreads();  // every warp's slice summed
        const int warps = blockDim.x >> 5;
        for (i64 c = threadIdx.x; c < parts * n; c += blockDim.x) {
            A s = (A)0;
            for (int v = 0; v < warps; ++v) s += slices[v * parts * n + c];
            partial[blockIdx.x * parts * n + c] = s;
        }
        return;
    }
    ORT_SHARED(A, scratch, [32]);
    // this block's sums; thread t owns columns t + blockDim.x k in both passes over a row
    A* sums = partial ? partial + blockIdx.x * parts * n : nullptr;
    if (sums) {
        for (i64 j = threadIdx.x; j < n; j += blockDim.x)
            for (int p = 0; p < parts; ++p) sums[p * n + j] = (A)0;
    }
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const D* dr = dy + r * n;
        const T* xr = x + r * n;
        const A mu = RMS ? (A)0 : mean[r], rs = rstd[r];
        A a = (A)0, b = (A)0;
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
            const A g = Num<D>::load(dr[j]) * scale_at(scale, j);
            a += g;
            b += g * (Num<T>::load(xr[j]) - mu) * rs;
        }
        a = RMS ? (A)0 : block_reduce<OpSum>(a, scratch) / (A)n;
        b = block_reduce<OpSum>(b, scratch) / (A)n;
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
            const A d = Num<D>::load(dr[j]);
            const A g = d * scale_at(scale, j);
            const A h = (Num<T>::load(xr[j]) - mu) * rs;
            T e = Num<T>::store(rs * (g - a - h * b));
            // the sum the separate Add kernel computes: rounded dx plus dres, never an FMA with
            // the product above
            if (dres) e = add_unfused(e, dres[r * n + j]);
            dx[r * n + j] = e;
            if (dxh) dxh[r * n + j] = Num<H>::store(Num<T>::load(e));
            if (sums) {
                sums[j] += d * h;
                if (!RMS) sums[n + j] += d;
                if (parts > 2) sums[2 * n + j] += Num<T>::load(e);
            }
        }
    }
}
