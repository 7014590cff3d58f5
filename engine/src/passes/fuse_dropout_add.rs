//! fuse_dropout_add (every session, after autocast): a residual branch's dropout and the add
//! that joins it to the stream, `Add(Dropout(x), r)` (either order) as PyTorch's
//! TransformerEncoderLayer and GPT-2's blocks write `r + dropout(proj(h))`, become one
//! DropoutAdd(x, r, ratio, mode) -> (sum, mask) (ops/random.rs): one pass over memory that
//! writes the sum and the mask, where the Dropout wrote its output for the Add to read back.
//! The fused node keeps the Dropout's name, so it draws the same mask (the CUDA kernels key
//! Philox by the name; the CPU's stream advances by node, and no other random node lies
//! between the two), and computes the same numbers: the dropped value is rounded to its type
//! before the add, as the Dropout wrote it. Its gradient is the Dropout's for x and dy itself for
//! r. The bias before the dropout is already in the product's epilogue (fuse_linear).
//!
//! Only where the Add does not broadcast (x's and r's shapes proven equal, passes/sym_shape.rs),
//! both have one type, and the Dropout's output has no other reader.

use super::sym_shape::shape_of;
use crate::ir::{Graph, Node, ValueId};

/// Rewrites the graph; returns how many Dropout + Add pairs became one DropoutAdd.
pub fn run(graph: &mut Graph) -> usize {
    let consumers = graph.consumers();
    let types = super::autocast::forward_types(graph);
    let random = |n: &Node| crate::ops::lookup(&n.op_type).is_some_and(|op| op.is_random());
    // (the Dropout's index, the Add's index, the DropoutAdd that replaces the Add)
    let mut fused: Vec<(usize, usize, Node)> = Vec::new();
    for (a, add) in graph.nodes.iter().enumerate() {
        if add.op_type != "Add" || add.inputs.len() != 2 || add.outputs.len() != 1 {
            continue;
        }
        for slot in 0..2 {
            let (Some(dropped), Some(r)) = (add.input(slot), add.input(1 - slot)) else { continue };
            let Some(d) = graph.value(dropped).producer else { continue };
            let dropout = &graph.nodes[d.0];
            let only_reader = consumers[dropped.0] == [(crate::ir::NodeId(a), slot)] && !graph.outputs.contains(&dropped);
            if dropout.op_type != "Dropout" || dropout.outputs.first() != Some(&dropped) || !only_reader || fused.iter().any(|f| f.0 == d.0)
            {
                continue;
            }
            let Some(x) = dropout.input(0) else { continue };
            let same_type = types[x.0].is_some() && types[x.0] == types[r.0];
            let same_shape = shape_of(graph, x).is_some_and(|s| Some(&s) == shape_of(graph, r).as_ref());
            // the CPU's random stream advances node by node: nothing random may run in between
            let between = graph.nodes[d.0 + 1..a.max(d.0 + 1)].iter().any(random);
            if !same_type || !same_shape || between || d.0 > a {
                continue;
            }
            let mask = dropout.outputs.get(1).copied();
            fused.push((d.0, a, fused_node(dropout, x, r, add.outputs[0], mask)));
            break;
        }
    }
    let count = fused.len();
    if count == 0 {
        return 0;
    }
    let mut gone = vec![false; graph.nodes.len()];
    for (d, a, node) in fused {
        graph.nodes[a] = node;
        gone[d] = true;
    }
    super::drop_nodes(graph, &gone);
    count
}

/// DropoutAdd(x, r, ratio, mode) named as the Dropout, writing the Add's output and the mask.
fn fused_node(dropout: &Node, x: ValueId, r: ValueId, sum: ValueId, mask: Option<ValueId>) -> Node {
    let inputs = vec![Some(x), Some(r), dropout.input(1), dropout.input(2)];
    let outputs = std::iter::once(sum).chain(mask).collect();
    Node { name: dropout.name.clone(), op_type: "DropoutAdd".into(), inputs, outputs, attrs: dropout.attrs.clone() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, Dim, ValueKind};
    use crate::tensor::{DType, Tensor};

    /// r + Dropout(x, 0.1, true) over [2, 3] f32 (`residual_dims`: r's declared shape), the
    /// Dropout's output read by `spy` too when asked, a second Dropout between them when asked.
    fn block(residual_dims: &[usize], dropped_first: bool, spy: bool, dropout_between: bool) -> Graph {
        let mut g = Graph::default();
        let dims = |d: &[usize]| Some(d.iter().map(|&v| Dim::Known(v)).collect());
        let x = g.add_value("x", ValueKind::Input, Some(DType::F32), dims(&[2, 3]));
        let r = g.add_value("r", ValueKind::Input, Some(DType::F32), dims(residual_dims));
        g.inputs.extend([x, r]);
        let ratio = g.add_const("ratio", Tensor::from_f32(vec![], vec![0.1]));
        let mode = g.add_const("mode", Tensor::from_bytes(DType::Bool, vec![], &[1]).expect("bool"));
        let d = g.add_node("drop", "Dropout", vec![Some(x), Some(ratio), Some(mode)], Attrs::default(), 2);
        g.outputs.push(d[1]);
        if dropout_between {
            let other = g.add_node("other", "Dropout", vec![Some(r), Some(ratio), Some(mode)], Attrs::default(), 2);
            g.outputs.push(other[0]);
        }
        let ins = if dropped_first { vec![Some(d[0]), Some(r)] } else { vec![Some(r), Some(d[0])] };
        let sum = g.add_node("add", "Add", ins, Attrs::default(), 1)[0];
        g.outputs.push(sum);
        if spy {
            let other = g.add_node("spy", "Neg", vec![Some(d[0])], Attrs::default(), 1)[0];
            g.outputs.push(other);
        }
        g
    }

    #[test]
    fn a_dropout_added_to_a_residual_becomes_one_dropout_add_of_its_name() {
        for dropped_first in [true, false] {
            let mut g = block(&[2, 3], dropped_first, false, false);
            assert_eq!(run(&mut g), 1);
            let ops: Vec<&str> = g.nodes.iter().map(|n| n.op_type.as_str()).collect();
            assert_eq!(ops, ["DropoutAdd"]);
            let node = &g.nodes[0];
            assert_eq!(node.name, "drop", "the Dropout's name: its random stream");
            let name = |i: usize| node.input(i).map(|v| g.value(v).name.clone());
            assert_eq!(
                (0..4).map(name).collect::<Vec<_>>(),
                [Some("x".into()), Some("r".into()), Some("ratio".into()), Some("mode".into())]
            );
            assert_eq!(g.outputs, [node.outputs[1], node.outputs[0]], "the mask, then the Add's sum");
        }
    }

    #[test]
    fn a_broadcast_another_reader_or_a_draw_in_between_keeps_the_two_nodes() {
        let mut g = block(&[3], true, false, false);
        assert_eq!(run(&mut g), 0, "r broadcast over the rows");
        let mut g = block(&[2, 3], true, true, false);
        assert_eq!(run(&mut g), 0, "the dropped tensor has another reader");
        let mut g = block(&[2, 3], true, false, true);
        assert_eq!(run(&mut g), 0, "another Dropout draws between the two");
        let mut g = block(&[2, 3], true, false, false);
        let r = g.find("r").expect("r");
        g.values[r.0].dtype = Some(DType::F64);
        assert_eq!(run(&mut g), 0, "another type");
    }
}
