//! matmul_gelu_grad (CUDA sessions, on the train graph after autodiff): the gradient through a
//! tanh GELU of a product that nothing else reads, `GeluGrad(views(FusedMatMul(A, B)), X)`
//! (GPT-2's MLP: the projection's dX taken back through the GELU), becomes one
//! MatMulGeluGrad(A, B, X) (ops/matmul_gelu_grad.rs) whose output the views then show, and a
//! bias gradient summing it over every row, `ReduceSumTo(views, [N])` (a Gemm's, as GPT-2's
//! first MLP projection has) or `SumRows(FlattenRows(·))` (a Linear's), its output 1:
//! cuBLASLt's DGELU epilogue multiplies each element of the product by the GELU's slope as it
//! writes it and sums the rows (backend/cuda/blas_lt.rs, DGELU_BGRAD), so the product is
//! neither stored nor read back and the gradient is not read again for the sums; the product is
//! rounded once instead of twice. GPT-2 124M, bf16, batch 16 × 1024: per layer two kernels and
//! 300 MB of traffic fewer (bench/gpu_roofline.py).
//!
//! Only where the product is a plain one (alpha 1, B of two dims, A of two dims or rows of any
//! leading dims untransposed, no target shape that could sum a batch), every value between it
//! and the GeluGrad has that one reader, and X exists before the product runs. The fused node
//! writes the product's shape, so the views after it see what they saw.

use super::sym_shape::{matmul_n, shape_of, values, SymDim};
use crate::ir::{Attr, Attrs, Graph, NodeId, ValueId};

/// Views the gradient reaches the GeluGrad through (Linear's gradient reshapes its dX back to
/// X's shape; a MatMul's through Reshape).
const VIEWS: &[&str] = &["Reshape", "FlattenRows", "Flatten", "Squeeze", "Unsqueeze", "Identity"];

/// A fusion found: the GeluGrad, the product, the node whose output the GeluGrad read, and
/// the ReduceSumTo summing the gradient into a bias gradient, if one does.
struct Found {
    grad: usize,
    product: usize,
    last: usize,
    bias_sum: Option<usize>,
}

/// The one element of the shape tensor `t`: a known one, or the whole Shape of a 1-D value.
fn one_element(graph: &Graph, t: ValueId) -> Option<SymDim> {
    if let Some([d]) = values(graph, t).as_deref() {
        return Some(d.clone());
    }
    match shape_of(graph, shape_source(graph, t)?)?.as_slice() {
        [d] => Some(d.clone()),
        _ => None,
    }
}

/// The value whose whole Shape `t` is (a Shape node without start or end).
fn shape_source(graph: &Graph, t: ValueId) -> Option<ValueId> {
    let p = &graph.nodes[graph.value(t).producer?.0];
    let whole = p.op_type == "Shape" && p.attrs.get("start").is_none() && p.attrs.get("end").is_none();
    whole.then(|| p.input(0)).flatten()
}

/// The bias gradient summing `grad` (the GeluGrad's output: X's shape, so rows of N) over every
/// row: a `ReduceSumTo(v, [n])` of it or of a view of it (autodiff's for a Gemm's bias, `n` the
/// product's N), or a `SumRows(FlattenRows(grad))` (a Linear's).
fn bias_sum_of(graph: &Graph, consumers: &[Vec<(NodeId, usize)>], grad: ValueId, n: &SymDim) -> Option<usize> {
    let mut stack = vec![grad];
    while let Some(v) = stack.pop() {
        for &(c, slot) in &consumers[v.0] {
            let node = &graph.nodes[c.0];
            if slot != 0 || node.outputs.len() != 1 {
                continue;
            }
            if node.op_type == "ReduceSumTo" && node.input(1).and_then(|t| one_element(graph, t)).as_ref() == Some(n) {
                return Some(c.0);
            }
            if v == grad && node.op_type == "FlattenRows" {
                let rows = node.outputs[0];
                if let Some(&(s, _)) = consumers[rows.0].iter().find(|(s, k)| *k == 0 && graph.nodes[s.0].op_type == "SumRows") {
                    return Some(s.0);
                }
            }
            if VIEWS.contains(&node.op_type.as_str()) {
                stack.push(node.outputs[0]);
            }
        }
    }
    None
}

/// The FusedMatMul behind `dy` (through views, each value read once) that GeluGrad `grad` can
/// absorb, and the node writing `dy`.
fn product_behind(graph: &Graph, consumers: &[Vec<(NodeId, usize)>], grad: usize, dy: ValueId) -> Option<(usize, usize)> {
    let only_reader = |v: ValueId, reader: usize, slot: usize| consumers[v.0] == [(NodeId(reader), slot)] && !graph.outputs.contains(&v);
    let last = graph.value(dy).producer?.0;
    let (mut v, mut reader, mut at) = (dy, grad, last);
    if !only_reader(v, reader, 0) {
        return None;
    }
    loop {
        let node = &graph.nodes[at];
        if node.outputs.len() != 1 {
            return None;
        }
        if !VIEWS.contains(&node.op_type.as_str()) {
            break;
        }
        (reader, v) = (at, node.input(0)?);
        at = graph.value(v).producer?.0;
        if !only_reader(v, reader, 0) {
            return None;
        }
    }
    let mm = &graph.nodes[at];
    let two_d = |i: usize| mm.input(i).and_then(|x| rank(graph, x, 8)) == Some(2);
    // A's rows are any leading dims where A is not transposed and no target shape (a MatMul's
    // gradient takes its operand's) decides the product's; a target of two dims over a 2-D A
    // sums nothing
    let a_ok = match mm.input(2) {
        None => mm.attrs.int("transA", 0).ok() == Some(0) || two_d(0),
        Some(t) => two_elements(graph, t) && two_d(0),
    };
    let plain = mm.op_type == "FusedMatMul"
        && mm.inputs.len() <= 3
        && mm.attrs.float("alpha", 1.0).ok() == Some(1.0)
        && mm.attrs.get("to").is_none();
    (plain && a_ok && two_d(1)).then_some((at, last))
}

/// Whether the shape tensor `t` has two elements: a known one, or the whole Shape of a 2-D value.
fn two_elements(graph: &Graph, t: ValueId) -> bool {
    if values(graph, t).is_some_and(|v| v.len() == 2) {
        return true;
    }
    shape_source(graph, t).and_then(|x| rank(graph, x, 8)) == Some(2)
}

/// The rank of `v` where it is proven: its symbolic shape, or through the ops a gradient's
/// operands come from (FlattenRows gives two dims; a cast keeps its input's).
fn rank(graph: &Graph, v: ValueId, depth: usize) -> Option<usize> {
    if let Some(s) = shape_of(graph, v) {
        return Some(s.len());
    }
    let p = &graph.nodes[graph.value(v).producer?.0];
    match p.op_type.as_str() {
        "FlattenRows" => Some(2),
        "Cast" | "CastLike" | "Identity" if depth > 0 => rank(graph, p.input(0)?, depth - 1),
        _ => None,
    }
}

/// Rewrites the train graph whose first `n_fwd` nodes are the forward pass; returns how many
/// GELU gradients now come out of their product.
pub fn run(graph: &mut Graph, n_fwd: usize) -> usize {
    let consumers = graph.consumers();
    let mut found: Vec<Found> = Vec::new();
    for g in n_fwd..graph.nodes.len() {
        let node = &graph.nodes[g];
        let tanh = node.attrs.string("approximate", "none").is_ok_and(|a| a == "tanh");
        if node.op_type != "GeluGrad" || !tanh || node.outputs.len() != 1 || graph.outputs.contains(&node.outputs[0]) {
            continue;
        }
        let (Some(dy), Some(x)) = (node.input(0), node.input(1)) else { continue };
        let Some((product, last)) = product_behind(graph, &consumers, g, dy) else { continue };
        // X is read where the product runs now
        if graph.value(x).producer.is_some_and(|p| p.0 >= product) {
            continue;
        }
        let n = matmul_n(graph, &graph.nodes[product]);
        let bias_sum = n.and_then(|n| bias_sum_of(graph, &consumers, node.outputs[0], &n));
        found.push(Found { grad: g, product, last, bias_sum });
    }
    for f in &found {
        let x = graph.nodes[f.grad].input(1);
        let out = graph.nodes[f.grad].outputs[0];
        if let Some(r) = f.bias_sum {
            // the fused node's output 1 is the ReduceSumTo's
            let sums = graph.nodes[r].outputs[0];
            graph.nodes[f.product].outputs.push(sums);
        }
        let mm = &mut graph.nodes[f.product];
        let flag = |k: &str| Attr::Int(mm.attrs.int(k, 0).unwrap_or(0));
        mm.attrs =
            Attrs::default().with("transA", flag("transA")).with("transB", flag("transB")).with("approximate", Attr::String("tanh".into()));
        mm.op_type = "MatMulGeluGrad".into();
        mm.name = format!("{}:gelu_grad", mm.name);
        mm.inputs.truncate(2);
        mm.inputs.push(x);
        // the views (or the product itself) now write what the GeluGrad wrote
        graph.nodes[f.last].outputs[0] = out;
    }
    let count = found.len();
    if count > 0 {
        let mut dropped = vec![false; graph.nodes.len()];
        for f in &found {
            dropped[f.grad] = true;
            if let Some(r) = f.bias_sum {
                dropped[r] = true;
            }
        }
        let nodes = std::mem::take(&mut graph.nodes);
        graph.nodes = nodes.into_iter().zip(dropped).filter_map(|(n, d)| (!d).then_some(n)).collect();
        graph.renumber_producers();
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Dim, ValueKind};
    use crate::tensor::{DType, Tensor};

    /// x [4, 8] → MatMul(W1) (Gemm(W1, b1) `with_bias`) → u → Gelu(`approximate`) → Reshape
    /// [2, 2, 16] → Reshape [4, 16] → MatMul(W2) → y, with autodiff's gradients of the weights.
    fn mlp(approximate: &str) -> (Graph, usize) {
        mlp_with(approximate, false)
    }

    fn mlp_with(approximate: &str, with_bias: bool) -> (Graph, usize) {
        let mut g = Graph::default();
        let x = g.add_value("x", ValueKind::Input, Some(DType::F32), Some(vec![Dim::Known(4), Dim::Known(8)]));
        let w1 = g.add_value("w1", ValueKind::Weight, Some(DType::F32), Some(vec![Dim::Known(8), Dim::Known(16)]));
        let b1 = g.add_value("b1", ValueKind::Weight, Some(DType::F32), Some(vec![Dim::Known(16)]));
        let w2 = g.add_value("w2", ValueKind::Weight, Some(DType::F32), Some(vec![Dim::Known(16), Dim::Known(8)]));
        let u = if with_bias {
            g.add_node("fc", "Gemm", vec![Some(x), Some(w1), Some(b1)], Attrs::default(), 1)[0]
        } else {
            g.add_node("fc", "MatMul", vec![Some(x), Some(w1)], Attrs::default(), 1)[0]
        };
        let gelu = Attrs::default().with("approximate", Attr::String(approximate.into()));
        let v = g.add_node("act", "Gelu", vec![Some(u)], gelu, 1)[0];
        let s3 = g.add_const("s3", Tensor::from_i64(vec![3], vec![2, 2, 16]));
        let s2 = g.add_const("s2", Tensor::from_i64(vec![2], vec![4, 16]));
        let v = g.add_node("view3", "Reshape", vec![Some(v), Some(s3)], Attrs::default(), 1)[0];
        let v = g.add_node("view2", "Reshape", vec![Some(v), Some(s2)], Attrs::default(), 1)[0];
        let y = g.add_node("proj", "MatMul", vec![Some(v), Some(w2)], Attrs::default(), 1)[0];
        g.outputs = vec![y];
        let n_fwd = g.nodes.len();
        let seed = g.add_value("grad:y", ValueKind::Input, Some(DType::F32), Some(vec![Dim::Known(4), Dim::Known(8)]));
        let weights = if with_bias { vec![w1, b1, w2] } else { vec![w1, w2] };
        crate::autodiff::build(&mut g, &[y], &[Some(seed)], &weights).expect("autodiff");
        (g, n_fwd)
    }

    fn count(g: &Graph, op: &str) -> usize {
        g.nodes.iter().filter(|n| n.op_type == op).count()
    }

    #[test]
    fn a_tanh_gelu_gradient_comes_out_of_its_product() {
        let (mut g, n_fwd) = mlp("tanh");
        let grad = g.nodes.iter().find(|n| n.op_type == "GeluGrad").expect("GeluGrad").clone();
        let (out, u) = (grad.outputs[0], grad.input(1));
        let readers_before: Vec<String> = g.nodes.iter().filter(|n| n.inputs.contains(&Some(out))).map(|n| n.name.clone()).collect();
        assert_eq!(run(&mut g, n_fwd), 1);
        assert_eq!(count(&g, "GeluGrad"), 0);
        let fused = g.nodes.iter().find(|n| n.op_type == "MatMulGeluGrad").expect("fused node");
        assert_eq!(fused.input(2), u, "reads the GELU's input");
        assert_eq!(fused.attrs.string("approximate", "").expect("attr"), "tanh");
        assert!(fused.attrs.get("alpha").is_none());
        // the GeluGrad's output is now written by the views of the fused product, and read as before
        let writer = &g.nodes[g.value(out).producer.expect("written").0];
        assert!(writer.op_type == "Reshape" || writer.op_type == "MatMulGeluGrad", "{}", writer.op_type);
        let readers_after: Vec<String> = g.nodes.iter().filter(|n| n.inputs.contains(&Some(out))).map(|n| n.name.clone()).collect();
        assert_eq!(readers_before, readers_after);
        let fused_at = g.nodes.iter().position(|n| n.op_type == "MatMulGeluGrad").expect("fused");
        assert!(g.value(u.expect("u")).producer.is_some_and(|p| p.0 < fused_at));
        for (i, n) in g.nodes.iter().enumerate() {
            for o in &n.outputs {
                assert_eq!(g.values[o.0].producer, Some(NodeId(i)), "producers renumbered");
            }
        }
    }

    #[test]
    fn the_bias_gradient_of_the_layer_before_comes_out_too() {
        let (mut g, n_fwd) = mlp_with("tanh", true);
        let sum = g.nodes.iter().find(|n| n.op_type == "ReduceSumTo").expect("the bias gradient's sum").outputs[0];
        assert_eq!(run(&mut g, n_fwd), 1);
        assert_eq!(count(&g, "ReduceSumTo"), 0);
        let fused = g.nodes.iter().find(|n| n.op_type == "MatMulGeluGrad").expect("fused node");
        assert_eq!(fused.outputs.len(), 2);
        assert_eq!(fused.outputs[1], sum, "output 1 is the bias gradient");
        // without a bias, one output
        let (mut g, n_fwd) = mlp("tanh");
        run(&mut g, n_fwd);
        assert_eq!(g.nodes.iter().find(|n| n.op_type == "MatMulGeluGrad").expect("fused").outputs.len(), 1);
    }

    #[test]
    fn an_exact_gelu_keeps_its_gradient() {
        // cuBLASLt's GELU is the tanh approximation
        let (mut g, n_fwd) = mlp("none");
        assert_eq!(run(&mut g, n_fwd), 0);
        assert_eq!(count(&g, "GeluGrad"), 1);
    }

    #[test]
    fn a_product_read_elsewhere_is_kept() {
        let (mut g, n_fwd) = mlp("tanh");
        let grad = g.nodes.iter().find(|n| n.op_type == "GeluGrad").expect("GeluGrad").clone();
        let dy = grad.input(0).expect("dy");
        let extra = g.add_node("extra", "Neg", vec![Some(dy)], Attrs::default(), 1)[0];
        g.outputs.push(extra);
        assert_eq!(run(&mut g, n_fwd), 0);
        assert_eq!(count(&g, "MatMulGeluGrad"), 0);
    }
}
