//! wgrad_f32 (CUDA sessions, on the train graph after autodiff): the gradient of an f32 weight
//! that the forward pass cast to 16 bits (autocast's copies of GPT-2's projection weights), when
//! a product computes it, `CastLike(FusedMatMul(A, B), W)`, becomes that product writing f32
//! itself (FusedMatMul's `to`, ops/matmul.rs): cuBLAS accumulates in f32 anyway, so the 16-bit
//! result and the kernel widening it go, and the gradient is no longer rounded to 16 bits on
//! its way to the f32 weight (PyTorch's autocast rounds it: ortrain's is the more exact).
//! GPT-2 124M, bf16: 48 kernels fewer a step (bench/gpu_roofline.py). The same for a bias
//! whose gradient is a sum of 16-bit rows, `CastLike(ReduceSumTo(dY, shape), b)` (GPT-2's
//! c_attn bias: 12 kernels): the sum, a product with ones on CUDA, writes f32 (ReduceSumTo's
//! `to`, ops/internal.rs).
//!
//! The product's result is 16-bit because it is the gradient of the forward Cast of W to a
//! 16-bit type (a value's gradient has the value's type). Only where that Cast exists, W is
//! declared f32, and the CastLike is the product's one reader.

use crate::ir::{Attr, Graph, NodeId};
use crate::tensor::DType;

/// Rewrites the train graph whose first `n_fwd` nodes are the forward pass; returns how many
/// weight gradients the products now write in f32.
pub fn run(graph: &mut Graph, n_fwd: usize) -> usize {
    let consumers = graph.consumers();
    let n_fwd = n_fwd.min(graph.nodes.len());
    // f32 values the forward pass casts to 16 bits
    let mut halved = vec![false; graph.values.len()];
    for node in &graph.nodes[..n_fwd] {
        let to = node.attrs.int("to", 0).ok().and_then(|c| DType::from_onnx(c as i32));
        if let (Some(x), true) = (node.input(0), node.op_type == "Cast" && to.is_some_and(DType::is_half)) {
            halved[x.0] = graph.value(x).dtype == Some(DType::F32);
        }
    }
    let mut folds = Vec::new();
    for (c, cast) in graph.nodes.iter().enumerate().skip(n_fwd) {
        let (Some(v), Some(w)) = (cast.input(0), cast.input(1)) else { continue };
        if cast.op_type != "CastLike" || !halved[w.0] || cast.outputs.len() != 1 {
            continue;
        }
        let Some(p) = graph.value(v).producer.filter(|p| p.0 >= n_fwd) else { continue };
        let mm = &graph.nodes[p.0];
        let sole = consumers[v.0] == [(NodeId(c), 0)] && !graph.outputs.contains(&v);
        // a weight's product, or a bias's sum over rows (ReduceSumTo: the same product with ones)
        let writes_f32 = matches!(mm.op_type.as_str(), "FusedMatMul" | "ReduceSumTo");
        if writes_f32 && mm.outputs.len() == 1 && mm.attrs.get("to").is_none() && sole {
            folds.push((p.0, c));
        }
    }
    for &(p, c) in &folds {
        let out = graph.nodes[c].outputs[0];
        let mm = &mut graph.nodes[p];
        mm.outputs[0] = out;
        mm.attrs = std::mem::take(&mut mm.attrs).with("to", Attr::Int(DType::F32.onnx_code() as i64));
    }
    if !folds.is_empty() {
        let mut gone = vec![false; graph.nodes.len()];
        folds.iter().for_each(|&(_, c)| gone[c] = true);
        super::drop_nodes(graph, &gone);
    }
    folds.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, Dim, ValueKind};

    /// x [4, 8] bf16 → MatMul(x, Cast(w [8, 16] f32 → bf16)) → y, with w's gradient built by
    /// autodiff: a FusedMatMul of bf16 x and dy, cast back to f32 by the Cast's CastLike.
    fn cast_weight_product(w_type: DType) -> (Graph, usize) {
        let mut g = Graph::default();
        let dims = |d: &[usize]| Some(d.iter().map(|&v| Dim::Known(v)).collect());
        let x = g.add_value("x", ValueKind::Input, Some(DType::BF16), dims(&[4, 8]));
        let w = g.add_value("w", ValueKind::Weight, Some(w_type), dims(&[8, 16]));
        g.inputs.push(x);
        let to = Attrs::default().with("to", Attr::Int(DType::BF16.onnx_code() as i64));
        let w16 = g.add_node("w_cast", "Cast", vec![Some(w)], to, 1)[0];
        let y = g.add_node("mm", "MatMul", vec![Some(x), Some(w16)], Attrs::default(), 1)[0];
        g.outputs.push(y);
        let n_fwd = g.nodes.len();
        let seed = g.add_value("grad:y", ValueKind::Input, Some(DType::BF16), None);
        crate::autodiff::build(&mut g, &[y], &[Some(seed)], &[w]).expect("autodiff");
        (g, n_fwd)
    }

    #[test]
    fn the_weight_gradients_product_writes_f32() {
        let (mut g, n_fwd) = cast_weight_product(DType::F32);
        let cast = g.nodes[n_fwd..].iter().find(|n| n.op_type == "CastLike").expect("the Cast's gradient");
        let grad = cast.outputs[0];
        assert_eq!(run(&mut g, n_fwd), 1);
        assert!(g.nodes.iter().all(|n| n.op_type != "CastLike"), "the CastLike goes");
        let mm = &g.nodes[g.value(grad).producer.expect("written").0];
        assert_eq!(mm.op_type, "FusedMatMul");
        assert_eq!(mm.attrs.int("to", 0).ok(), Some(DType::F32.onnx_code() as i64));
    }

    /// x·w16 + Cast(b [16] f32 → bf16): the bias's gradient is a ReduceSumTo of the bf16 dY
    /// rows, cast back to f32; it sums into f32 itself, as the weight's product does.
    #[test]
    fn the_bias_gradients_sum_writes_f32() {
        let mut g = Graph::default();
        let dims = |d: &[usize]| Some(d.iter().map(|&v| Dim::Known(v)).collect());
        let x = g.add_value("x", ValueKind::Input, Some(DType::BF16), dims(&[4, 8]));
        let w = g.add_value("w", ValueKind::Weight, Some(DType::F32), dims(&[8, 16]));
        let b = g.add_value("b", ValueKind::Weight, Some(DType::F32), dims(&[16]));
        g.inputs.push(x);
        let to = || Attrs::default().with("to", Attr::Int(DType::BF16.onnx_code() as i64));
        let w16 = g.add_node("w_cast", "Cast", vec![Some(w)], to(), 1)[0];
        let b16 = g.add_node("b_cast", "Cast", vec![Some(b)], to(), 1)[0];
        let mm = g.add_node("mm", "MatMul", vec![Some(x), Some(w16)], Attrs::default(), 1)[0];
        let y = g.add_node("bias", "Add", vec![Some(mm), Some(b16)], Attrs::default(), 1)[0];
        g.outputs.push(y);
        let n_fwd = g.nodes.len();
        let seed = g.add_value("grad:y", ValueKind::Input, Some(DType::BF16), None);
        let grads = crate::autodiff::build(&mut g, &[y], &[Some(seed)], &[w, b]).expect("autodiff").grads;
        assert_eq!(run(&mut g, n_fwd), 2, "the weight's product and the bias's sum");
        assert!(g.nodes.iter().all(|n| n.op_type != "CastLike"));
        let db = &g.nodes[g.value(grads[1].expect("db")).producer.expect("written").0];
        assert_eq!(db.op_type, "ReduceSumTo");
        assert_eq!(db.attrs.int("to", 0).ok(), Some(DType::F32.onnx_code() as i64));
    }

    #[test]
    fn a_weight_not_declared_f32_keeps_its_cast() {
        let (mut g, n_fwd) = cast_weight_product(DType::F64);
        assert_eq!(run(&mut g, n_fwd), 0);
    }
}
