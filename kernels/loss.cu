// SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss, forward and backward, with
// ignore_index, class weights and reduction none/sum/mean (engine/src/ops/loss.rs; CPU kernels
// engine/src/backend/cpu/loss.rs). Scores are [N, C, d...]; a sample s = (n, d...) reads its C
// scores `inner` = prod(d...) apart; S = N * inner samples. Labels are i64.
//
// Fused forward and backward: the forward can write the gradient of each sample's loss term
// (w (softmax - onehot), before the reduction's scaling) while the row is in registers, and the
// backward only scales it in place (sce_grad_scale_T). sce_grad_T recomputes it instead, for a
// memory plan that does not keep the forward's gradient.
//
//   sce_loss_T(const T* x, const i64* labels, const T* weights, A* loss_s, A* w_s, T* logp, T* grad,
//              i64 S, i64 C, i64 inner, i64 ignore_index, i32 has_ignore, i32 softmax, i32* err)
//       one block per sample (grid-stride; blockDim.x a multiple of 32): loss_s[s] = -w log p(label),
//       w_s[s] = w (0 for an ignored sample); logp (the optional log-probability output, softmax
//       only) and grad may be null; weights (per class) may be null.
//   sce_reduce_T(const A* loss_s, const A* w_s, T* out, A* wsum, i64 S, i32 reduction)
//       ONE block: reduction 0 none (out[s] = loss_s[s]), 1 sum, 2 mean (sum / sum of weights, NaN
//       when every sample is ignored, as the CPU kernel); wsum (may be null) gets the sum of weights
//       for the backward.
//   sce_grad_scale_T(const T* dy, const A* wsum, T* grad, i64 S, i64 C, i64 inner, i32 reduction)
//       grad (N*C*inner, in place) *= dy[s] (none), dy[0] (sum), dy[0] / wsum (mean; 0 if wsum is 0)
//   sce_grad_T(const T* dy, const T* x, const i64* labels, const T* weights, const A* wsum, T* dx,
//              i64 S, i64 C, i64 inner, i64 ignore_index, i32 has_ignore, i32 softmax, i32 reduction)
//       the same gradient, recomputed from the scores (one block per sample)
// A label outside [0, C) that is not ignore_index counts as ignored and sets *err = 1 (err may be
// null); the executor reports it, as the CPU kernel fails on it. T: f32 f64 bf16 f16; A = f32
// (f64 for f64).
//
// LinearCrossEntropy (the LM head and its loss, engine/src/ops/loss.rs): the host walks row
// chunks, cuBLAS makes each chunk's logits and its three gradient products, and
//   lce_weights_T(const i64* labels, const T* weights, A* w_s, A* wsum, i64 rows, i64 C,
//                 i64 ignore_index, i32 has_ignore, i32* err)
//       ONE block, before the chunks: w_s[r] = row r's weight (0 ignored or invalid), *wsum = Σ w_s
//   lce_rows_T(T* g, const T* bias, const i64* labels, const A* w_s, const A* wsum, A* loss_s,
//              i64 R, i64 C, i64 ldx, i32 mean)
//       one block per row of a chunk (labels, w_s and loss_s at its first row): the row's logits
//       g[r] (C of them, rows ldx >= C apart; the columns past C are not touched) (plus bias,
//       when not null) become their unit-seed gradient w f (softmax - onehot),
//       f = 1 / *wsum for the mean (0 when it is 0) or 1 for the sum, and loss_s[r] = -w log
//       softmax[label]; sce_reduce_T then reduces loss_s and w_s as for the unfused loss.
//   lce_rows_v16_D(D* g, labels, const f32* w_s, const f32* wsum, f32* loss_s, i64 R, i64 C,
//                  i64 ldx, i32 mean)                                            D: bf16, f16
//       lce_rows_D without a bias where g and ldx keep every row 16-byte aligned (a bf16
//       session's LM head, whose logits product writes bf16): 8 elements a 16-byte load and
//       store, the last C % 8 one by one; the columns past C are not touched

#include "prelude.cuh"

struct Sample {
    i64 base;   // offset of class 0
    i64 label;  // valid when w != 0
};

__device__ __forceinline__ Sample sample_of(i64 s, i64 C, i64 inner, const i64* labels) {
    Sample r;
    r.base = inner == 1 ? s * C : (s / inner) * C * inner + s % inner;
    r.label = labels[s];
    return r;
}

// Weight of a sample: 0 when ignored or invalid (then *err is set).
template <typename T> __device__ __forceinline__ typename Num<T>::Acc sample_weight(i64 y, const T* weights, i64 C, i64 ignore_index,
                                                                                 i32 has_ignore, i32* err) {
    typedef typename Num<T>::Acc A;
    if (has_ignore && y == ignore_index) return (A)0;
    if (y < 0 || y >= C) {
        if (err) *err = 1;
        return (A)0;
    }
    return weights ? Num<T>::load(weights[y]) : (A)1;
}

// Max and log-sum-exp of a sample's scores, on every thread of the block.
template <typename T, typename A> __device__ __forceinline__ void lse_of(const T* x, i64 base, i64 C, i64 inner, A* scratch, A& m, A& lse) {
    A mx = OpMax::init<A>();
    for (i64 k = threadIdx.x; k < C; k += blockDim.x) mx = OpMax::apply(mx, Num<T>::load(x[base + k * inner]));
    m = block_reduce<OpMax>(mx, scratch);
    A s = (A)0;
    for (i64 k = threadIdx.x; k < C; k += blockDim.x) s += m_exp(Num<T>::load(x[base + k * inner]) - m);
    lse = m_log(block_reduce<OpSum>(s, scratch));
}

template <typename T> __device__ __forceinline__ void sce_loss(const T* x, const i64* labels, const T* weights, typename Num<T>::Acc* loss_s,
                                                               typename Num<T>::Acc* w_s, T* logp, T* grad, i64 S, i64 C, i64 inner,
                                                               i64 ignore_index, i32 has_ignore, i32 softmax, i32* err) {
    typedef typename Num<T>::Acc A;
    ORT_SHARED(A, scratch, [32]);
    for (i64 s = blockIdx.x; s < S; s += gridDim.x) {
        const Sample p = sample_of(s, C, inner, labels);
        const A w = sample_weight<T>(p.label, weights, C, ignore_index, has_ignore, threadIdx.x == 0 ? err : nullptr);
        A m = (A)0, lse = (A)0;
        if (softmax) lse_of<T, A>(x, p.base, C, inner, scratch, m, lse);
        if (threadIdx.x == 0) {
            const A lp = w == (A)0 ? (A)0 : Num<T>::load(x[p.base + p.label * inner]) - (softmax ? m + lse : (A)0);
            loss_s[s] = w == (A)0 ? (A)0 : -w * lp;
            w_s[s] = w;
        }
        if (logp && softmax) {
            for (i64 k = threadIdx.x; k < C; k += blockDim.x) {
                const i64 at = p.base + k * inner;
                logp[at] = Num<T>::store(Num<T>::load(x[at]) - m - lse);
            }
        }
        if (grad) {
            for (i64 k = threadIdx.x; k < C; k += blockDim.x) {
                const i64 at = p.base + k * inner;
                const A onehot = (w != (A)0 && k == p.label) ? (A)1 : (A)0;
                const A g = softmax ? w * (m_exp(Num<T>::load(x[at]) - m - lse) - onehot) : -w * onehot;
                grad[at] = Num<T>::store(g);
            }
        }
        __syncthreads();
    }
}

template <typename T> __device__ __forceinline__ void sce_reduce(const typename Num<T>::Acc* loss_s, const typename Num<T>::Acc* w_s, T* out,
                                                                 typename Num<T>::Acc* wsum, i64 S, i32 reduction) {
    typedef typename Num<T>::Acc A;
    ORT_SHARED(A, scratch, [32]);
    if (blockIdx.x != 0) return;
    A l = (A)0, w = (A)0;
    for (i64 s = threadIdx.x; s < S; s += blockDim.x) {
        l += loss_s[s];
        w += w_s[s];
        if (reduction == 0) out[s] = Num<T>::store(loss_s[s]);
    }
    l = block_reduce<OpSum>(l, scratch);
    w = block_reduce<OpSum>(w, scratch);
    if (threadIdx.x == 0) {
        if (wsum) *wsum = w;
        if (reduction == 1) out[0] = Num<T>::store(l);
        if (reduction == 2) out[0] = Num<T>::store(w == (A)0 ? (A)(0.0 / 0.0) : l / w);
    }
}

// The factor the backward applies to sample s's term.
template <typename T> __device__ __forceinline__ typename Num<T>::Acc grad_factor(const T* dy, const typename Num<T>::Acc* wsum, i64 s,
                                                                                i32 reduction) {
    typedef typename Num<T>::Acc A;
    if (reduction == 0) return Num<T>::load(dy[s]);
    if (reduction == 1) return Num<T>::load(dy[0]);
    const A w = *wsum;
    return w == (A)0 ? (A)0 : Num<T>::load(dy[0]) / w;
}

template <typename T> __device__ __forceinline__ void sce_grad(const T* dy, const T* x, const i64* labels, const T* weights,
                                                               const typename Num<T>::Acc* wsum, T* dx, i64 S, i64 C, i64 inner,
                                                               i64 ignore_index, i32 has_ignore, i32 softmax, i32 reduction) {
    typedef typename Num<T>::Acc A;
    ORT_SHARED(A, scratch, [32]);
    for (i64 s = blockIdx.x; s < S; s += gridDim.x) {
        const Sample p = sample_of(s, C, inner, labels);
        const A w = sample_weight<T>(p.label, weights, C, ignore_index, has_ignore, nullptr);
        const A g = w * grad_factor<T>(dy, wsum, s, reduction);
        A m = (A)0, lse = (A)0;
        if (softmax) lse_of<T, A>(x, p.base, C, inner, scratch, m, lse);
        for (i64 k = threadIdx.x; k < C; k += blockDim.x) {
            const i64 at = p.base + k * inner;
            const A onehot = (w != (A)0 && k == p.label) ? (A)1 : (A)0;
            dx[at] = Num<T>::store(softmax ? g * (m_exp(Num<T>::load(x[at]) - m - lse) - onehot) : -g * onehot);
        }
        __syncthreads();
    }
}

// Row weights and their sum (one block).
template <typename T> __device__ __forceinline__ void lce_weights(const i64* labels, const T* weights, typename Num<T>::Acc* w_s,
                                                                  typename Num<T>::Acc* wsum, i64 rows, i64 C, i64 ignore_index,
                                                                  i32 has_ignore, i32* err) {
    typedef typename Num<T>::Acc A;
    ORT_SHARED(A, scratch, [32]);
    if (blockIdx.x != 0) return;
    A total = (A)0;
    for (i64 r = threadIdx.x; r < rows; r += blockDim.x) {
        const A w = sample_weight<T>(labels[r], weights, C, ignore_index, has_ignore, err);
        w_s[r] = w;
        total += w;
    }
    total = block_reduce<OpSum>(total, scratch);
    if (threadIdx.x == 0) *wsum = total;
}

// A row pass's running max and sum of exps, one value at a time: a thread's sum rescaled when
// its max grows (mx = -inf at first: exp(-inf) = 0); -inf adds exp(-inf) = 0 (and would be NaN
// against mx = -inf); NaN stays NaN.
template <typename A> __device__ __forceinline__ void lce_see(A v, A& mx, A& s) {
    if (v > mx) {
        s = s * m_exp(mx - v) + (A)1;
        mx = v;
    } else if (v != OpMax::init<A>()) {
        s += m_exp(v - mx);
    }
}

// The row weight's factor f: 1 / Σ weights for the mean (0 when that is 0), 1 for the sum.
template <typename A> __device__ __forceinline__ A lce_factor(i32 mean, const A* wsum) {
    const A total = mean ? *wsum : (A)1;
    return total == (A)0 ? (A)0 : (A)1 / total;
}

// The row's log-sum-exp from each thread's running max and sum (lce_see): the block's max, the
// sums brought to it (a thread with no element, mx = -inf, has s = 0), their sum.
template <typename A> __device__ __forceinline__ A lce_lse(A mx, A s, A* scratch) {
    const A m = block_reduce<OpMax>(mx, scratch);
    if (mx != m) s *= m_exp(mx - m);
    return m + m_log(block_reduce<OpSum>(s, scratch));
}

// G's element k of a row (logit v, label y, row weight w, gw = w·f), and the row's loss term
// into *loss where k is the label.
template <typename A> __device__ __forceinline__ A lce_g(A v, A lse, i64 k, i64 y, A w, A gw, A* loss) {
    A p = m_exp(v - lse);
    if (k == y) {
        *loss = -w * (v - lse);
        p -= (A)1;
    }
    return gw * p;
}

// A chunk's logits x into their unit-seed gradient, in place. Each thread reads back only the
// elements it wrote (the same k stride in every pass), so no barrier is needed between them; the
// label's logit is read by the thread that owns it, in the last pass.
template <typename T>
__device__ __forceinline__ void lce_rows(T* x, const T* bias, const i64* labels, const typename Num<T>::Acc* w_s,
                                         const typename Num<T>::Acc* wsum, typename Num<T>::Acc* loss_s, i64 R, i64 C,
                                         i64 ldx, i32 mean) {
    typedef typename Num<T>::Acc A;
    ORT_SHARED(A, scratch, [32]);
    const A f = lce_factor(mean, wsum);
    for (i64 r = blockIdx.x; r < R; r += gridDim.x) {
        T* row = x + r * ldx;
        const A w = w_s[r];
        if (w == (A)0) {  // the same for the whole block: no thread skips a barrier the others reach
            for (i64 k = threadIdx.x; k < C; k += blockDim.x) row[k] = Num<T>::store((A)0);
            if (threadIdx.x == 0) loss_s[r] = (A)0;
            continue;
        }
        const i64 y = labels[r];
        // one pass for the max and the sum of exps (a thread's running sum rescaled when its max
        // grows), then the block's max and the sums brought to it: the row is read twice, not 3 times
        A mx = OpMax::init<A>(), s = (A)0;
        for (i64 k = threadIdx.x; k < C; k += blockDim.x) {
            A v = Num<T>::load(row[k]);
            if (bias) {
                v += Num<T>::load(bias[k]);
                row[k] = Num<T>::store(v);
                v = Num<T>::load(row[k]);
            }
            lce_see(v, mx, s);
        }
        const A lse = lce_lse(mx, s, scratch);
        const A gw = w * f;
        for (i64 k = threadIdx.x; k < C; k += blockDim.x)
            row[k] = Num<T>::store(lce_g(Num<T>::load(row[k]), lse, k, y, w, gw, &loss_s[r]));
        __syncthreads();
    }
}

// Eight 16-bit D of a 16-byte vector as f32, and back (rounded to nearest).
template <typename D> __device__ __forceinline__ void v16_floats(const uint4& u, f32 e[8]) {
    const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        e[2 * j] = Num<D>::load(D{(u16)(w[j] & 0xffffu)});
        e[2 * j + 1] = Num<D>::load(D{(u16)(w[j] >> 16)});
    }
}
template <typename D> __device__ __forceinline__ uint4 v16_pack(const f32 e[8]) {
    u32 w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = (u32)Num<D>::store(e[2 * j]).bits | ((u32)Num<D>::store(e[2 * j + 1]).bits << 16);
    return uint4{w[0], w[1], w[2], w[3]};
}

// lce_rows over 16-bit logits in place, 16 bytes a thread at a time (rows 16-byte aligned).
template <typename D>
__device__ __forceinline__ void lce_rows_v16(D* x, const i64* labels, const f32* w_s, const f32* wsum, f32* loss_s, i64 R, i64 C, i64 ldx,
                                             i32 mean) {
    ORT_SHARED(f32, scratch, [32]);
    const f32 f = lce_factor(mean, wsum);
    const i64 V = C / 8;
    for (i64 r = blockIdx.x; r < R; r += gridDim.x) {
        D* row = x + r * ldx;
        uint4* vrow = reinterpret_cast<uint4*>(row);
        const f32 w = w_s[r];
        if (w == 0.f) {  // the same for the whole block
            for (i64 v = threadIdx.x; v < V; v += blockDim.x) vrow[v] = uint4{0u, 0u, 0u, 0u};
            for (i64 k = 8 * V + threadIdx.x; k < C; k += blockDim.x) row[k] = Num<D>::store(0.f);
            if (threadIdx.x == 0) loss_s[r] = 0.f;
            continue;
        }
        const i64 y = labels[r];
        f32 mx = OpMax::init<f32>(), s = 0.f;
        for (i64 v = threadIdx.x; v < V; v += blockDim.x) {
            f32 e[8];
            v16_floats<D>(vrow[v], e);
#pragma unroll
            for (int j = 0; j < 8; ++j) lce_see(e[j], mx, s);
        }
        for (i64 k = 8 * V + threadIdx.x; k < C; k += blockDim.x) lce_see(Num<D>::load(row[k]), mx, s);
        const f32 lse = lce_lse(mx, s, scratch);
        const f32 gw = w * f;
        // each thread reads back only the vectors (and tail elements) it read above
        for (i64 v = threadIdx.x; v < V; v += blockDim.x) {
            f32 e[8];
            v16_floats<D>(vrow[v], e);
#pragma unroll
            for (int j = 0; j < 8; ++j) e[j] = lce_g(e[j], lse, 8 * v + j, y, w, gw, &loss_s[r]);
            vrow[v] = v16_pack<D>(e);
        }
        for (i64 k = 8 * V + threadIdx.x; k < C; k += blockDim.x)
            row[k] = Num<D>::store(lce_g(Num<D>::load(row[k]), lse, k, y, w, gw, &loss_s[r]));
        __syncthreads();
    }
}

#define LOSS(op, T)                                                                           \
    extern "C" __global__ void sce_loss_##T(const T* x, const i64* labels, const T* weights, Num<T>::Acc* loss_s, \
                                            Num<T>::Acc* w_s, T* logp, T* grad, i64 S, i64 C, i64 inner, \
                                            i64 ignore_index, i32 has_ignore, i32 softmax, i32* err) { \
        sce_loss<T>(x, labels, weights, loss_s, w_s, logp, grad, S, C, inner, ignore_index, has_ignore, softmax, err); \
    }                                                                                         \
    extern "C" __global__ void sce_reduce_##T(const Num<T>::Acc* loss_s, const Num<T>::Acc* w_s, T* out, \
                                              Num<T>::Acc* wsum, i64 S, i32 reduction) {      \
        sce_reduce<T>(loss_s, w_s, out, wsum, S, reduction);                                  \
    }                                                                                         \
    extern "C" __global__ void sce_grad_scale_##T(const T* dy, const Num<T>::Acc* wsum, T* grad, i64 S, i64 C, \
                                                  i64 inner, i32 reduction) {                 \
        const i64 n = S * C;                                                                  \
        ORT_GRID_LOOP(e, n) {                                                                 \
            const i64 s = inner == 1 ? e / C : (e / (C * inner)) * inner + e % inner;          \
            grad[e] = Num<T>::store(Num<T>::load(grad[e]) * grad_factor<T>(dy, wsum, s, reduction)); \
        }                                                                                     \
    }                                                                                         \
    extern "C" __global__ void sce_grad_##T(const T* dy, const T* x, const i64* labels, const T* weights, \
                                            const Num<T>::Acc* wsum, T* dx, i64 S, i64 C, i64 inner, \
                                            i64 ignore_index, i32 has_ignore, i32 softmax, i32 reduction) { \
        sce_grad<T>(dy, x, labels, weights, wsum, dx, S, C, inner, ignore_index, has_ignore, softmax, reduction); \
    }                                                                                         \
    extern "C" __global__ void lce_weights_##T(const i64* labels, const T* weights, Num<T>::Acc* w_s, Num<T>::Acc* wsum, \
                                               i64 rows, i64 C, i64 ignore_index, i32 has_ignore, i32* err) { \
        lce_weights<T>(labels, weights, w_s, wsum, rows, C, ignore_index, has_ignore, err);   \
    }                                                                                         \
    extern "C" __global__ void lce_rows_##T(T* g, const T* bias, const i64* labels, const Num<T>::Acc* w_s, \
                                            const Num<T>::Acc* wsum, Num<T>::Acc* loss_s, i64 R, i64 C, i64 ldx, i32 mean) { \
        lce_rows<T>(g, bias, labels, w_s, wsum, loss_s, R, C, ldx, mean);  \
    }
ORT_FLOATS(LOSS, _)

#define LCE_ROWS_V16(D)                                                                                                       \
    extern "C" __global__ void lce_rows_v16_##D(D* g, const i64* labels, const f32* w_s, const f32* wsum, f32* loss_s, i64 R, i64 C, \
                                                i64 ldx, i32 mean) {                                                          \
        lce_rows_v16<D>(g, labels, w_s, wsum, loss_s, R, C, ldx, mean);                                                       \
    }
LCE_ROWS_V16(bf16)
LCE_ROWS_V16(f16)
