//! The test models around attention's products that graph passes rewrite (tests/exec.rs runs
//! them on both backends): `qkv_select` (q/k/v taken from stacked parts by scalar Gathers, or
//! one Split where they take all: passes/selects_to_split.rs) and `folded_scores` (scaled and
//! transposed operands read by one FusedMatMul: passes/fold_matmul_transpose.rs).

use super::exec_models::{ints, new_model, op, weight, Model};
use super::support::*;
use crate::ir::{Attr, Attrs};
use crate::tensor::{DType, Tensor};

/// The tutorial's attention input: one projection to `parts` stacked slices, q, k, v the first
/// three, taken by three Gathers with scalar indices (nn.MultiheadAttention's
/// `unflatten(...).transpose(0, -2)...` then `unbind`), as the exporters write it; then q·k + v
/// and an output projection. With 3 parts selects_to_split makes the Gathers one Split (as in
/// the tutorial); with more they stay Gathers.
pub(super) fn qkv_select(rng: &mut Rng, parts: usize) -> Model {
    let (t, w) = (5, 8);
    let input = vec![2, t, w];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let w_in = weight(&mut g, &mut ws, "w_in", &[w, parts * w], rng);
    let h = op(&mut g, "in_proj", "MatMul", &[x, w_in], Attrs::default());
    let stacked = ints(&mut g, "stacked", &[2, t as i64, parts as i64, w as i64]);
    let h = op(&mut g, "unflatten", "Reshape", &[h, stacked], Attrs::default());
    let h = op(&mut g, "qkv_first", "Transpose", &[h], Attrs::default().with("perm", Attr::Ints(vec![2, 0, 1, 3])));
    let mut pick = |name: &str, i: i64| {
        let at = g.add_const(&format!("{name}_index"), Tensor::from_i64(vec![], vec![i]));
        op(&mut g, name, "Gather", &[h, at], Attrs::default().with("axis", Attr::Int(0)))
    };
    let (q, k, v) = (pick("select_q", 0), pick("select_k", 1), pick("select_v", 2));
    let qk = op(&mut g, "qk", "Mul", &[q, k], Attrs::default());
    let y = op(&mut g, "plus_v", "Add", &[qk, v], Attrs::default());
    let w_out = weight(&mut g, &mut ws, "w_out", &[w, 4], rng);
    let y = op(&mut g, "out_proj", "MatMul", &[y, w_out], Attrs::default());
    g.outputs.push(y);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

/// Attention scores without the rest of an attention (no fused attention takes it): q [2, 2, 6,
/// 4] from x, keys a weight [2, 5, 4] broadcast over the batch, `MatMul(Mul(q, 0.25),
/// Mul(Transpose(k), 0.5))`, which fold_matmul_transpose makes one FusedMatMul(q, k, transB,
/// alpha 0.125): its gradients are FusedMatMuls summed to q's and (over the batch) k's shapes.
pub(super) fn folded_scores(rng: &mut Rng) -> Model {
    let input = vec![2, 6, 8];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let wq = weight(&mut g, &mut ws, "wq", &[8, 8], rng);
    let keys = weight(&mut g, &mut ws, "keys", &[2, 5, 4], rng);
    let h = op(&mut g, "q_mm", "MatMul", &[x, wq], Attrs::default());
    let heads = ints(&mut g, "heads", &[2, 6, 2, 4]);
    let h = op(&mut g, "q_split", "Reshape", &[h, heads], Attrs::default());
    let q = op(&mut g, "q_t", "Transpose", &[h], Attrs::default().with("perm", Attr::Ints(vec![0, 2, 1, 3])));
    let kt = op(&mut g, "k_t", "Transpose", &[keys], Attrs::default().with("perm", Attr::Ints(vec![0, 2, 1])));
    let (quarter, half) = (g.add_const("quarter", Tensor::scalar_f32(0.25)), g.add_const("half", Tensor::scalar_f32(0.5)));
    let qs = op(&mut g, "q_scaled", "Mul", &[q, quarter], Attrs::default());
    let ks = op(&mut g, "k_scaled", "Mul", &[half, kt], Attrs::default());
    let s = op(&mut g, "scores", "MatMul", &[qs, ks], Attrs::default());
    let y = op(&mut g, "probs", "Softmax", &[s], Attrs::default().with("axis", Attr::Int(-1)));
    g.outputs.push(y);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}
