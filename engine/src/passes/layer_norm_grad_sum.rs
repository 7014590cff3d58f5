//! layer_norm_grad_sum (CUDA sessions, on the train graph after autodiff): the two passes over
//! the residual stream's gradient that follow each LayerNormGrad in a pre-norm transformer go
//! into its dx kernel (ops/norm.rs, kernels/layernorm.cu `layer_norm_grad_acc_*`).
//!
//! - The Add summing LayerNormGrad's dx with the rest of x's gradient (autodiff's sum of the
//!   contributions, the residual branch's: of x's shape and type) becomes LayerNormGrad's input
//!   5, `dres`, added to dx as it is stored. LayerNormGrad then writes the Add's output.
//! - A cast of that sum to 16 bits (autocast's CastLike, the gradient of the cast to f32 after
//!   the block's output projection, read through the residual Add's ReduceSumTo) becomes
//!   LayerNormGrad's output 3 (`dx_half_type`), rounded as the cast kernel rounds.
//!
//! Both are the replaced kernels' arithmetic bit for bit: dx rounded to f32, one f32 add, one
//! rounding to 16 bits. GPT-2 124M, bf16: two kernels and 150 MB of traffic fewer per
//! LayerNorm (bench/gpu_roofline.py).

use super::autocast::forward_types;
use super::sym_shape::{shape_of, values, SymDim};
use crate::ir::{Attr, Graph, Node, NodeId, ValueId, ValueKind};
use crate::tensor::DType;

/// Rewrites the train graph whose first `n_fwd` nodes are the forward pass; returns how many
/// Adds and casts went into LayerNormGrads.
pub fn run(graph: &mut Graph, n_fwd: usize) -> usize {
    let types = forward_types(graph);
    let summed = absorb_sums(graph, n_fwd, &types);
    let cast = absorb_casts(graph, n_fwd, &types);
    summed + cast
}

/// Whether node `l` is a backward LayerNormGrad over f32 x.
fn grad_over_f32(graph: &Graph, l: usize, n_fwd: usize, types: &[Option<DType>]) -> bool {
    let node = &graph.nodes[l];
    l >= n_fwd && node.op_type == "LayerNormGrad" && node.input(1).and_then(|x| types[x.0]) == Some(DType::F32)
}

/// The Adds of a LayerNormGrad's dx (their only reader) and another gradient.
fn absorb_sums(graph: &mut Graph, n_fwd: usize, types: &[Option<DType>]) -> usize {
    let consumers = graph.consumers();
    let producer = |v: ValueId| graph.value(v).producer.map(|p| p.0);
    // (LayerNormGrad, Add, dres, whether the LayerNormGrad moves to the Add's place)
    let mut fused: Vec<(usize, usize, ValueId, bool)> = Vec::new();
    for a in n_fwd..graph.nodes.len() {
        let add = &graph.nodes[a];
        if !crate::autodiff::is_gradient_sum(add) || add.inputs.len() != 2 || add.outputs.len() != 1 {
            continue;
        }
        for side in 0..2 {
            let (Some(dx), Some(other)) = (add.input(side), add.input(1 - side)) else { continue };
            let Some(l) = producer(dx) else { continue };
            let grad = &graph.nodes[l];
            if dx == other
                || grad.outputs.len() != 3
                || grad.outputs[0] != dx
                || grad.inputs.len() > 5
                || !grad_over_f32(graph, l, n_fwd, types)
            {
                continue;
            }
            if consumers[dx.0] != [(NodeId(a), side)] || graph.outputs.contains(&dx) || fused.iter().any(|f| f.0 == l) {
                continue;
            }
            // dres must exist where the LayerNormGrad runs: in place if it is computed before,
            // else the LayerNormGrad moves to the Add, if none of its outputs is read between
            let moves = producer(other).is_some_and(|p| p > l);
            let read_between = graph.nodes[l].outputs.iter().any(|o| consumers[o.0].iter().any(|(n, _)| n.0 > l && n.0 < a));
            if moves && read_between {
                continue;
            }
            fused.push((l, a, other, moves));
            break;
        }
    }
    for &(l, a, other, _) in &fused {
        let sum = graph.nodes[a].outputs[0];
        let node = &mut graph.nodes[l];
        node.inputs.resize(5, None);
        node.inputs.push(Some(other));
        node.outputs[0] = sum;
    }
    let count = fused.len();
    let old = std::mem::take(&mut graph.nodes);
    let mut slots: Vec<Option<Node>> = old.into_iter().map(Some).collect();
    let mut order: Vec<Node> = Vec::with_capacity(slots.len());
    for i in 0..slots.len() {
        match fused.iter().find(|f| f.0 == i || f.1 == i) {
            Some(&(l, a, _, moves)) if i == a && moves => order.extend(slots[l].take()),
            Some(&(l, _, _, moves)) if i == l && !moves => order.extend(slots[l].take()),
            Some(_) => {} // the Add, or a LayerNormGrad that moves
            None => order.extend(slots[i].take()),
        }
    }
    graph.nodes = order;
    graph.renumber_producers();
    count
}

/// Views of the gradient between a LayerNormGrad and the cast: HF models read it through
/// Reshape, a Linear adding the residual (passes/fuse_residual_linear.rs) through FlattenRows;
/// the residual Add's gradient rule through ReduceSumTo (a view where the Add did not
/// broadcast, taken only where that is proven: `half_cast`).
const VIEWS: &[&str] = &["FlattenRows", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"];

/// A cast of `v` (or of a chain of views of it) to a 16-bit float: (the views, the cast, its
/// type). `shape`: v's symbolic shape where known; a ReduceSumTo is taken as a view only to that
/// very shape (where it sums, the cast of the f32 sum must stay: summing rounded values could
/// lose what cancels).
fn half_cast(
    graph: &Graph,
    consumers: &[Vec<(NodeId, usize)>],
    types: &[Option<DType>],
    v: ValueId,
    shape: Option<&[SymDim]>,
) -> Option<(Vec<usize>, usize, DType)> {
    for &(c, slot) in &consumers[v.0] {
        let node = &graph.nodes[c.0];
        let Some(&out) = node.outputs.first() else { continue };
        if slot != 0 || graph.outputs.contains(&out) {
            continue;
        }
        let to = match node.op_type.as_str() {
            "Cast" => node.attrs.int("to", 0).ok().and_then(|t| DType::from_onnx(t as i32)),
            "CastLike" => node.input(1).and_then(|like| types[like.0]),
            "ReduceSumTo" if shape.is_some() && node.input(1).and_then(|t| values(graph, t)).as_deref() == shape => {
                let (mut views, cast, half) = half_cast(graph, consumers, types, out, shape)?;
                views.insert(0, c.0);
                return Some((views, cast, half));
            }
            op if VIEWS.contains(&op) && node.outputs.len() == 1 => {
                if let Some((mut views, cast, half)) = half_cast(graph, consumers, types, out, None) {
                    views.insert(0, c.0);
                    return Some((views, cast, half));
                }
                None
            }
            _ => None,
        };
        if let Some(half) = to.filter(|t| t.is_half()) {
            return Some((Vec::new(), c.0, half));
        }
    }
    None
}

/// The casts of a LayerNormGrad's dx to a 16-bit float: the LayerNormGrad writes the 16-bit
/// copy, and the views between (if any) are taken again of that copy where the cast was. A view
/// is the same bytes, so this is exact.
fn absorb_casts(graph: &mut Graph, n_fwd: usize, types: &[Option<DType>]) -> usize {
    let consumers = graph.consumers();
    // the cast's node index -> the nodes that take its place
    let mut replaced: Vec<(usize, Vec<Node>)> = Vec::new();
    let mut rewired: Vec<(ValueId, ValueId)> = Vec::new();
    for l in n_fwd..graph.nodes.len() {
        if !grad_over_f32(graph, l, n_fwd, types) || graph.nodes[l].outputs.len() != 3 {
            continue;
        }
        let dx = graph.nodes[l].outputs[0];
        // dx has x's shape
        let shape = graph.nodes[l].input(1).and_then(|x| shape_of(graph, x));
        let Some((views, c, half)) = half_cast(graph, &consumers, types, dx, shape.as_deref()) else { continue };
        let name = format!("{}:{}", graph.value(dx).name, half.name());
        let mut copy = graph.add_value(&name, ValueKind::Computed, Some(half), None);
        let node = &mut graph.nodes[l];
        node.attrs.set("dx_half_type", Attr::Int(half.onnx_code() as i64));
        node.outputs.push(copy);
        let mut again = Vec::with_capacity(views.len());
        for v in views {
            let view = graph.nodes[v].clone();
            let name = format!("{}:{}", graph.value(view.outputs[0]).name, half.name());
            let out = graph.add_value(&name, ValueKind::Computed, Some(half), None);
            let mut inputs = view.inputs.clone();
            inputs[0] = Some(copy);
            again.push(Node { name: format!("{}:{}", view.name, half.name()), inputs, outputs: vec![out], ..view });
            copy = out;
        }
        rewired.push((graph.nodes[c].outputs[0], copy));
        replaced.push((c, again));
    }
    for node in graph.nodes.iter_mut() {
        for i in node.inputs.iter_mut().flatten() {
            if let Some(&(_, to)) = rewired.iter().find(|(from, _)| from == i) {
                *i = to;
            }
        }
    }
    let old = std::mem::take(&mut graph.nodes);
    for (i, node) in old.into_iter().enumerate() {
        match replaced.iter_mut().find(|(c, _)| *c == i) {
            Some((_, again)) => graph.nodes.append(again),
            None => graph.nodes.push(node),
        }
    }
    graph.renumber_producers();
    replaced.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, Dim};

    /// a = x·W0 read by a LayerNorm whose output goes through W1 and is added back to a: y = a +
    /// LN(a)·W1; or, given `first` (a one-input op), y = LN(a)·W1 + first(a). Gradients of W0, W1
    /// and the LayerNorm's scale by autodiff.
    fn block(first: Option<&str>) -> (Graph, usize) {
        let mut g = Graph::default();
        let dims = |d: &[usize]| Some(d.iter().map(|&v| Dim::Known(v)).collect());
        let x = g.add_value("x", ValueKind::Input, Some(DType::F32), dims(&[4, 8]));
        g.inputs.push(x);
        let w0 = g.add_value("w0", ValueKind::Weight, Some(DType::F32), dims(&[8, 8]));
        let w1 = g.add_value("w1", ValueKind::Weight, Some(DType::F32), dims(&[8, 8]));
        let scale = g.add_value("scale", ValueKind::Weight, Some(DType::F32), dims(&[8]));
        let a = g.add_node("proj", "MatMul", vec![Some(x), Some(w0)], Attrs::default(), 1)[0];
        let side = first.map(|op| g.add_node("side", op, vec![Some(a)], Attrs::default(), 1)[0]);
        let n = g.add_node("ln", "LayerNormalization", vec![Some(a), Some(scale)], Attrs::default(), 1)[0];
        let m = g.add_node("mm", "MatMul", vec![Some(n), Some(w1)], Attrs::default(), 1)[0];
        // with a side op, y = LN(a)·W1 + side(a): the LayerNorm's is a's first gradient
        let y = match side {
            Some(side) => g.add_node("plus_side", "Add", vec![Some(m), Some(side)], Attrs::default(), 1)[0],
            None => g.add_node("residual", "Add", vec![Some(a), Some(m)], Attrs::default(), 1)[0],
        };
        g.outputs = vec![y];
        let n_fwd = g.nodes.len();
        let seed = g.add_value("grad:y", ValueKind::Input, Some(DType::F32), None);
        crate::autodiff::build(&mut g, &[y], &[Some(seed)], &[w0, w1, scale]).expect("autodiff");
        (g, n_fwd)
    }

    /// Every node's inputs are computed before it, and producers match the order.
    fn assert_ordered(g: &Graph) {
        for (i, node) in g.nodes.iter().enumerate() {
            for v in node.inputs.iter().flatten() {
                if g.value(*v).kind == ValueKind::Computed {
                    let p = g.value(*v).producer.unwrap_or_else(|| panic!("{} reads an orphan", node.name));
                    assert!(p.0 < i, "{} reads {} computed after it", node.name, g.value(*v).name);
                }
            }
            for o in &node.outputs {
                assert_eq!(g.value(*o).producer, Some(NodeId(i)));
            }
        }
    }

    fn grad_node(g: &Graph) -> (usize, &Node) {
        g.nodes.iter().enumerate().find(|(_, n)| n.op_type == "LayerNormGrad").expect("a LayerNormGrad")
    }

    #[test]
    fn the_residual_sum_goes_into_the_layer_norm_gradient() {
        let (mut g, n_fwd) = block(None);
        let adds = |g: &Graph| g.nodes[n_fwd..].iter().filter(|n| n.op_type == "Add").count();
        let before = adds(&g);
        assert_eq!(run(&mut g, n_fwd), 1);
        assert_eq!(adds(&g), before - 1, "the sum's Add goes");
        let (_, grad) = grad_node(&g);
        assert!(grad.input(5).is_some(), "the residual gradient is input 5");
        assert_eq!(grad.outputs.len(), 3, "no 16-bit copy in an f32 graph");
        assert_ordered(&g);
    }

    #[test]
    fn a_gradient_computed_after_the_layer_norm_gradient_moves_it_to_the_sum() {
        // the side op's gradient (its contribution to a's, summed with the LayerNorm's dx) comes
        // after the LayerNormGrad
        let (mut g, n_fwd) = block(Some("Sigmoid"));
        let side_grad = |g: &Graph| g.nodes.iter().position(|n| n.name.starts_with("side/grad")).expect("the side op's gradient");
        assert!(grad_node(&g).0 < side_grad(&g));
        assert_eq!(run(&mut g, n_fwd), 1);
        assert!(grad_node(&g).0 > side_grad(&g), "the LayerNormGrad runs where the sum did");
        assert!(grad_node(&g).1.input(5).is_some());
        assert_ordered(&g);
    }

    #[test]
    fn a_dx_read_elsewhere_or_an_output_stays() {
        let (mut g, n_fwd) = block(None);
        let dx = grad_node(&g).1.outputs[0];
        g.outputs.push(dx);
        assert_eq!(run(&mut g, n_fwd), 0, "dx is a graph output");
        let (mut g, n_fwd) = block(None);
        let dx = grad_node(&g).1.outputs[0];
        g.add_node("spy", "Neg", vec![Some(dx)], Attrs::default(), 1);
        assert_eq!(run(&mut g, n_fwd), 0, "dx has a second reader");
    }

    #[test]
    fn a_cast_to_16_bits_through_views_becomes_the_copy() {
        let (mut g, n_fwd) = block(None);
        let sum = g.nodes.iter().find(|n| n.op_type == "Add" && n.name.contains("grad_sum")).expect("the sum").outputs[0];
        let shape = g.add_const("shape", crate::tensor::Tensor::from_i64(vec![1], vec![32]));
        let flat = g.add_node("flat", "Reshape", vec![Some(sum), Some(shape)], Attrs::default(), 1)[0];
        let to = Attrs::default().with("to", Attr::Int(DType::BF16.onnx_code() as i64));
        let half = g.add_node("to_bf16", "Cast", vec![Some(flat)], to, 1)[0];
        let user = g.add_node("user", "Neg", vec![Some(half)], Attrs::default(), 1)[0];
        g.outputs.push(user);
        assert_eq!(run(&mut g, n_fwd), 2, "the sum and the cast");
        assert!(!g.nodes.iter().any(|n| n.op_type == "Cast"), "the cast goes");
        let (_, grad) = grad_node(&g);
        let copy = grad.outputs[3];
        assert_eq!(g.value(copy).dtype, Some(DType::BF16));
        assert_eq!(grad.attrs.int("dx_half_type", 0).ok(), Some(DType::BF16.onnx_code() as i64));
        let view = g.nodes.iter().find(|n| n.input(0) == Some(copy)).expect("the view of the copy");
        assert_eq!(view.op_type, "Reshape");
        let user = g.nodes.iter().find(|n| n.name == "user").expect("user");
        assert_eq!(user.input(0), Some(view.outputs[0]), "the cast's reader reads the view of the copy");
        assert_ordered(&g);
    }

    /// x's gradient sum read through ReduceSumTo(·, `target`) and cast to bf16, x declared [4, 8].
    fn reduced_cast(target: &[i64]) -> (Graph, usize) {
        let (mut g, n_fwd) = block(None);
        let x = grad_node(&g).1.input(1).expect("x");
        g.values[x.0].shape = Some(vec![Dim::Known(4), Dim::Known(8)]);
        let sum = g.nodes.iter().find(|n| n.op_type == "Add" && n.name.contains("grad_sum")).expect("the sum").outputs[0];
        let target = g.add_const("target", crate::tensor::Tensor::from_i64(vec![target.len()], target.to_vec()));
        let reduced = g.add_node("reduce", "ReduceSumTo", vec![Some(sum), Some(target)], Attrs::default(), 1)[0];
        let to = Attrs::default().with("to", Attr::Int(DType::BF16.onnx_code() as i64));
        let half = g.add_node("to_bf16", "Cast", vec![Some(reduced)], to, 1)[0];
        let user = g.add_node("user", "Neg", vec![Some(half)], Attrs::default(), 1)[0];
        g.outputs.push(user);
        (g, n_fwd)
    }

    #[test]
    fn a_cast_after_a_reduce_sum_goes_only_where_it_sums_nothing() {
        let (mut g, n_fwd) = reduced_cast(&[1, 8]);
        assert_eq!(run(&mut g, n_fwd), 1, "the sum only");
        assert!(g.nodes.iter().any(|n| n.op_type == "Cast"), "the cast of the f32 column sums stays");
        assert_eq!(grad_node(&g).1.outputs.len(), 3);
        let (mut g, n_fwd) = reduced_cast(&[4, 8]);
        assert_eq!(run(&mut g, n_fwd), 2, "the sum and the cast");
        assert!(!g.nodes.iter().any(|n| n.op_type == "Cast"), "x's own shape: a view");
        assert_ordered(&g);
    }
}
