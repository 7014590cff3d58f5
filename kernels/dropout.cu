// Dropout forward (producing the keep mask) and backward (engine/src/ops/random.rs; CPU kernels
// engine/src/backend/cpu/random.rs), and the random draws of engine/src/ops/random_draws.rs
// (uniform, normal, Bernoulli; at the end of this header), with the Philox4x32-10
// counter-based generator (Salmon et al., SC 2011): element i draws from counter (offset + i / 4) under key `seed`, so a launch is
// deterministic for any grid, and the host advances `offset` by ceil(n / 4) per call for a
// fresh stream. The masks differ from the CPU backend's (which hashes with SplitMix64), as
// PyTorch's CPU and CUDA masks differ; their statistics and the y = x * mask / (1 - ratio)
// identity are what a parity test checks.
//
// Every kernel ends with the rate's operands R = (const void* ratio_at, i32 ratio_type,
// const u8* training_at, i32* err), for a Dropout whose ratio or training_mode is computed in
// the step (null pointers: the constants given before them). ratio_at: the ratio, of type
// ratio_type (0 f32, 1 f64, 2 bf16, 3 f16); training_at: training_mode (0: the Dropout keeps
// everything, as outside training: y = x, mask all 1, dx = dy). A ratio read outside [0, 1)
// (or NaN) in training cannot fail the launch: y is NaN, the mask 0, and *err is set to 1 (err
// may be null); the executor reports the node after the step, as for an index out of range.
//
//   dropout_T(const T* x, T* y, u8* mask, i64 n, f32 ratio, u64 seed, u64 offset, R)
//       keep where uniform >= ratio (as the CPU kernel); y = keep ? x / (1 - ratio) : 0;
//       mask may be null. Training with ratio 0, or inference, is a copy (no launch needed).
//   dropout_slot_T(const T* x, T* y, u8* mask, i64 n, f32 ratio, const u64* seed, u64 salt, R)
//       the same with the key read from device memory: key = splitmix64(*seed ^ salt), offset 0
//       (the host computes the same key for dropout_T from the step's seed and salt =
//       splitmix64(node id), so both draw the same masks). A CUDA graph bakes kernel arguments;
//       this variant lets a replayed step draw fresh masks from a seed written before the replay.
//   dropout_add_T(const T* x, const T* res, T* y, u8* mask, i64 n, f32 ratio, u64 seed, u64 offset, R)
//   dropout_add_slot_T(const T* x, const T* res, T* y, u8* mask, i64 n, f32 ratio, const u64* seed, u64 salt, R)
//       DropoutAdd (passes/fuse_dropout_add.rs): y = dropout(x) + res, the dropped value
//       rounded to T before the add, as the Dropout and Add it replaces; ratio 0 for inference
//   dropout_add_wide_T(const T* x, const f32* res, f32* y, u8* mask, i64 n, f32 ratio, u64 seed, u64 offset, R)
//   dropout_add_wide_slot_T(const T* x, const f32* res, f32* y, u8* mask, i64 n, f32 ratio, const u64* seed, u64 salt, R)
//       the same for a 16-bit x joining an f32 residual (T: bf16 f16): the dropped value
//       rounded to T, then widened and added in f32, as Dropout, Cast and Add did
//   dropout_grad_T(const T* dy, const u8* mask, T* dx, i64 n, f32 scale, R)
//       dx = mask ? dy * scale : 0, scale = 1 / (1 - ratio) in training (1 otherwise)
//   dropout_grad_wide_T(const f32* dy, const u8* mask, T* dx, i64 n, f32 scale, R)
//       the same from an f32 dy (T: bf16 f16; dropout_add_wide's gradient), dy rounded to T
//       first, as the Cast and DropoutGrad it replaces
// T: f32 f64 bf16 f16. In-place allowed (y may alias x, dx dy; not in the _wide kernels).
//
// The random draws (T: f32 f64 bf16 f16; values computed in f64 for uniform, in T's compute
// type for normal, then rounded to T once). `seed` null: `key` is the Philox key; else the key
// is splitmix64(*seed ^ key) (key then the node's salt, as dropout_slot_T: a CUDA graph's
// replay draws from the seed written before it). Counter g gives elements 4g..4g+3, one 32-bit
// word each (f64 uniforms: elements 2g, 2g+1, 53 bits from two words each).
//   random_uniform_T(T* y, i64 n, f64 low, f64 high, const u64* seed, u64 key)
//       y = low + (high - low)·u, u uniform in [0, 1)
//   random_normal_T(T* y, i64 n, f64 mean, f64 scale, const u64* seed, u64 key)
//       y = mean + scale·z, z standard normal (Box-Muller over words (0, 1) and (2, 3))
//   bernoulli_T(const T* p, T* y, i64 n, const u64* seed, u64 key)
//       y = 1 where a 24-bit uniform < p, else 0
//   dropout_key_i64(u64* out, const u64* seed, u64 key)
//       DropoutKey (ops/random.rs): *out = the Philox key (seed and key as above), the one a
//       Dropout of the node's name would key its mask with (dropout_T's `seed`, offset 0); the
//       fused attention regenerates that mask from it (kernels/attention.cuh att_drop). One thread.

#include "prelude.cuh"
#include "philox.cuh"

// The ratio at ratio_at, of type ratio_type (see the header).
__device__ __forceinline__ f32 read_ratio(const void* at, i32 type) {
    switch (type) {
        case 1: return (f32)*(const f64*)at;
        case 2: return Num<bf16>::load(*(const bf16*)at);
        case 3: return Num<f16>::load(*(const f16*)at);
        default: return *(const f32*)at;
    }
}
// The ratio a launch applies: `ratio`, or the one read at ratio_at; 0 where training_at says
// the Dropout is not training.
__device__ __forceinline__ f32 dropout_rate(f32 ratio, const void* ratio_at, i32 ratio_type, const u8* training_at) {
    if (training_at && !*training_at) return 0.f;
    return ratio_at ? read_ratio(ratio_at, ratio_type) : ratio;
}
// The backward's scale: `scale`, or 1 / (1 - the ratio read), 1 outside training.
__device__ __forceinline__ f32 dropout_grad_scale(f32 scale, const void* ratio_at, i32 ratio_type, const u8* training_at) {
    if (training_at && !*training_at) return 1.f;
    return ratio_at ? 1.f / (1.f - read_ratio(ratio_at, ratio_type)) : scale;
}

// res: null, or a tensor like x added to the output (DropoutAdd), of x's type or, for a
// 16-bit x, f32 (R: the residual's and the output's type).
template <typename T, typename R = T>
__device__ __forceinline__ void dropout_fwd(const T* x, const R* res, R* y, u8* mask, i64 n, f32 ratio, u64 seed, u64 offset,
                                            const void* ratio_at, i32 ratio_type, const u8* training_at, i32* err) {
    typedef typename Num<T>::Acc A;
    ratio = dropout_rate(ratio, ratio_at, ratio_type, training_at);
    if (!(ratio >= 0.f && ratio < 1.f)) {  // only a ratio read on the device gets here
        if (err && blockIdx.x == 0 && threadIdx.x == 0) *err = 1;
        ORT_GRID_LOOP(i, n) {
            y[i] = Num<R>::store((typename Num<R>::Acc)__uint_as_float(0x7fc00000u));
            if (mask) mask[i] = 0;
        }
        return;
    }
    const A scale = (A)1 / ((A)1 - (A)ratio);
    const i64 groups = (n + 3) / 4;
    ORT_GRID_LOOP(g, groups) {
        const u64 c = offset + (u64)g;
        const U4 r = philox_words(seed, c);
        const u32 rs[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const i64 i = g * 4 + k;
            if (i < n) {
                const bool keep = uniform24(rs[k]) >= ratio;
                const T dropped = keep ? Num<T>::store(Num<T>::load(x[i]) * scale) : Num<T>::store((A)0);
                if (res) y[i] = Num<R>::store(Num<R>::load(res[i]) + (typename Num<R>::Acc)Num<T>::load(dropped));
                else reinterpret_cast<T*>(y)[i] = dropped;  // no residual: R is T
                if (mask) mask[i] = keep ? 1 : 0;
            }
        }
    }
}

// the rate's operands every kernel ends with (see the header)
#define RATE_PARAMS const void *ratio_at, i32 ratio_type, const u8 *training_at, i32 *err
#define RATE_ARGS ratio_at, ratio_type, training_at, err

#define DROPOUT(op, T)                                                                        \
    extern "C" __global__ void dropout_##T(const T* x, T* y, u8* mask, i64 n, f32 ratio, u64 seed, u64 offset, RATE_PARAMS) { \
        dropout_fwd<T, T>(x, nullptr, y, mask, n, ratio, seed, offset, RATE_ARGS);               \
    }                                                                                         \
    extern "C" __global__ void dropout_slot_##T(const T* x, T* y, u8* mask, i64 n, f32 ratio, const u64* seed, u64 salt,       \
                                                RATE_PARAMS) {                                \
        dropout_fwd<T, T>(x, nullptr, y, mask, n, ratio, splitmix64(*seed ^ salt), 0, RATE_ARGS); \
    }                                                                                         \
    extern "C" __global__ void dropout_add_##T(const T* x, const T* res, T* y, u8* mask, i64 n, f32 ratio, u64 seed, u64 offset, \
                                               RATE_PARAMS) {                                 \
        dropout_fwd<T, T>(x, res, y, mask, n, ratio, seed, offset, RATE_ARGS);                   \
    }                                                                                         \
    extern "C" __global__ void dropout_add_slot_##T(const T* x, const T* res, T* y, u8* mask, i64 n, f32 ratio, const u64* seed, \
                                                    u64 salt, RATE_PARAMS) {                  \
        dropout_fwd<T, T>(x, res, y, mask, n, ratio, splitmix64(*seed ^ salt), 0, RATE_ARGS);    \
    }                                                                                         \
    extern "C" __global__ void dropout_grad_##T(const T* dy, const u8* mask, T* dx, i64 n, f32 scale, RATE_PARAMS) { \
        typedef Num<T>::Acc A;                                                                \
        const A s = (A)dropout_grad_scale(scale, ratio_at, ratio_type, training_at);          \
        ORT_GRID_LOOP(i, n) dx[i] = Num<T>::store(mask[i] ? Num<T>::load(dy[i]) * s : (A)0);  \
    }
ORT_FLOATS(DROPOUT, _)

// DropoutAdd of a 16-bit branch into an f32 stream (the Cast between them fused too).
#define DROPOUT_ADD_WIDE(op, T)                                                               \
    extern "C" __global__ void dropout_add_wide_##T(const T* x, const f32* res, f32* y, u8* mask, i64 n, f32 ratio, u64 seed,      \
                                                    u64 offset, RATE_PARAMS) {                \
        dropout_fwd<T, f32>(x, res, y, mask, n, ratio, seed, offset, RATE_ARGS);              \
    }                                                                                         \
    extern "C" __global__ void dropout_add_wide_slot_##T(const T* x, const f32* res, f32* y, u8* mask, i64 n, f32 ratio,           \
                                                         const u64* seed, u64 salt, RATE_PARAMS) { \
        dropout_fwd<T, f32>(x, res, y, mask, n, ratio, splitmix64(*seed ^ salt), 0, RATE_ARGS); \
    }                                                                                         \
    extern "C" __global__ void dropout_grad_wide_##T(const f32* dy, const u8* mask, T* dx, i64 n, f32 scale, RATE_PARAMS) { \
        const f32 s = dropout_grad_scale(scale, ratio_at, ratio_type, training_at);           \
        ORT_GRID_LOOP(i, n) dx[i] = Num<T>::store(mask[i] ? Num<T>::load(Num<T>::store(dy[i])) * s : 0.f);             \
    }
DROPOUT_ADD_WIDE(_, bf16)
DROPOUT_ADD_WIDE(_, f16)

// ---- random draws ------------------------------------------------------------------------

__device__ __forceinline__ u64 draw_key(const u64* seed, u64 key) { return seed ? splitmix64(*seed ^ key) : key; }

extern "C" __global__ void dropout_key_i64(u64* out, const u64* seed, u64 key) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *out = draw_key(seed, key);
}
// The four 32-bit words of counter g under `key`.
struct Words { u32 w[4]; };
__device__ __forceinline__ Words draw_words(u64 key, u64 g) {
    const U4 r = philox_words(key, g);
    return Words{{r.x, r.y, r.z, r.w}};
}

template <typename T> __device__ __forceinline__ void random_uniform(T* y, i64 n, f64 low, f64 high, u64 key) {
    typedef typename Num<T>::Acc A;
    const f64 span = high - low;
    if constexpr (sizeof(A) == 8) {  // f64: 53 bits from two words per element
        ORT_GRID_LOOP(g, (n + 1) / 2) {
            const Words r = draw_words(key, (u64)g);
            const u32* w = r.w;
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const i64 i = 2 * g + k;
                const f64 u = (f64)(((u64)w[2 * k] << 21) | (u64)(w[2 * k + 1] >> 11)) * (1.0 / 9007199254740992.0);
                if (i < n) y[i] = Num<T>::store((A)(low + span * u));
            }
        }
    } else {
        ORT_GRID_LOOP(g, (n + 3) / 4) {
            const Words r = draw_words(key, (u64)g);
            const u32* w = r.w;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const i64 i = 4 * g + k;
                if (i < n) y[i] = Num<T>::store((A)(low + span * (f64)uniform24(w[k])));
            }
        }
    }
}

template <typename T> __device__ __forceinline__ void random_normal(T* y, i64 n, f64 mean, f64 scale, u64 key) {
    typedef typename Num<T>::Acc A;
    const A two_pi = (A)6.283185307179586;
    ORT_GRID_LOOP(g, (n + 3) / 4) {
        const Words r = draw_words(key, (u64)g);
        const u32* w = r.w;
#pragma unroll
        for (int k = 0; k < 4; k += 2) {
            const A u1 = ((A)(w[k] >> 8) + (A)1) * (A)(1.0 / 16777216.0);  // (0, 1]: the log is finite
            const A u2 = (A)(w[k + 1] >> 8) * (A)(1.0 / 16777216.0);
            const A rad = m_sqrt((A)-2 * m_log(u1)), th = two_pi * u2;
            const i64 i = 4 * g + k;
            if (i < n) y[i] = Num<T>::store((A)mean + (A)scale * rad * m_cos(th));
            if (i + 1 < n) y[i + 1] = Num<T>::store((A)mean + (A)scale * rad * m_sin(th));
        }
    }
}

template <typename T> __device__ __forceinline__ void bernoulli(const T* p, T* y, i64 n, u64 key) {
    typedef typename Num<T>::Acc A;
    ORT_GRID_LOOP(g, (n + 3) / 4) {
        const Words r = draw_words(key, (u64)g);
        const u32* w = r.w;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const i64 i = 4 * g + k;
            if (i < n) y[i] = Num<T>::store((A)uniform24(w[k]) < Num<T>::load(p[i]) ? (A)1 : (A)0);
        }
    }
}

#define RANDOM_DRAWS(op, T)                                                                   \
    extern "C" __global__ void random_uniform_##T(T* y, i64 n, f64 low, f64 high, const u64* seed, u64 key) { \
        random_uniform<T>(y, n, low, high, draw_key(seed, key));                               \
    }                                                                                         \
    extern "C" __global__ void random_normal_##T(T* y, i64 n, f64 mean, f64 scale, const u64* seed, u64 key) { \
        random_normal<T>(y, n, mean, scale, draw_key(seed, key));                              \
    }                                                                                         \
    extern "C" __global__ void bernoulli_##T(const T* p, T* y, i64 n, const u64* seed, u64 key) { \
        bernoulli<T>(p, y, n, draw_key(seed, key));                                            \
    }
ORT_FLOATS(RANDOM_DRAWS, _)
