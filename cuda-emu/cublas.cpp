// ortrain CUDA emulator: the cuBLAS calls the engine makes (libcublas.so.13), on the CPU, with
// the arithmetic of blas_math.h.
#include "blas_math.h"

using namespace ort_blas;

namespace {

struct Handle {
    void* stream = nullptr;
};

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
    if (m < 0 || n < 0 || k < 0 || batch < 0) return INVALID_VALUE;
    if (!legal(a_type, b_type, c_type, compute)) return NOT_SUPPORTED;
    if (lda < ((transa == 0) ? m : k) || ldb < ((transb == 0) ? k : n) || ldc < m || lda < 1 || ldb < 1 || ldc < 1)
        return INVALID_VALUE;
    const bool f64 = compute == C_64F || compute == C_64F_PEDANTIC;
    const double al = f64 ? *static_cast<const double*>(alpha) : *static_cast<const float*>(alpha);
    const double be = f64 ? *static_cast<const double*>(beta) : *static_cast<const float*>(beta);
    ort_emu::Lock lock;
    for (const void* p : {A, B, static_cast<const void*>(C)})
        if (ort_emu::foreign_pointer("cublasGemmStridedBatchedEx", p)) return EXECUTION_FAILED;
    // the handle's stream was destroyed: EXECUTION_FAILED
    const int queued = ort_emu::enqueue(h->stream, [=] {
        for (int bi = 0; bi < batch; ++bi) {
            char* c = static_cast<char*>(C) + (int64_t)bi * stride_c * elem_size(c_type);
            const char* a = static_cast<const char*>(A) + (int64_t)bi * stride_a * elem_size(a_type);
            const char* b = static_cast<const char*>(B) + (int64_t)bi * stride_b * elem_size(b_type);
            Product{m, n, k, transa != 0, transb != 0, a, b, a_type, lda, ldb, c, ldc, c, ldc, c_type, nullptr, compute, al, be}.run();
        }
        return 0;
    });
    return queued ? EXECUTION_FAILED : OK;
}
