// Element-wise ops (engine/src/ops/elementwise.rs and the element-wise internal ops of
// ops/internal.rs), with the semantics of the CPU kernels (engine/src/backend/cpu/elementwise.rs,
// internal.rs).
//
// Kernels (T = element type suffix; n = output elements; all loops grid-stride):
//   unary, contiguous, in-place allowed:       <op>_T(const T* x, T* y, i64 n)
//     floats: sqrt exp log sin cos erf reciprocal floor ceil; numbers: neg abs sign
//   is_nan_T(const T* x, u8* y, i64 n), is_inf_T(x, y, n, i32 detect_pos, i32 detect_neg)
//   not_u8(const u8* x, u8* y, i64 n)
//   cast_S_D(const S* x, D* y, i64 n)     S: the 8 types; D: the 8 types and bool
//   cast_rows_f32_D(const f32* x, D* y, i64 rows, i64 cols, i64 ldx, i64 ldy)   D: bf16, f16
//       rows of x (row stride ldx) rounded into y (row stride ldy >= cols, the rest zeros)
//   binary, broadcast through Strides (operands 0 and 1), output contiguous:
//                                              <op>_T(const T* a, const T* b, T* y, Strides s, i64 n)
//     floats, i64, i32: add sub mul div max min mod fmod; floats and i64: pow
//     compare (floats, i64, i32; equal also u8; output u8): equal less greater less_equal greater_equal
//     logic (u8): and or xor
//   by element width W (u8 u16 u32 u64: the op only moves bits):
//   where_W(const u8* c, const W* a, const W* b, W* y, Strides s, i64 n)         operands c, a, b
//   mask_select_W(const u8* c, const W* x, W* y, Strides s, i64 n, i32 keep)     operands c, x
//   min_max_grad_T(const T* dy, const T* a, const T* b, T* y, Strides s, i64 n, i32 is_max, i32 which)
//   erf_grad_T(const T* dy, const T* x, T* y, Strides s, i64 n)
//   affine_T(const T* x, T* y, i64 n, f64 alpha, f64 beta)                       y = x * alpha + beta
//
// Differences from the CPU kernels (a device kernel cannot return an error): integer division
// by zero gives 0 (the CPU kernel fails); Max/Min take exactly two inputs (as on the CPU).

#include "prelude.cuh"

// ---- unary ---------------------------------------------------------------------------------

struct Op_sqrt { template <typename A> static __device__ A f(A x) { return m_sqrt(x); } };
struct Op_exp { template <typename A> static __device__ A f(A x) { return m_exp(x); } };
struct Op_log { template <typename A> static __device__ A f(A x) { return m_log(x); } };
struct Op_sin { template <typename A> static __device__ A f(A x) { return m_sin(x); } };
struct Op_cos { template <typename A> static __device__ A f(A x) { return m_cos(x); } };
struct Op_erf { template <typename A> static __device__ A f(A x) { return m_erf(x); } };
struct Op_reciprocal { template <typename A> static __device__ A f(A x) { return (A)1 / x; } };
struct Op_floor { template <typename A> static __device__ A f(A x) { return m_floor(x); } };
struct Op_ceil { template <typename A> static __device__ A f(A x) { return m_ceil(x); } };
struct Op_neg { template <typename A> static __device__ A f(A x) { return (A)0 - x; } };
struct Op_abs {
    template <typename A> static __device__ A f(A x) {
        if constexpr (Signed<A>::value) return x < (A)0 ? (A)0 - x : x;
        else return x;
    }
};
struct Op_sign {
    template <typename A> static __device__ A f(A x) {
        if constexpr (Signed<A>::value) return x > (A)0 ? (A)1 : (x < (A)0 ? (A)-1 : (A)0);
        else return x > (A)0 ? (A)1 : (A)0;
    }
};

template <typename T, typename Op> __device__ __forceinline__ void unary(const T* x, T* y, i64 n) {
    ORT_GRID_LOOP(i, n) y[i] = Num<T>::store(Op::f(Num<T>::load(x[i])));
}
#define UNARY(op, T) \
    extern "C" __global__ void op##_##T(const T* x, T* y, i64 n) { unary<T, Op_##op>(x, y, n); }

ORT_FLOATS(UNARY, sqrt)
ORT_FLOATS(UNARY, exp)
ORT_FLOATS(UNARY, log)
ORT_FLOATS(UNARY, sin)
ORT_FLOATS(UNARY, cos)
ORT_FLOATS(UNARY, erf)
ORT_FLOATS(UNARY, reciprocal)
ORT_FLOATS(UNARY, floor)
ORT_FLOATS(UNARY, ceil)
ORT_NUMS(UNARY, neg)
ORT_NUMS(UNARY, abs)
ORT_NUMS(UNARY, sign)

#define IS_NAN(op, T)                                                                         \
    extern "C" __global__ void op##_##T(const T* x, u8* y, i64 n) {                           \
        ORT_GRID_LOOP(i, n) y[i] = m_isnan(Num<T>::load(x[i])) ? 1 : 0;                        \
    }
#define IS_INF(op, T)                                                                         \
    extern "C" __global__ void op##_##T(const T* x, u8* y, i64 n, i32 detect_pos, i32 detect_neg) { \
        ORT_GRID_LOOP(i, n) {                                                                 \
            Num<T>::Acc v = Num<T>::load(x[i]);                                               \
            const Num<T>::Acc inf = m_inf<Num<T>::Acc>();                                     \
            y[i] = ((v == inf && detect_pos) || (v == -inf && detect_neg)) ? 1 : 0;           \
        }                                                                                     \
    }
ORT_FLOATS(IS_NAN, is_nan)
ORT_FLOATS(IS_INF, is_inf)

extern "C" __global__ void not_u8(const u8* x, u8* y, i64 n) {
    ORT_GRID_LOOP(i, n) y[i] = x[i] == 0 ? 1 : 0;
}

// ---- cast ------------------------------------------------------------------------------------
// Rust `as` semantics (the CPU kernel): float -> integer truncates toward zero and saturates,
// NaN -> 0; integer -> narrower integer wraps; anything -> bool is `!= 0` (NaN -> true).

template <typename S> struct IsFloat { static constexpr bool value = false; };
template <> struct IsFloat<f32> { static constexpr bool value = true; };
template <> struct IsFloat<f64> { static constexpr bool value = true; };
template <> struct IsFloat<bf16> { static constexpr bool value = true; };
template <> struct IsFloat<f16> { static constexpr bool value = true; };

// Range of the integer destinations.
template <typename D> struct Lim;
template <> struct Lim<i64> { static constexpr i64 lo = (-9223372036854775807LL - 1), hi = 9223372036854775807LL; };
template <> struct Lim<i32> { static constexpr i32 lo = (-2147483647 - 1), hi = 2147483647; };
template <> struct Lim<i8> { static constexpr i8 lo = -128, hi = 127; };
template <> struct Lim<u8> { static constexpr u8 lo = 0, hi = 255; };

// Saturating truncation toward zero; NaN -> 0. (double)Lim<i64>::hi rounds up to 2^63, so the
// upper test is >=: every value below it converts exactly.
template <typename D> __device__ __forceinline__ D int_from_float(double v) {
    if (v != v) return (D)0;
    if (v <= (double)Lim<D>::lo) return Lim<D>::lo;
    if (v >= (double)Lim<D>::hi) return Lim<D>::hi;
    return (D)(i64)v;
}

template <typename S, typename D> struct Cast {
    static __device__ __forceinline__ D f(S v) {
        if constexpr (IsFloat<D>::value) {
            if constexpr (sizeof(D) == 2) {  // bf16, f16: through f32 (f64 sources round twice)
                return Num<D>::store((f32)Num<S>::load(v));
            } else {
                return (D)Num<S>::load(v);
            }
        } else if constexpr (IsFloat<S>::value) {
            return int_from_float<D>((double)Num<S>::load(v));
        } else {
            return (D)v;  // integer -> integer: wraps
        }
    }
};
template <typename S> struct Cast<S, bool> {
    static __device__ __forceinline__ bool f(S v) { return Num<S>::load(v) != (typename Num<S>::Acc)0; }  // NaN -> true
};

#define CAST(src, D)                                                                          \
    extern "C" __global__ void cast_##src##_##D(const src* x, D* y, i64 n) {                  \
        ORT_GRID_LOOP(i, n) y[i] = Cast<src, D>::f(x[i]);                                     \
    }
#define CAST_FROM(src) CAST(src, f32) CAST(src, f64) CAST(src, bf16) CAST(src, f16) \
    CAST(src, i64) CAST(src, i32) CAST(src, u8) CAST(src, i8) CAST(src, bool)
#define CAST_FROM_X(op, src) CAST_FROM(src)
ORT_NUMS(CAST_FROM_X, _)

// Rows of an f32 matrix rounded to a 16-bit float at another row stride, the columns between
// `cols` and `ldy` zeroed: the fused LM head's gradient rounded once into rows of whole 16-byte
// vectors (a vocabulary of 50257 is no multiple of 8), which cuBLAS's tensor-core kernels want.
// A block per row (grid-stride), its threads along the row.
#define CAST_ROWS(D)                                                                          \
    extern "C" __global__ void cast_rows_f32_##D(const f32* x, D* y, i64 rows, i64 cols, i64 ldx, i64 ldy) { \
        for (i64 r = blockIdx.x; r < rows; r += gridDim.x)                                    \
            for (i64 c = threadIdx.x; c < ldy; c += blockDim.x)                               \
                y[r * ldy + c] = c < cols ? Cast<f32, D>::f(x[r * ldx + c]) : Num<D>::store(0.f); \
    }
CAST_ROWS(bf16)
CAST_ROWS(f16)

// ---- binary with broadcasting --------------------------------------------------------------

struct Op_add { template <typename A> static __device__ A f(A x, A y) { return x + y; } };
struct Op_sub { template <typename A> static __device__ A f(A x, A y) { return x - y; } };
struct Op_mul { template <typename A> static __device__ A f(A x, A y) { return x * y; } };
struct Op_max { template <typename A> static __device__ A f(A x, A y) { return (y > x || m_isnan(y)) ? y : x; } };
struct Op_min { template <typename A> static __device__ A f(A x, A y) { return (y < x || m_isnan(y)) ? y : x; } };
struct Op_div {
    template <typename A> static __device__ A f(A x, A y) {
        if (!((A)0.5 > (A)0)) {  // integers
            if (y == (A)0) return (A)0;
            if (Signed<A>::value && y == (A)(-1)) return (A)((u64)0 - (u64)x);  // MIN / -1 wraps
        }
        return x / y;
    }
};
// Python-style remainder (sign of the divisor) and C-style fmod, integers and floats; an
// integer zero divisor (and MIN % -1) gives 0, a float one NaN.
template <typename A> __device__ __forceinline__ A rem(A x, A y) {
    if (y == (A)0 || (Signed<A>::value && y == (A)(-1))) return (A)0;
    return x % y;
}
__device__ __forceinline__ float rem(float x, float y) { return m_fmod(x, y); }
__device__ __forceinline__ double rem(double x, double y) { return m_fmod(x, y); }
struct Op_fmod { template <typename A> static __device__ A f(A x, A y) { return rem(x, y); } };
// whether a remainder and its divisor have opposite signs (never for u8)
template <typename A> __device__ __forceinline__ bool signs_differ(A r, A y) { return (r < (A)0) != (y < (A)0); }
__device__ __forceinline__ bool signs_differ(u8, u8) { return false; }
struct Op_mod {
    template <typename A> static __device__ A f(A x, A y) {
        A r = rem(x, y);
        return (r != (A)0 && signs_differ(r, y)) ? r + y : r;
    }
};
// CPU: e == 2 -> x*x, otherwise powi/powf (rounding may differ from powf in the last bit)
struct Op_pow { template <typename A> static __device__ A f(A x, A e) { return e == (A)2 ? x * x : m_pow(x, e); } };
// i64 ** i64 with wrapping, negative exponents give 0 (CPU: wrapping_pow)
__device__ __forceinline__ i64 ipow(i64 x, i64 e) {
    if (e < 0) return 0;
    u64 r = 1, b = (u64)x;
    while (e) {
        if (e & 1) r *= b;
        b *= b;
        e >>= 1;
    }
    return (i64)r;
}

template <typename T, typename Op> __device__ __forceinline__ void binary(const T* a, const T* b, T* y, const Strides& s, i64 n) {
    ORT_GRID_LOOP(i, n) {
        i64 o[2];
        strided_offsets<2>(s, i, o);
        y[i] = Num<T>::store(Op::f(Num<T>::load(a[o[0]]), Num<T>::load(b[o[1]])));
    }
}
#define BINARY(op, T)                                                                         \
    extern "C" __global__ void op##_##T(const T* a, const T* b, T* y, Strides s, i64 n) {     \
        binary<T, Op_##op>(a, b, y, s, n);                                                    \
    }
ORT_NUMS(BINARY, add)
ORT_NUMS(BINARY, sub)
ORT_NUMS(BINARY, mul)
ORT_NUMS(BINARY, div)
ORT_NUMS(BINARY, max)
ORT_NUMS(BINARY, min)
ORT_NUMS(BINARY, mod)
ORT_NUMS(BINARY, fmod)
ORT_FLOATS(BINARY, pow)

extern "C" __global__ void pow_i64(const i64* a, const i64* b, i64* y, Strides s, i64 n) {
    ORT_GRID_LOOP(i, n) {
        i64 o[2];
        strided_offsets<2>(s, i, o);
        y[i] = ipow(a[o[0]], b[o[1]]);
    }
}

struct Op_equal { template <typename A> static __device__ bool f(A x, A y) { return x == y; } };
struct Op_less { template <typename A> static __device__ bool f(A x, A y) { return x < y; } };
struct Op_greater { template <typename A> static __device__ bool f(A x, A y) { return x > y; } };
struct Op_less_equal { template <typename A> static __device__ bool f(A x, A y) { return x <= y; } };
struct Op_greater_equal { template <typename A> static __device__ bool f(A x, A y) { return x >= y; } };
#define COMPARE(op, T)                                                                        \
    extern "C" __global__ void op##_##T(const T* a, const T* b, u8* y, Strides s, i64 n) {    \
        ORT_GRID_LOOP(i, n) {                                                                 \
            i64 o[2];                                                                         \
            strided_offsets<2>(s, i, o);                                                      \
            y[i] = Op_##op::f(Num<T>::load(a[o[0]]), Num<T>::load(b[o[1]])) ? 1 : 0;          \
        }                                                                                     \
    }
ORT_NUMS(COMPARE, equal)
ORT_NUMS(COMPARE, less)
ORT_NUMS(COMPARE, greater)
ORT_NUMS(COMPARE, less_equal)
ORT_NUMS(COMPARE, greater_equal)

#define LOGIC(op, expr)                                                                       \
    extern "C" __global__ void op##_u8(const u8* a, const u8* b, u8* y, Strides s, i64 n) {   \
        ORT_GRID_LOOP(i, n) {                                                                 \
            i64 o[2];                                                                         \
            strided_offsets<2>(s, i, o);                                                      \
            const bool x = a[o[0]] != 0, z = b[o[1]] != 0;                                    \
            y[i] = (expr) ? 1 : 0;                                                            \
        }                                                                                     \
    }
LOGIC(and, x && z)
LOGIC(or, x || z)
LOGIC(xor, x != z)

// ---- three-operand and internal ops ------------------------------------------------------------

// Where and MaskSelect move bits: instantiated per element width (u32 serves f32 and i32).
#define WHERE(op, T)                                                                          \
    extern "C" __global__ void op##_##T(const u8* c, const T* a, const T* b, T* y, Strides s, i64 n) { \
        ORT_GRID_LOOP(i, n) {                                                                 \
            i64 o[3];                                                                         \
            strided_offsets<3>(s, i, o);                                                      \
            y[i] = c[o[0]] ? a[o[1]] : b[o[2]];                                               \
        }                                                                                     \
    }
ORT_WIDTHS(WHERE, where)

// zero is all-zero bits in every element type
#define MASK_SELECT(op, T)                                                                    \
    extern "C" __global__ void op##_##T(const u8* c, const T* x, T* y, Strides s, i64 n, i32 keep) { \
        ORT_GRID_LOOP(i, n) {                                                                 \
            i64 o[2];                                                                         \
            strided_offsets<2>(s, i, o);                                                      \
            y[i] = ((c[o[0]] != 0) == (keep != 0)) ? x[o[1]] : (T)0;                          \
        }                                                                                     \
    }
ORT_WIDTHS(MASK_SELECT, mask_select)

// dy where input `which` (0: a, 1: b) won, dy/2 on ties, 0 elsewhere
#define MIN_MAX_GRAD(op, T)                                                                   \
    extern "C" __global__ void op##_##T(const T* dy, const T* a, const T* b, T* y, Strides s, i64 n, i32 is_max, i32 which) { \
        typedef typename Num<T>::Acc A;                                                       \
        ORT_GRID_LOOP(i, n) {                                                                 \
            i64 o[3];                                                                         \
            strided_offsets<3>(s, i, o);                                                      \
            const A d = Num<T>::load(dy[o[0]]), x = Num<T>::load(a[o[1]]), z = Num<T>::load(b[o[2]]); \
            const A mine = which == 0 ? x : z, other = which == 0 ? z : x;                    \
            A r = (A)0;                                                                       \
            if (mine == other) r = d * (A)0.5;                                                \
            else if ((mine > other) == (is_max != 0)) r = d;                                  \
            y[i] = Num<T>::store(r);                                                          \
        }                                                                                     \
    }
ORT_FLOATS(MIN_MAX_GRAD, min_max_grad)

// d/dx erf(x) = 2/sqrt(pi) * exp(-x^2)
#define ERF_GRAD(op, T)                                                                       \
    extern "C" __global__ void op##_##T(const T* dy, const T* x, T* y, Strides s, i64 n) {    \
        typedef typename Num<T>::Acc A;                                                       \
        ORT_GRID_LOOP(i, n) {                                                                 \
            i64 o[2];                                                                         \
            strided_offsets<2>(s, i, o);                                                      \
            const A d = Num<T>::load(dy[o[0]]), v = Num<T>::load(x[o[1]]);                    \
            y[i] = Num<T>::store(d * (A)1.1283791670955126 * m_exp(-(v * v)));                \
        }                                                                                     \
    }
ORT_FLOATS(ERF_GRAD, erf_grad)

#define AFFINE(op, T)                                                                         \
    extern "C" __global__ void op##_##T(const T* x, T* y, i64 n, f64 alpha, f64 beta) {       \
        typedef typename Num<T>::Acc A;                                                       \
        const A a = (A)alpha, b = (A)beta;                                                    \
        ORT_GRID_LOOP(i, n) y[i] = Num<T>::store(Num<T>::load(x[i]) * a + b);                 \
    }
ORT_FLOATS(AFFINE, affine)
