//! slice_before_linear: Slice(Linear(X, W, b)) on axes other than the last becomes
//! Linear(Slice(X), W, b). A Linear maps each row of X's last axis on its own, so selecting rows
//! first gives the same values; what it buys is the pattern fuse_linear_cross_entropy matches:
//! a causal LM's shifted loss (`logits[:, :-1]`, GPT-2) slices the LM head's output before the
//! loss, and with the slice moved onto X the LM head and its loss fuse (and the gemm skips the
//! dropped rows). Only with the axes given as constants counted from the end (-2, -3, ...):
//! without run-time shapes a non-negative axis could be the last one. Only where the slice is
//! the Linear's one reader. CPU only, like the fusion it serves.

use crate::error::Result;
use crate::ir::{Graph, Node, NodeId, ValueKind};

/// The Slice's axes input, when it is a constant list of axes counted from the end, none of
/// them the last.
fn leading_axes_only(graph: &Graph, node: &Node) -> bool {
    let Some(axes) = node.input(3) else { return false };
    let ValueKind::Const(t) = &graph.value(axes).kind else { return false };
    t.to_i64_vec().is_some_and(|a| !a.is_empty() && a.iter().all(|&x| x < -1))
}

pub fn run(graph: &mut Graph) -> Result<usize> {
    let consumers = graph.consumers();
    let mut rewrites = 0;
    for s in 0..graph.nodes.len() {
        let slice = &graph.nodes[s];
        if slice.op_type != "Slice" || !leading_axes_only(graph, slice) {
            continue;
        }
        // starts, ends, axes and steps are read where the Linear was: they must be constants
        let params_const =
            slice.inputs.iter().skip(1).flatten().all(|v| matches!(graph.value(*v).kind, ValueKind::Const(_) | ValueKind::Weight));
        let Some(y) = slice.input(0) else { continue };
        let Some(lin) = graph.value(y).producer else { continue };
        if !params_const || graph.nodes[lin.0].op_type != "Linear" || consumers[y.0].len() != 1 || graph.outputs.contains(&y) {
            continue;
        }
        let Some(x) = graph.nodes[lin.0].input(0) else { continue };
        let slice = graph.nodes[s].clone();
        let linear = graph.nodes[lin.0].clone();
        let x_rows = graph.add_value(&format!("{}:rows", slice.name), ValueKind::Computed, graph.value(x).dtype, None);
        let mut slice_inputs = slice.inputs.clone();
        slice_inputs[0] = Some(x);
        let mut linear_inputs = linear.inputs.clone();
        linear_inputs[0] = Some(x_rows);
        graph.nodes[lin.0] = Node { inputs: slice_inputs, outputs: vec![x_rows], ..slice.clone() };
        graph.nodes[s] = Node { inputs: linear_inputs, outputs: slice.outputs.clone(), ..linear };
        graph.values[x_rows.0].producer = Some(lin);
        graph.values[y.0].producer = None;
        for o in &slice.outputs {
            graph.values[o.0].producer = Some(NodeId(s));
        }
        rewrites += 1;
    }
    Ok(rewrites)
}
