// ortrain CUDA emulator: the cuBLAS calls the engine makes (libcublas.so.13), on the CPU. Every
// product sums in double and rounds once to the output type; the compute type decides how the
// operands are rounded first, as the tensor cores would take them: FAST_TF32 to TF32 (10
// mantissa bits, nearest, ties away), FAST_16BF to bf16 and FAST_16F to f16 (nearest even).
// 16-bit operands are exact in f32. Column-major, as cuBLAS; beta = 0 never reads C.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "emu.h"
#include "emu_runtime.h"

namespace {

enum DataType { R_32F = 0, R_64F = 1, R_16F = 2, R_16BF = 14 };
enum Compute { C_32F = 68, C_32F_PEDANTIC = 69, C_64F = 70, C_64F_PEDANTIC = 71, C_FAST_16F = 74, C_FAST_16BF = 75, C_FAST_TF32 = 77 };

struct Handle {
    void* stream = nullptr;
};

float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float tf32_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return f;  // inf, NaN
    u += 0x1000u;                                      // nearest, ties away from zero
    u &= 0xffffe000u;
    memcpy(&f, &u, 4);
    return f;
}

double load(const void* p, int type, int64_t i) {
    switch (type) {
        case R_32F: return static_cast<const float*>(p)[i];
        case R_64F: return static_cast<const double*>(p)[i];
        case R_16BF: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
        case R_16F: return ort_emu_f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    }
    return NAN;
}

double operand(const void* p, int type, int64_t i, int compute) {
    double v = load(p, type, i);
    if (type != R_32F) return v;
    switch (compute) {
        case C_FAST_TF32: return tf32_round((float)v);
        case C_FAST_16BF: return bf16_to_float(ort_emu_f32_to_bf16((float)v));
        case C_FAST_16F: return ort_emu_f16_to_f32(ort_emu_f32_to_f16((float)v));
    }
    return v;
}

void store(void* p, int type, int64_t i, double v) {
    switch (type) {
        case R_32F: static_cast<float*>(p)[i] = (float)v; break;
        case R_64F: static_cast<double*>(p)[i] = v; break;
        case R_16BF: static_cast<uint16_t*>(p)[i] = ort_emu_f32_to_bf16((float)v); break;
        case R_16F: static_cast<uint16_t*>(p)[i] = ort_emu_f32_to_f16((float)v); break;
    }
}

bool known_type(int t) { return t == R_32F || t == R_64F || t == R_16F || t == R_16BF; }

}  // namespace

#define EXPORT extern "C" __attribute__((visibility("default")))

EXPORT int cublasCreate_v2(Handle** h) {
    *h = new Handle();
    return 0;
}
EXPORT int cublasDestroy_v2(Handle* h) {
    delete h;
    return 0;
}
EXPORT int cublasSetStream_v2(Handle* h, void* stream) {
    h->stream = stream;
    return 0;
}
EXPORT int cublasGetStream_v2(Handle* h, void** stream) {
    *stream = h->stream;
    return 0;
}
EXPORT int cublasSetWorkspace_v2(Handle*, void*, size_t) { return 0; }
EXPORT int cublasSetMathMode(Handle*, int) { return 0; }
EXPORT int cublasGetVersion_v2(Handle*, int* v) {
    *v = 130000;
    return 0;
}

EXPORT int cublasGemmStridedBatchedEx(Handle* h, int transa, int transb, int m, int n, int k, const void* alpha, const void* A, int a_type,
                                      int lda, long long stride_a, const void* B, int b_type, int ldb, long long stride_b, const void* beta,
                                      void* C, int c_type, int ldc, long long stride_c, int batch, int compute, int /*algo*/) {
    const int CUBLAS_STATUS_INVALID_VALUE = 7, CUBLAS_STATUS_NOT_SUPPORTED = 15;
    if (m < 0 || n < 0 || k < 0 || batch < 0) return CUBLAS_STATUS_INVALID_VALUE;
    if (!known_type(a_type) || !known_type(b_type) || !known_type(c_type)) return CUBLAS_STATUS_NOT_SUPPORTED;
    // the combinations cublasGemmEx supports (of these types): A and B alike; 64F with 64F;
    // the FAST modes on 32F data; 32F compute on 32F, or 16-bit A/B with C alike or 32F
    const bool fast = compute == C_FAST_16F || compute == C_FAST_16BF || compute == C_FAST_TF32;
    const bool legal = a_type == b_type && (compute == C_64F || compute == C_64F_PEDANTIC ? a_type == R_64F && c_type == R_64F
                                            : fast ? a_type == R_32F && c_type == R_32F
                                                   : (compute == C_32F || compute == C_32F_PEDANTIC) &&
                                                         ((a_type == R_32F && c_type == R_32F) ||
                                                          ((a_type == R_16F || a_type == R_16BF) && (c_type == a_type || c_type == R_32F))));
    if (!legal) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (lda < ((transa == 0) ? m : k) || ldb < ((transb == 0) ? k : n) || ldc < m || lda < 1 || ldb < 1 || ldc < 1)
        return CUBLAS_STATUS_INVALID_VALUE;
    const bool f64 = compute == C_64F || compute == C_64F_PEDANTIC;
    const double al = f64 ? *static_cast<const double*>(alpha) : *static_cast<const float*>(alpha);
    const double be = f64 ? *static_cast<const double*>(beta) : *static_cast<const float*>(beta);
    ort_emu::Lock lock;
    const int CUBLAS_STATUS_EXECUTION_FAILED = 13;  // the handle's stream was destroyed
    const int queued = ort_emu::enqueue(h->stream, [=] {
        // op(A) as m rows of k and op(B) as n columns of k, rounded once, so each output is a
        // dot product of two contiguous rows
        std::vector<double> a((size_t)m * k), b((size_t)n * k);
        for (int bi = 0; bi < batch; ++bi) {
            const int64_t oa = (int64_t)bi * stride_a, ob = (int64_t)bi * stride_b, oc = (int64_t)bi * stride_c;
            for (int i = 0; i < m; ++i)
                for (int l = 0; l < k; ++l)
                    a[(size_t)i * k + l] = operand(A, a_type, oa + (transa == 0 ? (int64_t)i + (int64_t)l * lda : (int64_t)l + (int64_t)i * lda), compute);
            for (int j = 0; j < n; ++j)
                for (int l = 0; l < k; ++l)
                    b[(size_t)j * k + l] = operand(B, b_type, ob + (transb == 0 ? (int64_t)l + (int64_t)j * ldb : (int64_t)j + (int64_t)l * ldb), compute);
            for (int j = 0; j < n; ++j)
                for (int i = 0; i < m; ++i) {
                    const double* ar = &a[(size_t)i * k];
                    const double* br = &b[(size_t)j * k];
                    double acc = 0;
                    for (int l = 0; l < k; ++l) acc += ar[l] * br[l];
                    const int64_t ic = oc + (int64_t)i + (int64_t)j * ldc;
                    double v = al * acc;
                    if (be != 0) v += be * load(C, c_type, ic);
                    store(C, c_type, ic, v);
                }
        }
        return 0;
    });
    return queued ? CUBLAS_STATUS_EXECUTION_FAILED : 0;
}
