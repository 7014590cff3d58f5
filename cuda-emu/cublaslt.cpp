// ortrain CUDA emulator: the cuBLASLt calls the engine makes (libcublasLt.so.13; blas_lt.rs), on
// the CPU, with the arithmetic of blas_math.h. Descriptors keep what their attributes set, and
// setting one checks its size as cuBLASLt does (a wrong size is INVALID_VALUE); the heuristic
// answers one algorithm for the combinations blas_math.h's `legal` allows with the DEFAULT or
// BIAS epilogue and a bias of D's type, or the DGELU epilogue (the product times the tanh GELU's
// derivative at the aux matrix: D's type, a leading dimension divisible by 8 and no less than
// D's rows, as cuBLASLt documents) and DGELU_BGRAD (that, and the sums of D's rows, the bias
// gradient, written at the bias pointer in D's type), or GELU_AUX and GELU_AUX_BIAS (the product
// plus the bias written to the aux matrix, of D's type and the same constraints, and its tanh GELU
// to D), else NOT_SUPPORTED with none. The algorithm carries the
// alignments the preference allowed (256 bytes unless set, as cuBLASLt assumes), and the
// matmul fails, naming the operand, where an address is less aligned than its algorithm
// assumes (on a GPU: a misaligned-address fault), or a bias or aux matrix less than 16-byte
// aligned.
#include <stdio.h>

#include "blas_math.h"

using namespace ort_blas;

namespace {

enum DescAttr {
    D_COMPUTE = 0,
    D_SCALE = 1,
    D_POINTER_MODE = 2,
    D_TRANSA = 3,
    D_TRANSB = 4,
    D_EPILOGUE = 7,
    D_BIAS_POINTER = 8,
    D_AUX_POINTER = 11,
    D_AUX_LD = 12,
    D_BIAS_TYPE = 26
};
enum Epilogue { E_DEFAULT = 1, E_BIAS = 4, E_GELU_AUX = 160, E_GELU_AUX_BIAS = 164, E_DGELU = 192, E_DGELU_BGRAD = 208 };
enum LayoutAttr { L_TYPE = 0, L_ORDER = 1, L_ROWS = 2, L_COLS = 3, L_LD = 4, L_BATCH = 5, L_STRIDE = 6 };
enum PrefAttr { P_MAX_WORKSPACE = 1, P_ALIGN_A = 5, P_ALIGN_D = 8 };

struct Desc {
    int compute, scale;
    int32_t transa = 0, transb = 0, pointer_mode = 0;
    uint32_t epilogue = E_DEFAULT;
    const void* bias = nullptr;
    int32_t bias_type = -1;
    const void* aux = nullptr;
    int64_t aux_ld = 0;
};
struct Layout {
    int32_t type;
    uint64_t rows, cols;
    int64_t ld;
    int32_t order = 0, batch = 1;
    int64_t stride = 0;
};
struct Pref {
    uint64_t workspace = 0;
    uint32_t align[4] = {256, 256, 256, 256};  // A, B, C, D
};
struct LtHandle {};

struct HeuristicResult {
    uint64_t algo[8];
    size_t workspace;
    int state;
    float waves;
    int reserved[4];
};

template <typename T> int set(T& field, const void* buf, size_t size) {
    if (size != sizeof(T) || !buf) return INVALID_VALUE;
    memcpy(&field, buf, sizeof(T));
    return OK;
}

// D = op(A)·op(B) with A m×k after its op: the dimensions, or false where the layouts disagree
bool dims(const Desc* d, const Layout* a, const Layout* b, const Layout* c, int& m, int& n, int& k) {
    m = (int)(d->transa ? a->cols : a->rows);
    k = (int)(d->transa ? a->rows : a->cols);
    const int kb = (int)(d->transb ? b->cols : b->rows);
    n = (int)(d->transb ? b->rows : b->cols);
    return kb == k && (int)c->rows == m && (int)c->cols == n && a->order == 0 && b->order == 0 && c->order == 0 && a->batch == 1 &&
           b->batch == 1 && c->batch == 1 && a->ld >= (int64_t)a->rows && b->ld >= (int64_t)b->rows && c->ld >= (int64_t)c->rows;
}

bool supported(const Desc* d, const Layout* a, const Layout* b, const Layout* c, const Layout* dl) {
    if (d->scale != R_32F || d->pointer_mode != 0 || c->type != dl->type || !legal(a->type, b->type, c->type, d->compute)) return false;
    if (d->epilogue == E_DEFAULT) return true;
    const bool bias_ok = d->bias && (d->bias_type == -1 || d->bias_type == dl->type);
    if (d->epilogue == E_DGELU || d->epilogue == E_DGELU_BGRAD || d->epilogue == E_GELU_AUX || d->epilogue == E_GELU_AUX_BIAS) {
        const bool needs_bias = d->epilogue == E_DGELU_BGRAD || d->epilogue == E_GELU_AUX_BIAS;
        return d->aux && d->aux_ld % 8 == 0 && d->aux_ld >= (int64_t)dl->rows && (!needs_bias || bias_ok);
    }
    return d->epilogue == E_BIAS && bias_ok;
}

}  // namespace

#define EXPORT extern "C" __attribute__((visibility("default")))

EXPORT int cublasLtCreate(LtHandle** h) {
    *h = new LtHandle();
    return OK;
}
EXPORT int cublasLtDestroy(LtHandle* h) {
    delete h;
    return OK;
}

EXPORT int cublasLtMatmulDescCreate(Desc** d, int compute, int scale) {
    *d = new Desc{compute, scale};
    return OK;
}
EXPORT int cublasLtMatmulDescDestroy(Desc* d) {
    delete d;
    return OK;
}
EXPORT int cublasLtMatmulDescSetAttribute(Desc* d, int attr, const void* buf, size_t size) {
    switch (attr) {
        case D_COMPUTE: return set(d->compute, buf, size);
        case D_SCALE: return set(d->scale, buf, size);
        case D_POINTER_MODE: return set(d->pointer_mode, buf, size);
        case D_TRANSA: return set(d->transa, buf, size);
        case D_TRANSB: return set(d->transb, buf, size);
        case D_EPILOGUE: return set(d->epilogue, buf, size);
        case D_BIAS_POINTER: return set(d->bias, buf, size);
        case D_BIAS_TYPE: return set(d->bias_type, buf, size);
        case D_AUX_POINTER: return set(d->aux, buf, size);
        case D_AUX_LD: return set(d->aux_ld, buf, size);
    }
    return INVALID_VALUE;  // an attribute the emulator does not know: the engine does not set it
}

EXPORT int cublasLtMatrixLayoutCreate(Layout** l, int type, uint64_t rows, uint64_t cols, int64_t ld) {
    if (!known_type(type)) return NOT_SUPPORTED;
    *l = new Layout{type, rows, cols, ld};
    return OK;
}
EXPORT int cublasLtMatrixLayoutDestroy(Layout* l) {
    delete l;
    return OK;
}
EXPORT int cublasLtMatrixLayoutSetAttribute(Layout* l, int attr, const void* buf, size_t size) {
    switch (attr) {
        case L_ORDER: return set(l->order, buf, size);
        case L_BATCH: return set(l->batch, buf, size);
        case L_STRIDE: return set(l->stride, buf, size);
    }
    return INVALID_VALUE;
}

EXPORT int cublasLtMatmulPreferenceCreate(Pref** p) {
    *p = new Pref();
    return OK;
}
EXPORT int cublasLtMatmulPreferenceDestroy(Pref* p) {
    delete p;
    return OK;
}
EXPORT int cublasLtMatmulPreferenceSetAttribute(Pref* p, int attr, const void* buf, size_t size) {
    if (attr == P_MAX_WORKSPACE) return set(p->workspace, buf, size);
    if (attr >= P_ALIGN_A && attr <= P_ALIGN_D) return set(p->align[attr - P_ALIGN_A], buf, size);
    return INVALID_VALUE;
}

EXPORT int cublasLtMatmulAlgoGetHeuristic(LtHandle*, Desc* d, Layout* a, Layout* b, Layout* c, Layout* dl, Pref* pref, int requested,
                                          HeuristicResult* results, int* returned) {
    int m, n, k;
    if (requested < 1 || !dims(d, a, b, c, m, n, k) || dl->rows != c->rows || dl->cols != c->cols) return INVALID_VALUE;
    if (!supported(d, a, b, c, dl)) {
        *returned = 0;
        return NOT_SUPPORTED;
    }
    memset(&results[0], 0, sizeof(HeuristicResult));
    for (int i = 0; i < 4; ++i) results[0].algo[i] = pref->align[i];
    results[0].waves = 1.0f;
    *returned = 1;
    return OK;
}

EXPORT int cublasLtMatmul(LtHandle*, Desc* d, const void* alpha, const void* A, Layout* a, const void* B, Layout* b, const void* beta,
                          const void* C, Layout* c, void* D, Layout* dl, const void* algo, void*, size_t, void* stream) {
    int m, n, k;
    if (!algo || !dims(d, a, b, c, m, n, k) || dl->rows != c->rows || dl->cols != c->cols) return INVALID_VALUE;
    if (!supported(d, a, b, c, dl)) return NOT_SUPPORTED;
    const uint64_t* assumed = static_cast<const uint64_t*>(algo);
    const void* ptrs[4] = {A, B, C, D};
    for (int i = 0; i < 4; ++i) {
        if (assumed[i] && (uintptr_t)ptrs[i] % assumed[i]) {
            fprintf(stderr, "cuda-emu: cublasLtMatmul: %c at %p is not aligned to the %llu bytes its algorithm assumes\n", "ABCD"[i], ptrs[i],
                    (unsigned long long)assumed[i]);
            return INVALID_VALUE;
        }
    }
    const bool adds_bias = d->epilogue == E_BIAS || d->epilogue == E_GELU_AUX_BIAS;
    if (adds_bias && (uintptr_t)d->bias % 16) {
        fprintf(stderr, "cuda-emu: cublasLtMatmul: the bias at %p is not 16-byte aligned\n", d->bias);
        return INVALID_VALUE;
    }
    const bool gelu = d->epilogue == E_GELU_AUX || d->epilogue == E_GELU_AUX_BIAS;
    if (gelu && (uintptr_t)d->aux % 16) {
        fprintf(stderr, "cuda-emu: cublasLtMatmul: the GELU aux matrix at %p is not 16-byte aligned\n", d->aux);
        return INVALID_VALUE;
    }
    const bool dgelu = d->epilogue == E_DGELU || d->epilogue == E_DGELU_BGRAD;
    if (d->epilogue == E_DGELU_BGRAD && (uintptr_t)d->bias % 16) {
        fprintf(stderr, "cuda-emu: cublasLtMatmul: the bias gradient at %p is not 16-byte aligned\n", d->bias);
        return INVALID_VALUE;
    }
    if (dgelu && (uintptr_t)d->aux % 16) {
        fprintf(stderr, "cuda-emu: cublasLtMatmul: the DGELU aux matrix at %p is not 16-byte aligned\n", d->aux);
        return INVALID_VALUE;
    }
    const double al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
    Product p{m, n, k, d->transa != 0, d->transb != 0, A, B, a->type, a->ld, b->ld, C, c->ld, D, dl->ld, dl->type,
                    adds_bias ? d->bias : nullptr, d->compute, al, be};
    if (gelu) {
        p.gelu_aux = const_cast<void*>(d->aux);
        p.ld_gelu = d->aux_ld;
    }
    if (dgelu) {
        p.gelu_grad_of = d->aux;
        p.ld_gelu = d->aux_ld;
        if (d->epilogue == E_DGELU_BGRAD) p.bias_grad = const_cast<void*>(d->bias);
    }
    ort_emu::Lock lock;
    for (const void* q : {A, B, C, static_cast<const void*>(D)})
        if (ort_emu::foreign_pointer("cublasLtMatmul", q)) return EXECUTION_FAILED;
    return ort_emu::enqueue(stream, [p] {
               p.run();
               return 0;
           })
               ? EXECUTION_FAILED
               : OK;
}
