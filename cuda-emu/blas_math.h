// ortrain CUDA emulator: the arithmetic of the cuBLAS and cuBLASLt products (cublas.cpp,
// cublaslt.cpp), on the CPU. Every product sums in double and rounds once to the output type;
// the compute type decides how the operands are rounded first, as the tensor cores would take
// them: FAST_TF32 to TF32 (10 mantissa bits, nearest, ties away), FAST_16BF to bf16 and
// FAST_16F to f16 (nearest even). 16-bit operands are exact in f32. Column-major, as cuBLAS;
// beta = 0 never reads C.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "emu.h"
#include "emu_runtime.h"

namespace ort_blas {

enum DataType { R_32F = 0, R_64F = 1, R_16F = 2, R_16BF = 14 };
enum Compute { C_32F = 68, C_32F_PEDANTIC = 69, C_64F = 70, C_64F_PEDANTIC = 71, C_FAST_16F = 74, C_FAST_16BF = 75, C_FAST_TF32 = 77 };
enum Status { OK = 0, INVALID_VALUE = 7, EXECUTION_FAILED = 13, NOT_SUPPORTED = 15 };

inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline float tf32_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return f;  // inf, NaN
    u += 0x1000u;                                      // nearest, ties away from zero
    u &= 0xffffe000u;
    memcpy(&f, &u, 4);
    return f;
}

inline double load(const void* p, int type, int64_t i) {
    switch (type) {
        case R_32F: return static_cast<const float*>(p)[i];
        case R_64F: return static_cast<const double*>(p)[i];
        case R_16BF: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
        case R_16F: return ort_emu_f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    }
    return NAN;
}

inline double operand(const void* p, int type, int64_t i, int compute) {
    double v = load(p, type, i);
    if (type != R_32F) return v;
    switch (compute) {
        case C_FAST_TF32: return tf32_round((float)v);
        case C_FAST_16BF: return bf16_to_float(ort_emu_f32_to_bf16((float)v));
        case C_FAST_16F: return ort_emu_f16_to_f32(ort_emu_f32_to_f16((float)v));
    }
    return v;
}

inline void store(void* p, int type, int64_t i, double v) {
    switch (type) {
        case R_32F: static_cast<float*>(p)[i] = (float)v; break;
        case R_64F: static_cast<double*>(p)[i] = v; break;
        case R_16BF: static_cast<uint16_t*>(p)[i] = ort_emu_f32_to_bf16((float)v); break;
        case R_16F: static_cast<uint16_t*>(p)[i] = ort_emu_f32_to_f16((float)v); break;
    }
}

inline bool known_type(int t) { return t == R_32F || t == R_64F || t == R_16F || t == R_16BF; }
inline int64_t elem_size(int t) { return t == R_64F ? 8 : t == R_32F ? 4 : 2; }

// The combinations cublasGemmEx and cublasLtMatmul support (of these types): A and B alike;
// 64F with 64F; the FAST modes on 32F data; 32F compute on 32F, or 16-bit A/B with C alike or 32F.
inline bool legal(int a_type, int b_type, int c_type, int compute) {
    if (!known_type(a_type) || !known_type(b_type) || !known_type(c_type) || a_type != b_type) return false;
    if (compute == C_64F || compute == C_64F_PEDANTIC) return a_type == R_64F && c_type == R_64F;
    if (compute == C_FAST_16F || compute == C_FAST_16BF || compute == C_FAST_TF32) return a_type == R_32F && c_type == R_32F;
    if (compute != C_32F && compute != C_32F_PEDANTIC) return false;
    return (a_type == R_32F && c_type == R_32F) || ((a_type == R_16F || a_type == R_16BF) && (c_type == a_type || c_type == R_32F));
}

// One product, column-major: D[i + j ldd] = al · sum_l op(A)[i, l] op(B)[l, j] + be · C[i + j ldc]
// (+ bias[i] when bias is given, of D's type), for i < m, j < n; op(A)[i, l] is A[i + l lda]
// (A[l + i lda] when transposed), op(B)[l, j] is B[l + j ldb] (B[j + l ldb]). C may be D.
// d/dx of 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), in f32 as a GPU epilogue computes it
inline double gelu_tanh_slope(double xd) {
    const float x = (float)xd, k = 0.7978845608f, c = 0.044715f;
    const float t = tanhf(k * (x + c * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * c * x * x);
}

// 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), in f32 as cuBLASLt's GELU epilogue computes it
inline double gelu_tanh_value(double xd) {
    const float x = (float)xd, k = 0.7978845608f, c = 0.044715f;
    return 0.5f * x * (1.0f + tanhf(k * (x + c * x * x * x)));
}

struct Product {
    int m, n, k;
    bool ta, tb;
    const void *a, *b;
    int ab_type;
    int64_t lda, ldb;
    const void* c;
    int64_t ldc;
    void* d;
    int64_t ldd;
    int cd_type;
    const void* bias;
    int compute;
    double al, be;
    // cuBLASLt's DGELU epilogue: each result times the tanh GELU's derivative at this matrix
    // (cd_type, column-major with leading dimension ld_gelu)
    const void* gelu_grad_of = nullptr;
    int64_t ld_gelu = 0;
    // DGELU_BGRAD: the sums of D's rows (column-major: over its columns), stored in cd_type
    void* bias_grad = nullptr;
    // GELU_AUX(_BIAS): each result (bias added) stored here (cd_type, leading dimension
    // ld_gelu), and its tanh GELU to D
    void* gelu_aux = nullptr;

    void run() const {
        // op(A) as m rows of k and op(B) as n columns of k, rounded once, so each output is a
        // dot product of two contiguous rows
        std::vector<double> ar((size_t)m * k), br((size_t)n * k);
        for (int i = 0; i < m; ++i)
            for (int l = 0; l < k; ++l) ar[(size_t)i * k + l] = operand(a, ab_type, !ta ? (int64_t)i + (int64_t)l * lda : (int64_t)l + (int64_t)i * lda, compute);
        for (int j = 0; j < n; ++j)
            for (int l = 0; l < k; ++l) br[(size_t)j * k + l] = operand(b, ab_type, !tb ? (int64_t)l + (int64_t)j * ldb : (int64_t)j + (int64_t)l * ldb, compute);
        std::vector<double> row_sums(bias_grad ? m : 0, 0.0);
        for (int j = 0; j < n; ++j)
            for (int i = 0; i < m; ++i) {
                const double* x = &ar[(size_t)i * k];
                const double* y = &br[(size_t)j * k];
                double acc = 0;
                for (int l = 0; l < k; ++l) acc += x[l] * y[l];
                double v = al * acc;
                if (be != 0) v += be * load(c, cd_type, (int64_t)i + (int64_t)j * ldc);
                if (bias) v += load(bias, cd_type, i);
                if (gelu_grad_of) v *= gelu_tanh_slope(load(gelu_grad_of, cd_type, (int64_t)i + (int64_t)j * ld_gelu));
                if (gelu_aux) {
                    store(gelu_aux, cd_type, (int64_t)i + (int64_t)j * ld_gelu, v);
                    v = gelu_tanh_value(v);
                }
                store(d, cd_type, (int64_t)i + (int64_t)j * ldd, v);
                if (bias_grad) row_sums[i] += v;
            }
        for (int i = 0; i < (int)row_sums.size(); ++i) store(bias_grad, cd_type, i, row_sums[i]);
    }
};

}  // namespace ort_blas
