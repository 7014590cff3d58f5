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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, Dim, ValueId};
    use crate::tensor::{DType, Tensor};

    /// Y = Linear(X, W); Z = Slice(Y, [0], [-1], axes): the graph and Z.
    fn sliced_linear(axes: i64) -> (Graph, ValueId) {
        let mut g = Graph::default();
        let x = g.add_value("x", ValueKind::Input, Some(DType::F32), None);
        g.inputs.push(x);
        let w = g.add_value("w", ValueKind::Weight, Some(DType::F32), Some(vec![Dim::Known(8), Dim::Known(4)]));
        let y = g.add_node("lin", "Linear", vec![Some(x), Some(w)], Attrs::default(), 1)[0];
        let starts = g.add_const("starts", Tensor::from_i64(vec![1], vec![0]));
        let ends = g.add_const("ends", Tensor::from_i64(vec![1], vec![-1]));
        let ax = g.add_const("axes", Tensor::from_i64(vec![1], vec![axes]));
        let z = g.add_node("shift", "Slice", vec![Some(y), Some(starts), Some(ends), Some(ax)], Attrs::default(), 1)[0];
        g.outputs.push(z);
        (g, z)
    }

    #[test]
    fn a_slice_of_leading_axes_moves_onto_the_linear_input() {
        let (mut g, z) = sliced_linear(-2);
        assert_eq!(run(&mut g).unwrap(), 1);
        let lin = &g.nodes[g.value(z).producer.unwrap().0];
        assert_eq!((lin.op_type.as_str(), lin.name.as_str()), ("Linear", "lin"));
        let slice = &g.nodes[g.value(lin.input(0).unwrap()).producer.unwrap().0];
        assert_eq!(slice.op_type, "Slice");
        assert_eq!(slice.input(0), g.find("x"));
    }

    #[test]
    fn the_last_axis_or_an_axis_counted_from_the_front_stays() {
        for axes in [-1, 0, 1, 2] {
            let (mut g, z) = sliced_linear(axes);
            assert_eq!(run(&mut g).unwrap(), 0, "axes [{axes}]");
            assert_eq!(g.nodes[g.value(z).producer.unwrap().0].op_type, "Slice");
        }
    }
}
