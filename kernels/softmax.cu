// Softmax and LogSoftmax over one axis, forward and backward (engine/src/ops/softmax.rs, CPU
// kernels in engine/src/backend/cpu/softmax.rs). The tensor is viewed as [outer, n, inner]
// (ops::softmax_layout_of); a "row" is one (outer, inner) position and its n values lie
// `inner` elements apart. One block per row (grid-stride over rows), blockDim.x a multiple of
// 32 (at most 1024); reductions in f32 (f64 for f64) with warp shuffles.
//
//   softmax_T / log_softmax_T(const T* x, T* y, i64 rows, i64 n, i64 inner)       rows = outer * inner
//   softmax_grad_T(const T* dy, const T* y, T* dx, i64 rows, i64 n, i64 inner)    dx = y (dy - sum(dy y))
//   log_softmax_grad_T(const T* dy, const T* y, T* dx, i64 rows, i64 n, i64 inner) dx = dy - exp(y) sum(dy)
// T: f32 f64 bf16 f16. y may alias x (forward) and dx may alias dy (backward): every element is
// read before the row's writes (barriers between the passes).

#include "prelude.cuh"

__device__ __forceinline__ i64 row_base(i64 row, i64 n, i64 inner) {
    return inner == 1 ? row * n : (row / inner) * n * inner + row % inner;
}

template <typename T, bool LOG> __device__ __forceinline__ void softmax_fwd(const T* x, T* y, i64 rows, i64 n, i64 inner) {
    typedef typename Num<T>::Acc A;
    ORT_SHARED(A, scratch, [32]);
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const i64 base = row_base(row, n, inner);
        A m = OpMax::init<A>();
        for (i64 k = threadIdx.x; k < n; k += blockDim.x) m = OpMax::apply(m, Num<T>::load(x[base + k * inner]));
        m = block_reduce<OpMax>(m, scratch);
        A s = (A)0;
        for (i64 k = threadIdx.x; k < n; k += blockDim.x) s += m_exp(Num<T>::load(x[base + k * inner]) - m);
        s = block_reduce<OpSum>(s, scratch);
        if (LOG) {
            const A lse = m + m_log(s);
            for (i64 k = threadIdx.x; k < n; k += blockDim.x) {
                const i64 at = base + k * inner;
                y[at] = Num<T>::store(Num<T>::load(x[at]) - lse);
            }
        } else {
            const A inv = (A)1 / s;
            for (i64 k = threadIdx.x; k < n; k += blockDim.x) {
                const i64 at = base + k * inner;
                y[at] = Num<T>::store(m_exp(Num<T>::load(x[at]) - m) * inv);
            }
        }
        __syncthreads();  // the next row's first reduction reuses scratch
    }
}

template <typename T, bool LOG> __device__ __forceinline__ void softmax_bwd(const T* dy, const T* y, T* dx, i64 rows, i64 n, i64 inner) {
    typedef typename Num<T>::Acc A;
    ORT_SHARED(A, scratch, [32]);
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const i64 base = row_base(row, n, inner);
        A s = (A)0;
        for (i64 k = threadIdx.x; k < n; k += blockDim.x) {
            const i64 at = base + k * inner;
            s += LOG ? Num<T>::load(dy[at]) : Num<T>::load(dy[at]) * Num<T>::load(y[at]);
        }
        s = block_reduce<OpSum>(s, scratch);
        for (i64 k = threadIdx.x; k < n; k += blockDim.x) {
            const i64 at = base + k * inner;
            const A d = Num<T>::load(dy[at]), v = Num<T>::load(y[at]);
            dx[at] = Num<T>::store(LOG ? d - m_exp(v) * s : v * (d - s));
        }
        __syncthreads();
    }
}

#define SOFTMAX(op, T)                                                                        \
    extern "C" __global__ void softmax_##T(const T* x, T* y, i64 rows, i64 n, i64 inner) {    \
        softmax_fwd<T, false>(x, y, rows, n, inner);                                          \
    }                                                                                         \
    extern "C" __global__ void log_softmax_##T(const T* x, T* y, i64 rows, i64 n, i64 inner) { \
        softmax_fwd<T, true>(x, y, rows, n, inner);                                           \
    }                                                                                         \
    extern "C" __global__ void softmax_grad_##T(const T* dy, const T* y, T* dx, i64 rows, i64 n, i64 inner) { \
        softmax_bwd<T, false>(dy, y, dx, rows, n, inner);                                     \
    }                                                                                         \
    extern "C" __global__ void log_softmax_grad_##T(const T* dy, const T* y, T* dx, i64 rows, i64 n, i64 inner) { \
        softmax_bwd<T, true>(dy, y, dx, rows, n, inner);                                      \
    }
ORT_FLOATS(SOFTMAX, _)
