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
//! both have one type, and the Dropout's output has no other reader. A 16-bit branch joined to
//! an f32 stream, `Add(Cast(Dropout(x16), f32), r32)` as autocast writes GPT-2's blocks, fuses
//! with its Cast: the dropped value rounded to x's type, then widened and added in f32.

use super::sym_shape::shape_of;
use crate::ir::{Attr, Graph, Node, NodeId, ValueId};
use crate::ops::random::DROPPED_TYPE;
use crate::tensor::DType;

/// Rewrites the graph; returns how many Dropout + Add pairs became one DropoutAdd.
pub fn run(graph: &mut Graph) -> usize {
    let consumers = graph.consumers();
    let types = super::autocast::forward_types(graph);
    let random = |n: &Node| crate::ops::lookup(&n.op_type).is_some_and(|op| op.is_random());
    // (the Dropout's index, the Add's index, the DropoutAdd that replaces the Add)
    let mut fused: Vec<(usize, usize, Node)> = Vec::new();
    // the Casts between a 16-bit dropout and an f32 add, gone with them
    let mut casts: Vec<usize> = Vec::new();
    let only_reader = |v: ValueId, node: usize, slot: usize| consumers[v.0] == [(NodeId(node), slot)] && !graph.outputs.contains(&v);
    for (a, add) in graph.nodes.iter().enumerate() {
        if add.op_type != "Add" || add.inputs.len() != 2 || add.outputs.len() != 1 {
            continue;
        }
        for slot in 0..2 {
            let (Some(joined), Some(r)) = (add.input(slot), add.input(1 - slot)) else { continue };
            if !only_reader(joined, a, slot) {
                continue;
            }
            // the dropped value itself, or its Cast to the stream's type (a 16-bit branch)
            let Some(p) = graph.value(joined).producer else { continue };
            let (dropped, cast) = match graph.nodes[p.0].op_type.as_str() {
                "Cast" => match graph.nodes[p.0].input(0) {
                    Some(v) if only_reader(v, p.0, 0) => (v, Some(p.0)),
                    _ => continue,
                },
                _ => (joined, None),
            };
            let Some(d) = graph.value(dropped).producer else { continue };
            let dropout = &graph.nodes[d.0];
            if dropout.op_type != "Dropout" || dropout.outputs.first() != Some(&dropped) || fused.iter().any(|f| f.0 == d.0) {
                continue;
            }
            let Some(x) = dropout.input(0) else { continue };
            let Some(x_type) = types[x.0] else { continue };
            let joins = match cast {
                None => types[r.0] == Some(x_type),
                Some(_) => x_type.is_half() && types[joined.0] == Some(DType::F32) && types[r.0] == Some(DType::F32),
            };
            let same_shape = shape_of(graph, x).is_some_and(|s| Some(&s) == shape_of(graph, r).as_ref());
            // the CPU's random stream advances node by node: nothing random may run in between
            let between = graph.nodes[d.0 + 1..a.max(d.0 + 1)].iter().any(random);
            if !joins || !same_shape || between || d.0 > a {
                continue;
            }
            let mask = dropout.outputs.get(1).copied();
            fused.push((d.0, a, fused_node(dropout, x, x_type, r, add.outputs[0], mask)));
            if let Some(c) = cast {
                casts.push(c);
            }
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
    for c in casts {
        gone[c] = true;
    }
    super::drop_nodes(graph, &gone);
    count
}

/// DropoutAdd(x, r, ratio, mode) named as the Dropout, writing the Add's output and the mask;
/// a 16-bit x's type in its `dropped_type` (ops/random.rs).
fn fused_node(dropout: &Node, x: ValueId, x_type: DType, r: ValueId, sum: ValueId, mask: Option<ValueId>) -> Node {
    let inputs = vec![Some(x), Some(r), dropout.input(1), dropout.input(2)];
    let outputs = std::iter::once(sum).chain(mask).collect();
    let mut attrs = dropout.attrs.clone();
    if x_type.is_half() {
        attrs.set(DROPPED_TYPE, Attr::Int(x_type.onnx_code() as i64));
    }
    Node { name: dropout.name.clone(), op_type: "DropoutAdd".into(), inputs, outputs, attrs }
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

    /// `Add(Cast(Dropout(x), to), r)` over [2, 3], x of `x_type` and r of `to`, as autocast
    /// leaves GPT-2's blocks (bf16 into f32); the Cast's output read by `spy` too when asked.
    fn widened_block(x_type: DType, to: DType, cast_read_elsewhere: bool) -> Graph {
        let mut g = Graph::default();
        let dims = Some(vec![Dim::Known(2), Dim::Known(3)]);
        let x = g.add_value("x", ValueKind::Input, Some(x_type), dims.clone());
        let r = g.add_value("r", ValueKind::Input, Some(to), dims);
        g.inputs.extend([x, r]);
        let ratio = g.add_const("ratio", Tensor::from_f32(vec![], vec![0.1]));
        let mode = g.add_const("mode", Tensor::from_bytes(DType::Bool, vec![], &[1]).expect("bool"));
        let d = g.add_node("drop", "Dropout", vec![Some(x), Some(ratio), Some(mode)], Attrs::default(), 2);
        g.outputs.push(d[1]);
        let cast = g.add_node("cast", "Cast", vec![Some(d[0])], Attrs::default().with("to", Attr::Int(to.onnx_code() as i64)), 1)[0];
        let sum = g.add_node("add", "Add", vec![Some(cast), Some(r)], Attrs::default(), 1)[0];
        g.outputs.push(sum);
        if cast_read_elsewhere {
            let spy = g.add_node("spy", "Neg", vec![Some(cast)], Attrs::default(), 1)[0];
            g.outputs.push(spy);
        }
        g
    }

    #[test]
    fn a_16_bit_dropout_cast_into_an_f32_stream_fuses_with_its_cast() {
        for x_type in [DType::BF16, DType::F16] {
            let mut g = widened_block(x_type, DType::F32, false);
            assert_eq!(run(&mut g), 1, "{x_type:?}");
            let ops: Vec<&str> = g.nodes.iter().map(|n| n.op_type.as_str()).collect();
            assert_eq!(ops, ["DropoutAdd"], "{x_type:?}: the Cast goes too");
            let node = &g.nodes[0];
            assert_eq!(node.input(0).map(|v| g.value(v).name.clone()), Some("x".into()));
            assert_eq!(node.attrs.int(DROPPED_TYPE, 0).expect("int"), x_type.onnx_code() as i64, "rounded to x's type first");
        }
        // the same-type 16-bit fusion names its type too (the CPU computes it widened)
        let mut g = block(&[2, 3], true, false, false);
        for v in ["x", "r"] {
            let id = g.find(v).expect("value");
            g.values[id.0].dtype = Some(DType::BF16);
        }
        assert_eq!(run(&mut g), 1);
        assert_eq!(g.nodes[0].attrs.int(DROPPED_TYPE, 0).expect("int"), DType::BF16.onnx_code() as i64);
        assert_eq!(run(&mut widened_block(DType::BF16, DType::F32, true)), 0, "the widened value has another reader");
        assert_eq!(run(&mut widened_block(DType::F32, DType::F32, false)), 0, "an f32 branch's Cast: not autocast's");
        assert_eq!(run(&mut widened_block(DType::BF16, DType::F64, false)), 0, "into an f64 stream");
    }
}
