//! attention_key_padding (after fuse_attention): a fused attention whose mask is
//! `Where(Expand?(And(C, KP)), z, f)`, with C computed from constants and shapes only (Hugging
//! Face's causal matrix from positions) and KP a bool value of the step's data that is the same
//! for every query (Hugging Face's attention_mask as [B, 1, 1, S]), takes the mask apart: the
//! Where is rewritten in place to `Where(C, z, f)`, which the planner folds into a constant (the
//! CUDA kernels find GPT-2's causal and compute it; BERT's C is all true, so its constant is
//! zeros, which they find hides nothing), and the attentions read KP as their key padding
//! with `padding_value = f` (ops/attention.rs). The same values as before: where KP is false
//! both give f, elsewhere both give C's choice.
//!
//! Why: a model called with an attention_mask (as tokenizers and collators give it) otherwise
//! builds a [B, 1, T, S] mask every step (64 MB at GPT-2 124M's batch 16 × 1024) that every
//! attention reads from memory, and a mask computed at run time can never be found causal, so
//! the flash kernels, which take no read mask, never run.

use super::sym_shape::{declared, SymDim};
use super::{computed_from, scalar_value};
use crate::ir::{Attr, Graph, NodeId, ValueId, ValueKind};
use crate::ops::attention::{key_padding_input, q_input};

/// Whether `v` is computed from the step's data (a graph input's or a weight's values): a
/// Shape reads only its operand's dims, which every plan knows, so it does not count.
fn reads_data(graph: &Graph, v: ValueId) -> bool {
    computed_from(graph, v, |k| matches!(k, ValueKind::Input | ValueKind::Weight), |n| n.op_type != "Shape")
}

/// Whether `v` (an And's operand: bool) is declared with one flag per key: rank ≥ 2, size 1
/// along the queries (the second axis from the end).
fn per_key_flags(graph: &Graph, v: ValueId) -> bool {
    let dims = declared(graph, v).unwrap_or_default();
    dims.len() >= 2 && dims[dims.len() - 2] == SymDim::Known(1)
}

/// (C, KP, f) where the mask `m` is `Where(Expand?(And(C, KP)), z, f)` as the module's doc says.
fn split_mask(graph: &Graph, m: ValueId) -> Option<(ValueId, ValueId, f32)> {
    let w = &graph.nodes[graph.value(m).producer?.0];
    if w.op_type != "Where" || w.outputs.len() != 1 {
        return None;
    }
    let (fill, _) = scalar_value(graph, w.input(2)?)?;
    // through an Expand, which only broadcasts what the attention broadcasts anyway (others may
    // still read it: they keep it)
    let cond = w.input(0)?;
    let cond = match graph.value(cond).producer.map(|p| &graph.nodes[p.0]) {
        Some(expand) if expand.op_type == "Expand" => expand.input(0)?,
        _ => cond,
    };
    let and = &graph.nodes[graph.value(cond).producer?.0];
    if and.op_type != "And" {
        return None;
    }
    let (a, b) = (and.input(0)?, and.input(1)?);
    let (c, kp) = match (reads_data(graph, a), reads_data(graph, b)) {
        (false, true) => (a, b),
        (true, false) => (b, a),
        _ => return None,
    };
    per_key_flags(graph, kp).then_some((c, kp, fill as f32))
}

pub fn run(graph: &mut Graph) -> usize {
    let consumers = graph.consumers();
    let mut rewrites = 0;
    for m in 0..graph.values.len() {
        let m = ValueId(m);
        // every reader an attention reading it as its mask, and none with key padding already
        let readers = &consumers[m.0];
        let attention_mask = |&(n, slot): &(NodeId, usize)| {
            let node = &graph.nodes[n.0];
            node.op_type == "Attention" && q_input(&node.op_type).map(|q| q + 3) == Some(slot) && node.input(4).is_none()
        };
        if readers.is_empty() || graph.outputs.contains(&m) || !readers.iter().all(attention_mask) {
            continue;
        }
        let Some((c, kp, fill)) = split_mask(graph, m) else { continue };
        let Some(w) = graph.value(m).producer else { continue };
        graph.nodes[w.0].inputs[0] = Some(c);
        // the mask is C's shape now, no longer the And's broadcast: plans infer it
        graph.values[m.0].shape = None;
        for &(n, _) in readers {
            let node = &mut graph.nodes[n.0];
            let slot = key_padding_input(&node.op_type).unwrap_or(4);
            node.inputs.resize(node.inputs.len().max(slot + 1), None);
            node.inputs[slot] = Some(kp);
            node.attrs.set("padding_value", Attr::Float(fill));
        }
        rewrites += readers.len();
    }
    rewrites
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Attrs;
    use crate::passes::sym_shape::test_dims as sym;
    use crate::tensor::{DType, Tensor};

    /// An attention over q whose mask is Where(Expand(And(le, pad)), 0, finfo.min): `le` from
    /// positions (constants), `pad` from the input `ids` ([b, 1, 1, s] declared, or [b, 1, s, s]
    /// where `per_query`); `extra`: the mask is also read by an Add.
    fn masked(per_query: bool, extra: bool) -> (Graph, ValueId, ValueId) {
        let mut g = Graph::default();
        let q = g.add_value("q", ValueKind::Input, Some(DType::F32), sym(&["b", "4", "s", "8"]));
        let ids = g.add_value("ids", ValueKind::Input, Some(DType::I64), sym(&["b", "s"]));
        g.inputs.extend([q, ids]);
        let pos = g.add_const("pos", Tensor::from_i64(vec![1, 1, 3, 3], vec![0; 9]));
        let le = g.add_node("le", "LessOrEqual", vec![Some(pos), Some(pos)], Attrs::default(), 1)[0];
        let pad = g.add_node("pad", "Cast", vec![Some(ids)], Attrs::default().with("to", Attr::Int(9)), 1)[0];
        g.values[pad.0].dtype = Some(DType::Bool);
        g.values[pad.0].shape = if per_query { sym(&["b", "1", "s", "s"]) } else { sym(&["b", "1", "1", "s"]) };
        let and = g.add_node("and", "And", vec![Some(le), Some(pad)], Attrs::default(), 1)[0];
        let shape = g.add_const("shape", Tensor::from_i64(vec![4], vec![2, 1, 3, 3]));
        let expand = g.add_node("expand", "Expand", vec![Some(and), Some(shape)], Attrs::default(), 1)[0];
        let zero = g.add_const("zero", Tensor::scalar_f32(0.0));
        let min = g.add_const("min", Tensor::scalar_f32(f32::MIN));
        let mask = g.add_node("where", "Where", vec![Some(expand), Some(zero), Some(min)], Attrs::default(), 1)[0];
        let o = g.add_node("attn", "Attention", vec![Some(q), Some(q), Some(q), Some(mask)], Attrs::default(), 2)[0];
        g.outputs.push(o);
        if extra {
            let sum = g.add_node("add", "Add", vec![Some(mask), Some(mask)], Attrs::default(), 1)[0];
            g.outputs.push(sum);
        }
        (g, le, pad)
    }

    #[test]
    fn a_padding_and_mask_becomes_the_constant_part_and_key_padding() {
        let (mut g, le, pad) = masked(false, false);
        assert_eq!(run(&mut g), 1);
        let attn = g.nodes.iter().find(|n| n.op_type == "Attention").expect("attention");
        assert_eq!(attn.inputs.len(), 5);
        assert_eq!(attn.input(4), Some(pad), "the key padding is the data's flags");
        assert_eq!(attn.attrs.float("padding_value", 0.0).expect("attr"), f32::MIN);
        let w = &g.nodes[g.value(attn.input(3).expect("mask")).producer.expect("where").0];
        assert_eq!((w.op_type.as_str(), w.input(0)), ("Where", Some(le)), "the mask is Where(C, 0, min) now");
        assert_eq!(run(&mut g), 0, "done once");
    }

    #[test]
    fn masks_that_are_not_per_key_padding_or_have_other_readers_stay() {
        for (per_query, extra) in [(true, false), (false, true)] {
            let (mut g, _, _) = masked(per_query, extra);
            assert_eq!(run(&mut g), 0, "per_query {per_query}, extra reader {extra}");
            assert!(g.nodes.iter().all(|n| n.inputs.len() <= 4));
        }
    }
}
