//! layer_norm_grad_col_sum (CUDA sessions, on the train graph after layer_norm_grad_sum): the
//! column sums of a LayerNormGrad's dx read through views that keep its rows, `SumRows(views(dx))`
//! or `ReduceSumTo(views(dx), [n])`, become LayerNormGrad's last output (`dx_col_sum`, ops/norm.rs), summed by its dx kernel from
//! the values it stores (kernels/layernorm.cu: a third row of the per-block partials). In a
//! pre-norm transformer that SumRows is the bias gradient of the projection added back to the
//! residual stream (GPT-2's attn.c_proj and mlp.c_proj: SumRows after fuse_residual_linear in
//! 16-bit sessions, a Gemm's ReduceSumTo in f32 ones): the residual stream's gradient is the
//! LayerNormGrad's dx. GPT-2 124M, bf16: 24 kernels and 1.2 GB of reads fewer a step
//! (bench/gpu_roofline.py).
//!
//! Only where the LayerNorm normalises the last dimension alone (axis -1, or rank - 1), n long
//! (its 1-D scale's), and the views keep rows of n: FlattenRows and Identity, or a Reshape to a
//! last dimension of n. Then SumRows's [M, N] rows, or ReduceSumTo's sum to [n], are dx's
//! LayerNorm rows. The sums are the same values in another order (f32 partials per block, as
//! the CUDA SumRows kernel sums in f32; the CPU kernel sums in f64 row by row as its SumRows).

use super::sym_shape::{declared, shape_of, values, SymDim};
use crate::ir::{Attr, Graph, Node, NodeId, ValueId};

/// Views whose output keeps its input's last dimension as its own.
const ROW_VIEWS: &[&str] = &["FlattenRows", "Identity"];

/// Rewrites the train graph whose first `n_fwd` nodes are the forward pass; returns how many
/// SumRows went into LayerNormGrads.
pub fn run(graph: &mut Graph, n_fwd: usize) -> usize {
    let consumers = graph.consumers();
    let mut gone = vec![false; graph.nodes.len()];
    let mut folds = 0;
    for l in n_fwd.min(graph.nodes.len())..graph.nodes.len() {
        let node = &graph.nodes[l];
        if node.op_type != "LayerNormGrad" || node.attrs.get("dx_col_sum").is_some() || !normalises_last_axis(graph, node) {
            continue;
        }
        // n where the scale declares it (Reshape and ReduceSumTo are taken only against it)
        let n = node.input(2).and_then(|s| declared(graph, s)).and_then(|d| if let [n] = d.as_slice() { Some(n.clone()) } else { None });
        let Some((views, sum)) = col_sum_of(graph, &consumers, node.outputs[0], n.as_ref(), &gone) else { continue };
        let out = graph.nodes[sum].outputs[0];
        let grad = &mut graph.nodes[l];
        grad.attrs.set("dx_col_sum", Attr::Int(1));
        grad.outputs.push(out);
        gone[sum] = true;
        // the views only the SumRows read go with it
        for v in views.into_iter().rev() {
            let read = graph.nodes[v].outputs.iter().any(|o| graph.outputs.contains(o) || consumers[o.0].iter().any(|(c, _)| !gone[c.0]));
            if read {
                break;
            }
            gone[v] = true;
        }
        folds += 1;
    }
    if folds > 0 {
        super::drop_nodes(graph, &gone);
    }
    folds
}

/// Whether LayerNormGrad `node` normalises x's last dimension alone: axis -1, or rank - 1 where
/// x's rank is known.
fn normalises_last_axis(graph: &Graph, node: &Node) -> bool {
    match node.attrs.int("axis", -1) {
        Ok(-1) => true,
        Ok(axis) => node.input(1).and_then(|x| shape_of(graph, x)).is_some_and(|s| axis >= 0 && axis as usize + 1 == s.len()),
        Err(_) => false,
    }
}

/// A column sum of `v` ([.., n] rows) through views that keep its rows: (the views, outer
/// first; the SumRows or ReduceSumTo). `n`: the rows' length, where known.
fn col_sum_of(
    graph: &Graph,
    consumers: &[Vec<(NodeId, usize)>],
    v: ValueId,
    n: Option<&SymDim>,
    gone: &[bool],
) -> Option<(Vec<usize>, usize)> {
    let to_n = |t: Option<ValueId>| -> Option<Vec<SymDim>> { values(graph, t?) };
    for &(c, slot) in &consumers[v.0] {
        let node = &graph.nodes[c.0];
        if slot != 0 || gone[c.0] || node.outputs.len() != 1 || graph.outputs.contains(&node.outputs[0]) {
            continue;
        }
        let sums = match node.op_type.as_str() {
            "SumRows" => true,
            "ReduceSumTo" => n.is_some_and(|n| to_n(node.input(1)).is_some_and(|t| t == [n.clone()])),
            _ => false,
        };
        if sums {
            return Some((Vec::new(), c.0));
        }
        let keeps_rows = ROW_VIEWS.contains(&node.op_type.as_str())
            || node.op_type == "Reshape" && n.is_some_and(|n| to_n(node.input(1)).is_some_and(|t| t.last() == Some(n)));
        if keeps_rows {
            if let Some((mut views, sum)) = col_sum_of(graph, consumers, node.outputs[0], n, gone) {
                views.insert(0, c.0);
                return Some((views, sum));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, Dim, ValueKind};
    use crate::tensor::DType;

    /// A backward graph built by hand: LayerNormGrad(dy, x, scale) over x [2, 3, 8] at `axis`,
    /// its dx through `views` into a SumRows whose sum `bias_user` reads; dx, dscale and dbias
    /// are graph outputs. No forward nodes.
    fn grad_then_sum(axis: i64, views: &[&str]) -> Graph {
        let mut g = Graph::default();
        let dims = |d: &[usize]| Some(d.iter().map(|&v| Dim::Known(v)).collect());
        let dy = g.add_value("dy", ValueKind::Input, Some(DType::F32), dims(&[2, 3, 8]));
        let x = g.add_value("x", ValueKind::Input, Some(DType::F32), dims(&[2, 3, 8]));
        let scale = g.add_value("scale", ValueKind::Weight, Some(DType::F32), dims(&[8]));
        g.inputs.extend([dy, x]);
        let attrs = Attrs::default().with("axis", Attr::Int(axis));
        let outs = g.add_node("ln/grad", "LayerNormGrad", vec![Some(dy), Some(x), Some(scale)], attrs, 3);
        let mut v = outs[0];
        for (i, op) in views.iter().enumerate() {
            v = g.add_node(&format!("view{i}"), op, vec![Some(v)], Attrs::default(), 1)[0];
        }
        let sum = g.add_node("bias/grad", "SumRows", vec![Some(v)], Attrs::default(), 1)[0];
        let user = g.add_node("bias_user", "Neg", vec![Some(sum)], Attrs::default(), 1)[0];
        g.outputs = vec![outs[0], outs[1], outs[2], user];
        g
    }

    /// Replaces the SumRows of `grad_then_sum(.., &[])` by a Reshape of dx to the constant `to`
    /// then the SumRows.
    fn reshape_dx(g: &mut Graph, to: &[i64]) {
        let dx = grad(g).outputs[0];
        let shape = g.add_const("to", crate::tensor::Tensor::from_i64(vec![to.len()], to.to_vec()));
        let flat = g.add_node("flat", "Reshape", vec![Some(dx), Some(shape)], Attrs::default(), 1)[0];
        let sum = g.nodes.iter().position(|n| n.op_type == "SumRows").expect("SumRows");
        g.nodes[sum].inputs[0] = Some(flat);
        let node = g.nodes.pop().expect("the Reshape");
        g.nodes.insert(sum, node);
        g.renumber_producers();
    }

    /// Replaces the SumRows of `grad_then_sum(.., &[])` by ReduceSumTo(dx, constant `to`).
    fn reduce_dx(g: &mut Graph, to: &[i64]) {
        let dx = grad(g).outputs[0];
        let target = g.add_const("target", crate::tensor::Tensor::from_i64(vec![to.len()], to.to_vec()));
        let sum = g.nodes.iter().position(|n| n.op_type == "SumRows").expect("SumRows");
        g.nodes[sum].op_type = "ReduceSumTo".into();
        g.nodes[sum].inputs = vec![Some(dx), Some(target)];
    }

    fn grad(g: &Graph) -> &crate::ir::Node {
        g.nodes.iter().find(|n| n.op_type == "LayerNormGrad").expect("a LayerNormGrad")
    }

    #[test]
    fn the_bias_sum_of_dx_goes_into_the_layer_norm_gradient() {
        let mut g = grad_then_sum(-1, &["FlattenRows"]);
        let sum = g.nodes.iter().find(|n| n.op_type == "SumRows").expect("SumRows").outputs[0];
        assert_eq!(run(&mut g, 0), 1);
        assert!(g.nodes.iter().all(|n| n.op_type != "SumRows" && n.op_type != "FlattenRows"), "the SumRows and its view go");
        let grad = grad(&g);
        assert_eq!(grad.attrs.int("dx_col_sum", 0).ok(), Some(1));
        assert_eq!(grad.outputs.len(), 4);
        assert_eq!(grad.outputs[3], sum, "the LayerNormGrad writes the sum its reader reads");
        assert_eq!(g.value(sum).producer, Some(NodeId(0)));
        assert_eq!(crate::ops::layer_norm_grad_extras_of(grad).expect("extras"), (None, Some(3)));
        // axis 2 of rank 3 is the last too
        let mut g = grad_then_sum(2, &["FlattenRows", "Identity"]);
        assert_eq!(run(&mut g, 0), 1);
        assert_eq!(g.nodes.len(), 2, "the LayerNormGrad and the bias's reader");
    }

    #[test]
    fn a_reduce_sum_to_the_row_length_and_a_reshape_keeping_rows_go_too() {
        // f32 sessions: a Gemm's bias gradient, ReduceSumTo(dY, [n])
        let mut g = grad_then_sum(-1, &[]);
        reduce_dx(&mut g, &[8]);
        assert_eq!(run(&mut g, 0), 1);
        assert!(g.nodes.iter().all(|n| n.op_type != "ReduceSumTo"));
        // a Reshape to rows of 8, then SumRows
        let mut g = grad_then_sum(-1, &[]);
        reshape_dx(&mut g, &[-1, 8]);
        assert_eq!(run(&mut g, 0), 1);
        assert!(g.nodes.iter().all(|n| n.op_type != "SumRows" && n.op_type != "Reshape"), "the SumRows and its Reshape go");
    }

    #[test]
    fn a_view_read_elsewhere_stays() {
        let mut g = grad_then_sum(-1, &["FlattenRows"]);
        let flat = g.nodes.iter().find(|n| n.op_type == "FlattenRows").expect("view").outputs[0];
        g.add_node("spy", "Neg", vec![Some(flat)], Attrs::default(), 1);
        assert_eq!(run(&mut g, 0), 1);
        assert!(g.nodes.iter().any(|n| n.op_type == "FlattenRows"), "the view another node reads stays");
        assert!(g.nodes.iter().all(|n| n.op_type != "SumRows"));
    }

    #[test]
    fn other_layouts_keep_their_sum_rows() {
        // normalised over the last two dimensions: SumRows's rows of 8 are not the LayerNorm's
        let mut g = grad_then_sum(1, &["FlattenRows"]);
        assert_eq!(run(&mut g, 0), 0, "axis 1 of 3");
        // a Reshape whose target is not known to keep rows of 8
        let mut g = grad_then_sum(-1, &["Reshape"]);
        assert_eq!(run(&mut g, 0), 0, "through a Reshape to an unknown shape");
        let mut g = grad_then_sum(-1, &[]);
        reshape_dx(&mut g, &[4, 12]);
        assert_eq!(run(&mut g, 0), 0, "through a Reshape to rows of 12");
        // axis 2 with x's rank unknown
        let mut g = grad_then_sum(2, &["FlattenRows"]);
        let x = grad(&g).input(1).expect("x");
        g.values[x.0].shape = None;
        assert_eq!(run(&mut g, 0), 0, "x's rank unknown");
        // a ReduceSumTo to [1, 8] keeps a dimension SumRows does not
        let mut g = grad_then_sum(-1, &[]);
        reduce_dx(&mut g, &[1, 8]);
        assert_eq!(run(&mut g, 0), 0, "ReduceSumTo to [1, 8]");
        // a SumRows that is a graph output stays where it is
        let mut g = grad_then_sum(-1, &["FlattenRows"]);
        let sum = g.nodes.iter().find(|n| n.op_type == "SumRows").expect("SumRows").outputs[0];
        g.outputs.push(sum);
        assert_eq!(run(&mut g, 0), 0, "the SumRows's output is a graph output");
    }

    #[test]
    fn the_column_sums_follow_the_16_bit_copy() {
        let mut g = grad_then_sum(-1, &["FlattenRows"]);
        let copy = g.add_value("dx:bf16", ValueKind::Computed, Some(DType::BF16), None);
        let node = &mut g.nodes[0];
        node.attrs.set("dx_half_type", Attr::Int(DType::BF16.onnx_code() as i64));
        node.outputs.push(copy);
        g.renumber_producers();
        assert_eq!(run(&mut g, 0), 1);
        let grad = grad(&g);
        assert_eq!(grad.outputs.len(), 5);
        assert_eq!(crate::ops::layer_norm_grad_extras_of(grad).expect("extras"), (Some(3), Some(4)));
        // once: a second run finds no SumRows and leaves the node alone
        assert_eq!(run(&mut g, 0), 0);
    }
}
