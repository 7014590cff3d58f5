//! The test models of pre-norm residual blocks (tests/exec.rs runs them on both backends):
//! `pre_norm_residual` (LayerNorm, the residual stream's gradient summed:
//! passes/layer_norm_grad_sum.rs) and `rms_pre_norm` (Llama's RMSNorm written out:
//! passes/fuse_rms_norm.rs).

use super::exec_models::{ints, new_model, op, weight, Model};
use super::support::*;
use crate::ir::{Attr, Attrs};
use crate::tensor::{DType, Tensor};

/// Two pre-norm residual blocks, h = h + LayerNorm(h)·W (the first a Gemm with a bias over
/// flattened rows, as GPT-2's Conv1D; the second a MatMul), on an f32 stream that starts as x plus
/// a learned position term (as GPT-2's embeddings) and ends in a final LayerNorm and head: the
/// stream's gradient is the sum of each LayerNormGrad's dx and the stream's own
/// (passes/layer_norm_grad_sum.rs), cast to 16 bits for the matmul before it in bf16 sessions.
pub(super) fn pre_norm_residual(rng: &mut Rng) -> Model {
    let input = vec![2, 5, 24];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let pos = weight(&mut g, &mut ws, "pos", &[5, 24], rng);
    let mut h = op(&mut g, "positions", "Add", &[x, pos], Attrs::default());
    for (i, width) in [(0, 24), (1, 24), (2, 6)] {
        let scale = weight(&mut g, &mut ws, &format!("ln{i}_scale"), &[24], rng);
        let bias = weight(&mut g, &mut ws, &format!("ln{i}_bias"), &[24], rng);
        let w = weight(&mut g, &mut ws, &format!("w{i}"), &[24, width], rng);
        let n = op(&mut g, &format!("ln{i}"), "LayerNormalization", &[h, scale, bias], Attrs::default().with("axis", Attr::Int(-1)));
        let y = if i == 0 {
            // Hugging Face GPT-2's Conv1D: rows flattened, addmm (a Gemm with its bias)
            let rows = ints(&mut g, "rows_shape", &[10, 24]);
            let flat = op(&mut g, "rows", "Reshape", &[n, rows], Attrs::default());
            let b = weight(&mut g, &mut ws, "b0", &[width], rng);
            op(&mut g, "mm0", "Gemm", &[flat, w, b], Attrs::default())
        } else {
            op(&mut g, &format!("mm{i}"), "MatMul", &[n, w], Attrs::default())
        };
        // Hugging Face's view of the projection's output (autocast keeps a matmul in f32 when only
        // a cast back reads its 16-bit result)
        let shape = ints(&mut g, &format!("view{i}_shape"), &[2, 5, width as i64]);
        let y = op(&mut g, &format!("view{i}"), "Reshape", &[y, shape], Attrs::default());
        h = if i < 2 { op(&mut g, &format!("residual{i}"), "Add", &[h, y], Attrs::default()) } else { y };
    }
    g.outputs.push(h);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

/// Llama-style pre-norm residual blocks, h = h + RMSNorm(h)·W, written out as Hugging Face's
/// LlamaRMSNorm exports (`w · (h · Reciprocal(Sqrt(ReduceMean(Pow(h, 2), [-1]) + eps)))`): the
/// first norm with a trained weight, the second without one (`1 / Sqrt`, the product the other
/// way round), rows of 24; passes/fuse_rms_norm.rs makes each one RmsNorm.
pub(super) fn rms_pre_norm(rng: &mut Rng) -> Model {
    let input = vec![2, 5, 24];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let two = g.add_const("two", Tensor::from_f32(vec![], vec![2.0]));
    let one = g.add_const("one", Tensor::from_f32(vec![], vec![1.0]));
    let axes = ints(&mut g, "axes", &[-1]);
    let eps = g.add_const("eps", Tensor::from_f32(vec![], vec![1e-6]));
    let mut h = x;
    for i in 0..2 {
        let none = Attrs::default;
        let sq = op(&mut g, &format!("pow{i}"), "Pow", &[h, two], none());
        let ms = op(&mut g, &format!("mean{i}"), "ReduceMean", &[sq, axes], none());
        let shifted = op(&mut g, &format!("eps{i}"), "Add", &[ms, eps], none());
        let rms = op(&mut g, &format!("sqrt{i}"), "Sqrt", &[shifted], none());
        let normed = if i == 0 {
            let r = op(&mut g, "rsqrt0", "Reciprocal", &[rms], none());
            let normed = op(&mut g, "normed0", "Mul", &[h, r], none());
            let w = weight(&mut g, &mut ws, "norm0_weight", &[24], rng);
            op(&mut g, "scaled0", "Mul", &[w, normed], none())
        } else {
            let r = op(&mut g, "rsqrt1", "Div", &[one, rms], none());
            op(&mut g, "normed1", "Mul", &[r, h], none())
        };
        let w = weight(&mut g, &mut ws, &format!("w{i}"), &[24, 24], rng);
        let y = op(&mut g, &format!("proj{i}"), "MatMul", &[normed, w], none());
        h = op(&mut g, &format!("residual{i}"), "Add", &[h, y], none());
    }
    g.outputs.push(h);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}
