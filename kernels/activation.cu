// Activations and their gradients (engine/src/ops/activation.rs), with the arithmetic of the
// CPU kernels (engine/src/backend/cpu/activation.rs). Contiguous, same shape; in-place allowed;
// 16 bytes a thread at a time where aligned (prelude.cuh ort_map1/ort_map2).
//
//   <op>_T(const T* x, T* y, i64 n, f32 alpha, f32 beta)
//     relu leaky_relu tanh sigmoid gelu gelu_tanh softplus hard_sigmoid hard_swish
//   <op>_grad_T(const T* dy, const T* s, T* dx, i64 n, f32 alpha, f32 beta)
//     s is the forward output y for relu, tanh, sigmoid; the input x for the others
// alpha: LeakyRelu's slope (CPU default 0.01), HardSigmoid's alpha (0.2); beta: HardSigmoid's
// beta (0.5); ignored by the others. T: f32 f64 bf16 f16 (bf16/f16 computed in f32).

#include "prelude.cuh"

#define SQRT_2_OVER_PI 0.7978845608028654
#define GELU_C 0.044715

struct Act_relu {
    template <typename A> static __device__ A f(A x, A, A) { return x > (A)0 ? x : (A)0; }
    template <typename A> static __device__ A g(A d, A y, A, A) { return y > (A)0 ? d : (A)0; }
};
struct Act_leaky_relu {
    template <typename A> static __device__ A f(A x, A a, A) { return x >= (A)0 ? x : a * x; }
    template <typename A> static __device__ A g(A d, A x, A a, A) { return x >= (A)0 ? d : a * d; }
};
struct Act_tanh {
    template <typename A> static __device__ A f(A x, A, A) { return m_tanh(x); }
    template <typename A> static __device__ A g(A d, A y, A, A) { return d * ((A)1 - y * y); }
};
struct Act_sigmoid {
    template <typename A> static __device__ A f(A x, A, A) { return (A)1 / ((A)1 + m_exp(-x)); }
    template <typename A> static __device__ A g(A d, A y, A, A) { return d * y * ((A)1 - y); }
};
// 0.5 x (1 + erf(x / sqrt 2)); d/dx = 0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) / sqrt(2 pi)
struct Act_gelu {
    template <typename A> static __device__ A f(A x, A, A) { return (A)0.5 * x * ((A)1 + m_erf(x * (A)0.7071067811865476)); }
    template <typename A> static __device__ A g(A d, A x, A, A) {
        return d * ((A)0.5 * ((A)1 + m_erf(x * (A)0.7071067811865476)) + x * (A)0.3989422804014327 * m_exp(-(x * x) * (A)0.5));
    }
};
// 0.5 x (1 + tanh(k (x + c x^3)))
struct Act_gelu_tanh {
    template <typename A> static __device__ A f(A x, A, A) {
        return (A)0.5 * x * ((A)1 + m_tanh((A)SQRT_2_OVER_PI * (x + (A)GELU_C * x * x * x)));
    }
    template <typename A> static __device__ A g(A d, A x, A, A) {
        const A t = m_tanh((A)SQRT_2_OVER_PI * (x + (A)GELU_C * x * x * x));
        return d * ((A)0.5 * ((A)1 + t) + (A)0.5 * x * ((A)1 - t * t) * (A)SQRT_2_OVER_PI * ((A)1 + (A)(3.0 * GELU_C) * x * x));
    }
};
// log(1 + e^x), x itself above 20 (as the CPU kernel); log1p is exact where e^x is tiny
struct Act_softplus {
    template <typename A> static __device__ A f(A x, A, A) { return x > (A)20 ? x : m_log1p(m_exp(x)); }
    template <typename A> static __device__ A g(A d, A x, A, A) { return d / ((A)1 + m_exp(-x)); }
};
struct Act_hard_sigmoid {
    template <typename A> static __device__ A f(A x, A a, A b) {
        A v = a * x + b;
        return v < (A)0 ? (A)0 : (v > (A)1 ? (A)1 : v);
    }
    template <typename A> static __device__ A g(A d, A x, A a, A b) {
        A v = a * x + b;
        return (v > (A)0 && v < (A)1) ? d * a : (A)0;
    }
};
// x * clamp(x / 6 + 1/2, 0, 1)
struct Act_hard_swish {
    template <typename A> static __device__ A f(A x, A, A) {
        A v = x * (A)(1.0 / 6.0) + (A)0.5;
        return x * (v < (A)0 ? (A)0 : (v > (A)1 ? (A)1 : v));
    }
    template <typename A> static __device__ A g(A d, A x, A, A) {
        if (x < (A)-3) return (A)0;
        if (x > (A)3) return d;
        return d * (x * (A)(1.0 / 3.0) + (A)0.5);
    }
};

#define ACT(op, T)                                                                            \
    extern "C" __global__ void op##_##T(const T* x, T* y, i64 n, f32 alpha, f32 beta) {       \
        typedef typename Num<T>::Acc A;                                                       \
        const A a = (A)alpha, b = (A)beta;                                                    \
        ort_map1(x, y, n, [=](T v) { return Num<T>::store(Act_##op::f(Num<T>::load(v), a, b)); }); \
    }                                                                                         \
    extern "C" __global__ void op##_grad_##T(const T* dy, const T* s, T* dx, i64 n, f32 alpha, f32 beta) { \
        typedef typename Num<T>::Acc A;                                                       \
        const A a = (A)alpha, b = (A)beta;                                                    \
        ort_map2(dy, s, dx, n, [=](T d, T v) { return Num<T>::store(Act_##op::g(Num<T>::load(d), Num<T>::load(v), a, b)); }); \
    }

ORT_FLOATS(ACT, relu)
ORT_FLOATS(ACT, leaky_relu)
ORT_FLOATS(ACT, tanh)
ORT_FLOATS(ACT, sigmoid)
ORT_FLOATS(ACT, gelu)
ORT_FLOATS(ACT, gelu_tanh)
ORT_FLOATS(ACT, softplus)
ORT_FLOATS(ACT, hard_sigmoid)
ORT_FLOATS(ACT, hard_swish)
