// ortrain CUDA emulator, device side: what kernels/*.cu need from the CUDA language, for g++.
// Force-included (`-include emu.h`) before a kernel file, with ORT_CPU_EMU defined, so the same
// sources NVRTC compiles for the GPU run here on the CPU: every CUDA thread is a fiber
// (fibers.cpp), blocks run one at a time, `__shared__` data is a static per block, barriers,
// shuffles, mma.sync and ldmatrix are collective operations of the scheduler; cp.async copies
// land as early or as late as a GPU may land them. Not a GPU: no timing, no
// memory model beyond "a block's threads run between barriers in a shuffled order".
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define ORT_CPU_EMU 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#ifndef ORT_EMU_KEEP_LAUNCH_BOUNDS  // build.sh reads them from the preprocessed source
#define __launch_bounds__(...)
#endif
#define __align__(n) alignas(n)
// one block runs at a time, so a block's shared data can be a static of the kernel function
#define __shared__ static

struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(16) int4 {
    int x, y, z, w;
};

struct dim3 {
    unsigned x, y, z;
};

// the running fiber's coordinates (set by the scheduler before it resumes a fiber)
extern dim3 threadIdx, blockIdx, blockDim, gridDim;

// collective operations, implemented by the scheduler
void ort_emu_syncthreads();
int ort_emu_syncthreads_count(int pred, int* arrived);
void ort_emu_fresh_shared(void* p, size_t bytes);
uint64_t ort_emu_shfl_xor(unsigned mask, uint64_t bits, int lane_mask);
unsigned ort_emu_ballot(unsigned mask, int pred);
void ort_emu_mma_m16n8k16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, int f16);
// ldmatrix .x4 (trans: .trans): this lane's row address; the registers it gets
void ort_emu_ldmatrix_x4(uint32_t r[4], const void* row, int trans);
// cp.async of `bytes` (4, 8 or 16; zero-filled past src_bytes), commit_group, wait_group: a
// thread's even groups land at their commit, its odd ones when it waits for them (fibers.cpp)
void ort_emu_cp_async(void* dst, const void* src, int bytes, int src_bytes);
void ort_emu_cp_async_commit();
void ort_emu_cp_async_wait(int pending);
void* ort_emu_dynamic_shared();
uint16_t ort_emu_f32_to_bf16(float f);
uint16_t ort_emu_f32_to_f16(float f);
float ort_emu_f16_to_f32(uint16_t h);

inline void __syncthreads() { ort_emu_syncthreads(); }
// over the threads that have not exited, as the barrier itself
inline int __syncthreads_and(int p) {
    int arrived = 0;
    return ort_emu_syncthreads_count(p != 0, &arrived) == arrived ? 1 : 0;
}
inline int __syncthreads_or(int p) { return ort_emu_syncthreads_count(p != 0, nullptr) > 0 ? 1 : 0; }
inline int __syncthreads_count(int p) { return ort_emu_syncthreads_count(p != 0, nullptr); }

template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    bits = ort_emu_shfl_xor(mask, bits, lane_mask);
    T r;
    memcpy(&r, &bits, sizeof(T));
    return r;
}

inline unsigned __ballot_sync(unsigned mask, int pred) { return ort_emu_ballot(mask, pred); }

inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
// CUDA's adds that are never contracted into an FMA: the empty asm hides where `a` came from
inline float __fadd_rn(float a, float b) { __asm__("" : "+x"(a)); return a + b; }
inline double __dadd_rn(double a, double b) { __asm__("" : "+x"(a)); return a + b; }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }

// one OS thread runs every fiber, so a plain read-modify-write is atomic
template <typename T> inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }

#define ORT_DYNAMIC_SHARED(T, name) T* name = static_cast<T*>(ort_emu_dynamic_shared())
// a static of the kernel function, filled with 0xff bytes when the first thread of each block
// reaches its declaration
#define ORT_SHARED(T, name, dims) \
    static T name dims;           \
    ort_emu_fresh_shared(&name, sizeof name)

// CUDA's global min/max overloads
#define ORT_EMU_MINMAX(T)                                  \
    inline T min(T a, T b) { return b < a ? b : a; }       \
    inline T max(T a, T b) { return a < b ? b : a; }
ORT_EMU_MINMAX(int)
ORT_EMU_MINMAX(unsigned)
ORT_EMU_MINMAX(long long)
ORT_EMU_MINMAX(unsigned long long)
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
