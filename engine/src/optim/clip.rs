//! Gradient clipping by global L2 norm over many tensors, each pass one parallel region over all
//! tensors' chunks (as `adam_many`): the norm (per-tensor sums of squares in f64, each tensor's
//! norm rounded to f32 as torch's per-gradient norms are, then the norm of those) and the
//! in-place scaling by the clip coefficient.

use rayon::prelude::*;

use super::CHUNK;
use crate::simd::multiversion;

/// Independent f64 accumulators per chunk: lanes LLVM keeps in vector registers.
const LANES: usize = 16;

#[inline(always)]
fn squares_body<const FMA: bool>(x: &[f32]) -> f64 {
    let mut acc = [0f64; LANES];
    let mut blocks = x.chunks_exact(LANES);
    for b in &mut blocks {
        for (a, &v) in acc.iter_mut().zip(b) {
            let v = v as f64;
            *a = if FMA { v.mul_add(v, *a) } else { *a + v * v };
        }
    }
    let tail: f64 = blocks.remainder().iter().map(|&v| (v as f64) * (v as f64)).sum();
    acc.iter().sum::<f64>() + tail
}
multiversion!(squares, squares_body, (x: &[f32]) -> f64);

#[inline(always)]
fn scale_body<const FMA: bool>(x: &mut [f32], s: f32) {
    x.iter_mut().for_each(|v| *v *= s);
}
multiversion!(scale_chunk, scale_body, (x: &mut [f32], s: f32) -> ());

/// Σ x² of each tensor, in f64, all tensors' chunks in one parallel pass.
pub fn sum_squares_many(tensors: &[&[f32]]) -> Vec<f64> {
    let chunks: Vec<(usize, &[f32])> = tensors.iter().enumerate().flat_map(|(i, t)| t.chunks(CHUNK).map(move |c| (i, c))).collect();
    let partial: Vec<(usize, f64)> = chunks.into_par_iter().map(|(i, c)| (i, squares::call(c))).collect();
    let mut out = vec![0f64; tensors.len()];
    for (i, s) in partial {
        out[i] += s;
    }
    out
}

/// The L2 norm of all tensors seen as one vector, computed as torch.nn.utils.clip_grad_norm_
/// does: each tensor's norm as an f32, then the norm of those norms (rounded to f32).
pub fn global_norm(tensors: &[&[f32]]) -> f32 {
    let per_tensor = sum_squares_many(tensors).into_iter().map(|s| s.sqrt() as f32);
    per_tensor.map(|n| (n as f64) * (n as f64)).sum::<f64>().sqrt() as f32
}

/// torch.nn.utils.clip_grad_norm_'s coefficient `clamp(max_norm / (total + 1e-6), max=1)` as
/// torch computes it on the 0-dim f32 norm: `total + 1e-6` in f32, `max_norm / x` as
/// `x.reciprocal() * max_norm` (Tensor.__rtruediv__) in f32, the clamp keeping NaN.
pub fn clip_coefficient(total: f32, max_norm: f64) -> f32 {
    let c = (1.0f32 / (total + 1e-6f64 as f32)) * max_norm as f32;
    if c > 1.0 {
        1.0
    } else {
        c
    }
}

/// Multiplies every element of every tensor by `s` in place, in one parallel pass.
pub fn scale_many(tensors: Vec<&mut [f32]>, s: f32) {
    let chunks: Vec<&mut [f32]> = tensors.into_iter().flat_map(|t| t.chunks_mut(CHUNK)).collect();
    chunks.into_par_iter().for_each(|c| scale_chunk::call(c, s));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 20_001) as f32 / 10_000.0 - 1.0).collect()
    }

    #[test]
    fn sums_of_squares_match_f64_definitions_per_tensor() {
        // sizes around the chunk and lane edges, and an empty tensor
        let sizes = [0usize, 1, 15, 16, 17, CHUNK - 1, CHUNK, CHUNK + 17, 3 * CHUNK + 5];
        let ts: Vec<Vec<f32>> = sizes.iter().enumerate().map(|(i, &n)| data(n, i as u32)).collect();
        let views: Vec<&[f32]> = ts.iter().map(|t| &t[..]).collect();
        let got = sum_squares_many(&views);
        for (t, g) in ts.iter().zip(&got) {
            let want: f64 = t.iter().map(|&v| (v as f64) * (v as f64)).sum();
            assert!((g - want).abs() <= 1e-12 * want.max(1.0), "{g} vs {want}");
        }
    }

    #[test]
    fn global_norm_is_the_norm_of_per_tensor_f32_norms() {
        let (a, b) = (data(1000, 1), data(CHUNK + 3, 2));
        let na = (a.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt()) as f32;
        let nb = (b.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt()) as f32;
        let want = ((na as f64).powi(2) + (nb as f64).powi(2)).sqrt() as f32;
        assert_eq!(global_norm(&[&a, &b]), want);
        assert_eq!(global_norm(&[]), 0.0);
        let nan = vec![1.0, f32::NAN];
        assert!(global_norm(&[&a, &nan]).is_nan());
    }

    #[test]
    fn the_coefficient_is_torchs_f32_arithmetic() {
        // reciprocal then product, not a quotient: for 0.3 / 7.0 they differ in the last bit
        let total = 7.0f32 - 1e-6;
        let r = 1.0f32 / (total + 1e-6f32);
        assert_eq!(clip_coefficient(total, 0.3).to_bits(), (r * 0.3f32).to_bits());
        assert_eq!(clip_coefficient(0.1, 0.5), 1.0);
        assert!(clip_coefficient(f32::NAN, 0.5).is_nan());
        assert_eq!(clip_coefficient(f32::INFINITY, 0.5), 0.0);
    }

    #[test]
    fn scaling_multiplies_every_element_once() {
        let (mut a, mut b) = (data(CHUNK * 2 + 7, 3), data(5, 4));
        let (a0, b0) = (a.clone(), b.clone());
        scale_many(vec![&mut a, &mut b], 0.37);
        for (x, x0) in a.iter().chain(&b).zip(a0.iter().chain(&b0)) {
            assert_eq!(x.to_bits(), (x0 * 0.37).to_bits());
        }
    }
}
