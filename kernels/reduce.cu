// Reductions over any set of axes (engine/src/ops/reduce.rs: ReduceSum/Mean/Max/Min, the
// internal ReduceSumTo that sums a broadcast gradient back to an input's shape, and ReduceGrad;
// CPU kernels engine/src/backend/cpu/reduce.rs, internal.rs).
//
// The host splits the input's dimensions into kept ones (the output, contiguous) and reduced
// ones, each with its input strides (`Reduce`); ReduceSumTo is a sum whose reduced dimensions
// are the broadcast ones. Mean is a sum times `scale` = 1/count (1 for the others).
//
//   reduce_<op>_T(const T* x, T* y, Reduce l, f64 scale)         op: sum max min
//       one block per output (grid-stride), blockDim.x a multiple of 32: for reduced dimensions
//       that include the innermost input dimension (reads are contiguous across the block)
//   reduce_<op>_thread_T(const T* x, T* y, Reduce l, f64 scale)
//       one thread per output: for a kept innermost dimension (reads are contiguous across a
//       warp), e.g. a bias gradient summed over rows
//   reduce_grad_T(const T* dy, T* dx, Strides s, i64 n, f64 scale)  dx = dy broadcast * scale
// T: f32 f64 bf16 f16 (accumulated in f32, f64 for f64); sum also i64. Max/Min propagate NaN.

#include "prelude.cuh"

struct Reduce {
    i32 out_rank, red_rank;
    i64 out_dims[ORT_MAX_DIMS], out_stride[ORT_MAX_DIMS];  // input strides of the kept dims
    i64 red_dims[ORT_MAX_DIMS], red_stride[ORT_MAX_DIMS];  // and of the reduced dims
    i64 outputs, count;                                    // products of out_dims, red_dims
};

__device__ __forceinline__ i64 dims_offset(i64 i, int rank, const i64* dims, const i64* stride) {
    i64 off = 0;
#pragma unroll 1
    for (int d = rank - 1; d >= 0; --d) {
        const i64 q = i / dims[d];
        off += (i - q * dims[d]) * stride[d];
        i = q;
    }
    return off;
}

// Offset of reduced element r: with one reduced dimension (a column or row sum) a multiply,
// without a 64-bit division per element.
__device__ __forceinline__ i64 red_offset(const Reduce& l, i64 r) {
    return l.red_rank == 1 ? r * l.red_stride[0] : dims_offset(r, l.red_rank, l.red_dims, l.red_stride);
}

template <typename T, typename Op> __device__ __forceinline__ void reduce_block(const T* x, T* y, const Reduce& l, f64 scale) {
    typedef typename Num<T>::Acc A;
    ORT_SHARED(A, scratch, [32]);
    for (i64 o = blockIdx.x; o < l.outputs; o += gridDim.x) {
        const i64 base = dims_offset(o, l.out_rank, l.out_dims, l.out_stride);
        A acc = Op::template init<A>();
        for (i64 r = threadIdx.x; r < l.count; r += blockDim.x)
            acc = Op::apply(acc, Num<T>::load(x[base + red_offset(l, r)]));
        acc = block_reduce<Op>(acc, scratch);
        if (threadIdx.x == 0) y[o] = Num<T>::store(scale == 1.0 ? acc : (A)(acc * (A)scale));
    }
}

template <typename T, typename Op> __device__ __forceinline__ void reduce_thread(const T* x, T* y, const Reduce& l, f64 scale) {
    typedef typename Num<T>::Acc A;
    ORT_GRID_LOOP(o, l.outputs) {
        const i64 base = dims_offset(o, l.out_rank, l.out_dims, l.out_stride);
        A acc = Op::template init<A>();
        for (i64 r = 0; r < l.count; ++r)
            acc = Op::apply(acc, Num<T>::load(x[base + red_offset(l, r)]));
        y[o] = Num<T>::store(scale == 1.0 ? acc : (A)(acc * (A)scale));
    }
}

#define REDUCE_SUM(op, T)                                                                     \
    extern "C" __global__ void reduce_sum_##T(const T* x, T* y, Reduce l, f64 scale) { reduce_block<T, OpSum>(x, y, l, scale); } \
    extern "C" __global__ void reduce_sum_thread_##T(const T* x, T* y, Reduce l, f64 scale) { reduce_thread<T, OpSum>(x, y, l, scale); }
#define REDUCE_MAX_MIN(op, T)                                                                 \
    extern "C" __global__ void reduce_max_##T(const T* x, T* y, Reduce l, f64 scale) { reduce_block<T, OpMax>(x, y, l, scale); } \
    extern "C" __global__ void reduce_max_thread_##T(const T* x, T* y, Reduce l, f64 scale) { reduce_thread<T, OpMax>(x, y, l, scale); } \
    extern "C" __global__ void reduce_min_##T(const T* x, T* y, Reduce l, f64 scale) { reduce_block<T, OpMin>(x, y, l, scale); } \
    extern "C" __global__ void reduce_min_thread_##T(const T* x, T* y, Reduce l, f64 scale) { reduce_thread<T, OpMin>(x, y, l, scale); }
ORT_FLOATS(REDUCE_SUM, _)
REDUCE_SUM(_, i64)
ORT_FLOATS(REDUCE_MAX_MIN, _)

#define REDUCE_GRAD(op, T)                                                                    \
    extern "C" __global__ void reduce_grad_##T(const T* dy, T* dx, Strides s, i64 n, f64 scale) { \
        typedef Num<T>::Acc A;                                                                \
        const A k = (A)scale;                                                                 \
        ORT_GRID_LOOP(i, n) {                                                                 \
            i64 o[1];                                                                         \
            strided_offsets<1>(s, i, o);                                                      \
            dx[i] = Num<T>::store(Num<T>::load(dy[o[0]]) * k);                                \
        }                                                                                     \
    }
ORT_FLOATS(REDUCE_GRAD, _)
