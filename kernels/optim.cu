// Multi-tensor fused optimizer updates and gradient-norm clipping (engine/src/optim/mod.rs, with
// its arithmetic: torch.optim's operation order). One launch updates every parameter of a group:
// the tensors are described by an array in device memory, and the work is cut into chunks of
// `chunk` elements, listed by (chunk_tensor[c], chunk_start[c]); block b handles chunks b,
// b + gridDim.x, ... The host builds the descriptors and the chunk lists once per plan (the
// pointers do not move) and passes the per-step scalars by value. Parameters and moments are
// f32 (master weights); gradients are G = f32, bf16 or f16.
//
//   adam_G(const AdamTensor* ts, const i32* chunk_tensor, const i64* chunk_start, i64 chunks, i64 chunk,
//          f32 w1, f32 beta2, f32 w2, f32 eps, f32 weight_decay, f32 decay, f32 step_size,
//          f32 bc2_sqrt, i32 decoupled, i32 maximize)
//       Adam and AdamW; w1 = 1 - beta1, w2 = 1 - beta2, decay = 1 - lr * weight_decay (AdamW),
//       step_size = lr / (1 - beta1^t) and bc2_sqrt = sqrt(1 - beta2^t), all computed on the host
//       in f64 and rounded once (optim::AdamScalars, as torch's Python floats); the element
//       arithmetic is the CPU loop's (engine/src/optim/adam.rs: torch's CPU kernels' roundings)
//   sgd_G(const SgdTensor* ts, ..., f32 lr, f32 momentum, f32 dampening, f32 weight_decay,
//         i32 nesterov, i32 maximize, i32 first)       buf null: no momentum
//   sum_squares_G(const GradTensor* ts, ..., f64* partial)   partial[c] = sum of g^2 over chunk c
//   grad_norm_f64(const f64* partial, i64 chunks, f32 max_norm, f32* norm, f32* coef)
//       ONE block: norm = sqrt(sum partial); coef = min(1, max_norm / (norm + 1e-6)) in f32 as
//       optim::clip_coefficient (a NaN norm: NaN)
//       (torch.nn.utils.clip_grad_norm_), both on the device: clipping needs no host sync
//   scale_by_G(const GradTensor* ts, ..., const f32* coef)   g *= *coef

#include "prelude.cuh"

struct AdamTensor {
    f32* p;
    const void* g;
    f32* m;
    f32* v;
    i64 n;
};
struct SgdTensor {
    f32* p;
    const void* g;
    f32* buf;  // momentum buffer, or null
    i64 n;
};
struct GradTensor {
    void* g;
    i64 n;
};

// Chunk c of a launch: its tensor t and element range [begin, end).
template <typename TS> __device__ __forceinline__ void chunk_range(const TS* ts, const i32* chunk_tensor, const i64* chunk_start, i64 chunk,
                                                                  i64 c, int& t, i64& begin, i64& end) {
    t = chunk_tensor[c];
    begin = chunk_start[c];
    end = begin + chunk < ts[t].n ? begin + chunk : ts[t].n;
}

// f(descriptor, i) for every element of this block's chunks (the block's threads stride over
// each chunk).
template <typename TS, typename F> __device__ __forceinline__ void for_each_element(const TS* ts, const i32* chunk_tensor, const i64* chunk_start,
                                                                                   i64 chunks, i64 chunk, F f) {
    for (i64 c = blockIdx.x; c < chunks; c += gridDim.x) {
        int t;
        i64 begin, end;
        chunk_range(ts, chunk_tensor, chunk_start, chunk, c, t, begin, end);
        const TS d = ts[t];
        for (i64 i = begin + threadIdx.x; i < end; i += blockDim.x) f(d, i);
    }
}

template <typename G> __device__ __forceinline__ void adam(const AdamTensor* ts, const i32* chunk_tensor, const i64* chunk_start, i64 chunks,
                                                           i64 chunk, f32 w1, f32 beta2, f32 w2, f32 eps, f32 weight_decay,
                                                           f32 decay, f32 step_size, f32 bc2_sqrt, i32 decoupled, i32 maximize) {
    const bool small_weight = fabsf(w1) < 0.5f;
    for_each_element(ts, chunk_tensor, chunk_start, chunks, chunk, [&](const AdamTensor& a, i64 i) {
        f32 grad = Num<G>::load(((const G*)a.g)[i]);
        if (maximize) grad = -grad;
        f32 p = a.p[i];
        if (weight_decay != 0.0f) {
            if (decoupled) p *= decay;
            else grad = fmaf(p, weight_decay, grad);  // grad.add(param, alpha=weight_decay)
        }
        f32 m = a.m[i], v = a.v[i];
        // exp_avg.lerp_(grad, 1 - beta1), as torch's CPU lerp: from the end for weights >= 0.5
        m = small_weight ? fmaf(w1, grad - m, m) : fmaf(w1 - 1.0f, grad - m, grad);
        v = fmaf(w2 * grad, grad, v * beta2);  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
        const f32 denom = sqrtf(v) / bc2_sqrt + eps;
        a.p[i] = p + (-step_size * m) / denom;  // param.addcdiv_(exp_avg, denom, value=-step_size)
        a.m[i] = m;
        a.v[i] = v;
    });
}

template <typename G> __device__ __forceinline__ void sgd(const SgdTensor* ts, const i32* chunk_tensor, const i64* chunk_start, i64 chunks,
                                                          i64 chunk, f32 lr, f32 momentum, f32 dampening, f32 weight_decay, i32 nesterov,
                                                          i32 maximize, i32 first) {
    for_each_element(ts, chunk_tensor, chunk_start, chunks, chunk, [&](const SgdTensor& a, i64 i) {
        f32 d = Num<G>::load(((const G*)a.g)[i]);
        if (maximize) d = -d;
        const f32 p = a.p[i];
        if (weight_decay != 0.0f) d += weight_decay * p;
        if (a.buf && momentum != 0.0f) {
            const f32 b = first ? d : a.buf[i] * momentum + (1.0f - dampening) * d;
            a.buf[i] = b;
            d = nesterov ? d + momentum * b : b;
        }
        a.p[i] = p - lr * d;
    });
}

template <typename G> __device__ __forceinline__ void sum_squares(const GradTensor* ts, const i32* chunk_tensor, const i64* chunk_start,
                                                                  i64 chunks, i64 chunk, f64* partial) {
    ORT_SHARED(f64, scratch, [32]);
    for (i64 c = blockIdx.x; c < chunks; c += gridDim.x) {
        int t;
        i64 begin, end;
        chunk_range(ts, chunk_tensor, chunk_start, chunk, c, t, begin, end);
        const G* g = (const G*)ts[t].g;
        f64 s = 0.0;
        for (i64 i = begin + threadIdx.x; i < end; i += blockDim.x) {
            const f64 v = (f64)Num<G>::load(g[i]);
            s += v * v;
        }
        s = block_reduce<OpSum>(s, scratch);
        if (threadIdx.x == 0) partial[c] = s;
    }
}

template <typename G> __device__ __forceinline__ void scale_by(const GradTensor* ts, const i32* chunk_tensor, const i64* chunk_start,
                                                               i64 chunks, i64 chunk, const f32* coef) {
    const f32 k = *coef;
    for_each_element(ts, chunk_tensor, chunk_start, chunks, chunk, [&](const GradTensor& d, i64 i) {
        G* g = (G*)d.g;
        g[i] = Num<G>::store(Num<G>::load(g[i]) * k);
    });
}

#define CHUNK_ARGS const i32 *chunk_tensor, const i64 *chunk_start, i64 chunks, i64 chunk
#define OPTIM(op, G)                                                                          \
    extern "C" __global__ void adam_##G(const AdamTensor* ts, CHUNK_ARGS, f32 w1, f32 beta2, f32 w2, f32 eps,        \
                                        f32 weight_decay, f32 decay, f32 step_size, f32 bc2_sqrt, i32 decoupled, \
                                        i32 maximize) {                                       \
        adam<G>(ts, chunk_tensor, chunk_start, chunks, chunk, w1, beta2, w2, eps, weight_decay, decay, step_size, \
                bc2_sqrt, decoupled, maximize);                                               \
    }                                                                                         \
    extern "C" __global__ void sgd_##G(const SgdTensor* ts, CHUNK_ARGS, f32 lr, f32 momentum, f32 dampening, \
                                       f32 weight_decay, i32 nesterov, i32 maximize, i32 first) { \
        sgd<G>(ts, chunk_tensor, chunk_start, chunks, chunk, lr, momentum, dampening, weight_decay, nesterov, maximize, first); \
    }                                                                                         \
    extern "C" __global__ void sum_squares_##G(const GradTensor* ts, CHUNK_ARGS, f64* partial) { \
        sum_squares<G>(ts, chunk_tensor, chunk_start, chunks, chunk, partial);                \
    }                                                                                         \
    extern "C" __global__ void scale_by_##G(const GradTensor* ts, CHUNK_ARGS, const f32* coef) { \
        scale_by<G>(ts, chunk_tensor, chunk_start, chunks, chunk, coef);                      \
    }
OPTIM(_, f32)
OPTIM(_, bf16)
OPTIM(_, f16)

extern "C" __global__ void grad_norm_f64(const f64* partial, i64 chunks, f32 max_norm, f32* norm, f32* coef) {
    ORT_SHARED(f64, scratch, [32]);
    if (blockIdx.x != 0) return;
    f64 s = 0.0;
    for (i64 c = threadIdx.x; c < chunks; c += blockDim.x) s += partial[c];
    s = block_reduce<OpSum>(s, scratch);
    if (threadIdx.x == 0) {
        const f32 nrm = (f32)sqrt(s);
        const f32 k = 1.0f / (nrm + 1e-6f) * max_norm;  // torch's max_norm / t: a reciprocal, then the product
        *norm = nrm;
        *coef = k > 1.0f ? 1.0f : k;  // a NaN norm gives a NaN coefficient, as torch's clamp does
    }
}
