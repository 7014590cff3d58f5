//! The f32 gemms of mixed-precision sessions (`precision="bf16"` / `"fp16"`, [`F32Mode::Bf16`] /
//! [`F32Mode::F16`]) as true 16-bit gemms: both operands are rounded to bf16 (or f16) into the
//! runtime's operand scratch by the cast kernels (nearest even, overflow to inf, as PyTorch's
//! `.to(torch.bfloat16)`), then multiplied by cuBLAS with bf16 (f16) inputs, f32 accumulation
//! and the f32 result: autocast's numerics for the product, with the output kept f32.
//!
//! Why: asked for `CUBLAS_COMPUTE_32F_FAST_16BF` on f32 operands, cuBLAS ran TF32 kernels on an
//! H100 (doc/GPU-RUNS.md, 2026-11-23): half of bf16's tensor-core rate, and f32 operands to
//! read. The casts read 4 and write 2 bytes per operand element, a small part of a large
//! product's time (GPT-2 124M's [16384, 768] activations: 50 MB, ~25 µs at 3 TB/s, against
//! ~100 µs for its gemm at bf16 rate).
//!
//! An operand is rounded as the span of memory from its first to its last element, in the same
//! layout (row strides and batch strides in elements carry over); a view whose span is over 4×
//! the elements the product reads (a narrow column slice of a wide buffer) is multiplied as f32
//! in the session's FAST mode instead.

use super::blas::{F32Mode, Gemm, GemmType};

/// The 16-bit type this gemm's f32 operands are multiplied in; None: the gemm runs as it is.
pub fn half_type(g: &Gemm) -> Option<GemmType> {
    if g.ab_type != GemmType::F32 || g.batch == 0 || g.m == 0 || g.n == 0 || g.k == 0 {
        return None;
    }
    let t = match g.f32_mode {
        F32Mode::Bf16 => GemmType::Bf16,
        F32Mode::F16 => GemmType::F16,
        F32Mode::Exact | F32Mode::Tf32 => return None,
    };
    let worth = |span: usize, stride: usize, rows: usize, cols: usize| span <= 4 * distinct(g.batch, stride) * rows * cols;
    (worth(span_a(g), g.stride_a, g.m, g.k) && worth(span_b(g), g.stride_b, g.k, g.n)).then_some(t)
}

/// Matrices an operand really has: one when its batch stride is 0 (broadcast).
fn distinct(batch: usize, stride: usize) -> usize {
    if stride == 0 {
        1
    } else {
        batch
    }
}

/// Elements from A's first to its last (A[b] is m×k, k×m when transposed, row stride lda).
pub fn span_a(g: &Gemm) -> usize {
    let (rows, cols) = if g.trans_a { (g.k, g.m) } else { (g.m, g.k) };
    span(g.batch, g.stride_a, rows, cols, g.lda)
}

/// Elements from B's first to its last (B[b] is k×n, n×k when transposed, row stride ldb).
pub fn span_b(g: &Gemm) -> usize {
    let (rows, cols) = if g.trans_b { (g.n, g.k) } else { (g.k, g.n) };
    span(g.batch, g.stride_b, rows, cols, g.ldb)
}

fn span(batch: usize, stride: usize, rows: usize, cols: usize, ld: usize) -> usize {
    if batch == 0 || rows == 0 || cols == 0 {
        return 0;
    }
    (batch - 1) * stride + (rows - 1) * ld + cols
}

/// Byte offset of B's copy in the operand scratch (after A's, 256-byte aligned for cuBLAS).
pub fn b_offset(g: &Gemm, t: GemmType) -> usize {
    (span_a(g) * t.size()).next_multiple_of(256)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemm(batch: usize, m: usize, n: usize, k: usize, ta: bool, tb: bool, mode: F32Mode) -> Gemm {
        Gemm { f32_mode: mode, ..Gemm::contiguous(batch, m, n, k, ta, tb, GemmType::F32) }
    }

    /// The span holds every element the product reads: the largest offset cuBLAS computes
    /// from the description (last batch, last row, last column) is span - 1, for every layout.
    #[test]
    fn spans_end_at_the_last_element_read() {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            for batch in [1, 3] {
                let g = gemm(batch, 5, 7, 4, ta, tb, F32Mode::Bf16);
                let last = |stride: usize, rows: usize, cols: usize, ld: usize| (batch - 1) * stride + (rows - 1) * ld + (cols - 1);
                let (ar, ac) = if ta { (4, 5) } else { (5, 4) };
                let (br, bc) = if tb { (7, 4) } else { (4, 7) };
                assert_eq!(span_a(&g), last(g.stride_a, ar, ac, g.lda) + 1);
                assert_eq!(span_b(&g), last(g.stride_b, br, bc, g.ldb) + 1);
                // contiguous operands: exactly their elements
                assert_eq!(span_a(&g), batch * 20);
                assert_eq!(span_b(&g), batch * 28);
            }
        }
    }

    #[test]
    fn only_mixed_precision_f32_gemms_are_rounded() {
        assert_eq!(half_type(&gemm(2, 4, 4, 4, false, false, F32Mode::Bf16)), Some(GemmType::Bf16));
        assert_eq!(half_type(&gemm(2, 4, 4, 4, false, false, F32Mode::F16)), Some(GemmType::F16));
        assert_eq!(half_type(&gemm(2, 4, 4, 4, false, false, F32Mode::Tf32)), None);
        assert_eq!(half_type(&gemm(2, 4, 4, 4, false, false, F32Mode::Exact)), None);
        let f64g = Gemm { f32_mode: F32Mode::Bf16, ..Gemm::contiguous(1, 4, 4, 4, false, false, GemmType::F64) };
        assert_eq!(half_type(&f64g), None);
        assert_eq!(half_type(&gemm(1, 4, 4, 0, false, false, F32Mode::Bf16)), None, "k = 0: nothing to round");
    }

    #[test]
    fn broadcast_operands_are_rounded_once_and_sparse_views_not_at_all() {
        // a weight shared by every batch entry (stride 0): one matrix
        let g = Gemm { stride_b: 0, ..gemm(8, 16, 32, 64, false, false, F32Mode::Bf16) };
        assert_eq!(span_b(&g), 64 * 32);
        assert!(half_type(&g).is_some());
        // 8 columns of a 1000-column buffer: the span is 125x what is read
        let g = Gemm { lda: 1000, ..gemm(1, 100, 16, 8, false, false, F32Mode::Bf16) };
        assert_eq!(half_type(&g), None);
        assert_eq!(b_offset(&gemm(1, 3, 4, 5, false, false, F32Mode::Bf16), GemmType::Bf16), 256);
    }
}
