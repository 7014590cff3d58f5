// CumSum (engine/src/ops/cumsum.rs; CPU kernel engine/src/backend/cpu/cumsum.rs) over one axis
// of x viewed as [outer, len, inner]:
//
//   cumsum_T(const T* x, T* y, i64 outer, i64 len, i64 inner, i32 exclusive, i32 reverse)
//       one thread per (outer, inner) column, scanning its `len` elements (reads coalesced
//       across the inner index); exclusive: each output leaves its own element out; reverse:
//       scans from the end. Sums in the compute type (exact for integers).
// T: f32 f64 bf16 f16 i64 i32.

#include "prelude.cuh"

template <typename T> __device__ __forceinline__ void cumsum(const T* x, T* y, i64 outer, i64 len, i64 inner, bool exclusive, bool reverse) {
    typedef typename Num<T>::Acc A;
    ORT_GRID_LOOP(col, outer * inner) {
        const i64 o = col / inner, j = col - o * inner;
        const i64 base = o * len * inner + j;
        A acc = 0;
        for (i64 s = 0; s < len; ++s) {
            const i64 at = base + (reverse ? len - 1 - s : s) * inner;
            const A v = Num<T>::load(x[at]);
            if (exclusive) {
                y[at] = Num<T>::store(acc);
                acc += v;
            } else {
                acc += v;
                y[at] = Num<T>::store(acc);
            }
        }
    }
}

#define CUMSUM(op, T)                                                                         \
    extern "C" __global__ void cumsum_##T(const T* x, T* y, i64 outer, i64 len, i64 inner, i32 exclusive, i32 reverse) { \
        cumsum<T>(x, y, outer, len, inner, exclusive != 0, reverse != 0);                     \
    }
ORT_ARITH(CUMSUM, _)
