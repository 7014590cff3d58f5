// Data movement (engine/src/ops/movement.rs: Transpose, Expand, Slice and SliceGrad, Concat and
// ConcatGrad, Split, Trilu; CPU kernels engine/src/backend/cpu/movement.rs). These only move
// bits, so they are instantiated per element width W: u8 u16 u32 u64 (u32 serves f32 and i32,
// u16 bf16 and f16, u64 f64 and i64, u8 bool, u8 and i8).
//
//   copy_W(const W* x, W* y, Strides s, i64 n)
//       for each of the n elements of the index space `s.dims`: y[offset 1] = x[offset 0].
//       Operand 0 addresses the source, operand 1 the destination (strides and base offset):
//         Transpose  source strides permuted, destination contiguous
//         Expand     source strides 0 on broadcast dimensions
//         Slice      source strides times the steps (negative allowed), base at the starts
//         Concat     one launch per input: destination strides of the output, base at the
//                    input's offset along the axis (Split and ConcatGrad: the reverse)
//         SliceGrad  fill_W with 0, then copy_W into the sliced positions (they are distinct)
//   copy_v16(const v16* x, v16* y, Strides s, i64 n)
//       copy_W over 16-byte elements (the host's vector form of a copy, below)
//   fill_W(W* y, i64 n, u64 bits)                    y[i] = the low bits of `bits`
//   trilu_W(const W* x, W* y, i64 n, i64 rows, i64 cols, i32 upper, i64 k, const i64* k_at)
//       keeps j - i >= k (upper) or j - i <= k (lower) of each [rows, cols] matrix, else 0;
//       k read from device memory at k_at when it is not null (a k computed in the step)

#include "prelude.cuh"

#define COPY(op, W)                                                                           \
    extern "C" __global__ void copy_##W(const W* x, W* y, Strides s, i64 n) {                 \
        ORT_GRID_LOOP(i, n) {                                                                 \
            i64 o[2];                                                                         \
            strided_offsets<2>(s, i, o);                                                      \
            y[o[1]] = x[o[0]];                                                                \
        }                                                                                     \
    }                                                                                         \
    extern "C" __global__ void fill_##W(W* y, i64 n, u64 bits) {                              \
        const W v = (W)bits;                                                                  \
        ORT_GRID_LOOP(i, n) y[i] = v;                                                         \
    }                                                                                         \
    extern "C" __global__ void trilu_##W(const W* x, W* y, i64 n, i64 rows, i64 cols, i32 upper, i64 k, \
                                         const i64* k_at) {                                   \
        if (k_at) k = *k_at;                                                                  \
        ORT_GRID_LOOP(p, n) {                                                                 \
            const i64 j = p % cols, i = (p / cols) % rows;                                    \
            const bool keep = upper ? (j - i >= k) : (j - i <= k);                            \
            y[p] = keep ? x[p] : (W)0;                                                        \
        }                                                                                     \
    }
ORT_WIDTHS(COPY, _)

// 16 bytes as one element: the host (ops/movement.rs `vector_copy`) rewrites a copy whose
// innermost dimension is contiguous on both sides, in whole 16-byte vectors at 16-byte aligned
// addresses, into a copy of vectors, so each thread makes one 128-bit load and store.
struct alignas(16) v16 { u32 w[4]; };
extern "C" __global__ void copy_v16(const v16* x, v16* y, Strides s, i64 n) {
    ORT_GRID_LOOP(i, n) {
        i64 o[2];
        strided_offsets<2>(s, i, o);
        y[o[1]] = x[o[0]];
    }
}
