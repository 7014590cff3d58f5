//! fuse_attention: the exporters' attention, MatMul(Softmax(MatMul(A, B) [· c | / c] [+ M]), V)
//! with the softmax over the last axis, optionally guarded as `Where(IsNaN(p), 0, p)` (torchlib's
//! scaled_dot_product_attention), becomes one Attention(A, B, V, M) (ops/attention.rs): the
//! [.., T, S] scores, the probabilities and their gradients are never stored. Only where each
//! intermediate has no other reader, the scale is a one-element constant, and the mask depends
//! on no weight (the fused op gives the mask no gradient), and not in float64 (the CUDA attention
//! kernels take f32, bf16 and fp16, the CPU's fast ones f32; an f64 attention keeps its products
//! and softmax). Every CPU session; CUDA sessions opt-in (`ORTRAIN_ENABLE_PASSES=fuse_attention`,
//! see passes/mod.rs), and there not where Q's or V's declared head size is over what the CUDA
//! kernels take (`CUDA_MAX_HEAD_SIZE`: Gemma's 256 keeps its products and softmax).
//!
//! A Dropout between the probabilities and the product (Hugging Face's attention dropout,
//! torchlib's scaled_dot_product_attention with dropout_p) is taken in where its ratio and
//! training mode are constants and nothing reads its mask: in training mode with a ratio > 0 it
//! becomes the node's `dropout` attribute and the Dropout node a DropoutKey, whose stream key
//! the fused node reads (ops/attention.rs); otherwise it is the identity and goes.

use super::sym_shape::{shape_of, SymDim};
use super::{computed_from, scalar_const, scalar_value, sole_producer, Target};
use crate::error::Result;
use crate::ir::{Attr, Attrs, Graph, Node, NodeId, ValueId, ValueKind};
use crate::ops::attention::CUDA_MAX_HEAD_SIZE;
use crate::tensor::DType;

/// Whether any value `v` is computed from is a weight.
fn depends_on_weight(graph: &Graph, v: ValueId) -> bool {
    computed_from(graph, v, |k| *k == ValueKind::Weight, |_| true)
}

/// (probabilities, nan_guard): P' = Where(IsNaN(P), 0, P) with P read only by those two, or P.
fn unguard(graph: &Graph, consumers: &[Vec<(NodeId, usize)>], p_prime: ValueId) -> Option<(ValueId, bool)> {
    let Some(w) = sole_producer(graph, consumers, p_prime, "Where") else { return Some((p_prime, false)) };
    let (cond, zero, p) = (w.input(0)?, w.input(1)?, w.input(2)?);
    let isnan = sole_producer(graph, consumers, cond, "IsNaN")?;
    let readers = &consumers[p.0];
    let guarded = isnan.input(0) == Some(p)
        && scalar_const(graph, zero) == Some(0.0)
        && readers.len() == 2
        && readers.iter().all(|(n, _)| matches!(graph.nodes[n.0].op_type.as_str(), "IsNaN" | "Where"))
        && !graph.outputs.contains(&p);
    guarded.then_some((p, true))
}

/// (A, B, scale) of scores = MatMul(A, B) [· c | c · | / c], each read only on the way.
fn scores_of(graph: &Graph, consumers: &[Vec<(NodeId, usize)>], s: ValueId) -> Option<(ValueId, ValueId, f64)> {
    if consumers[s.0].len() != 1 || graph.outputs.contains(&s) {
        return None;
    }
    let prod = &graph.nodes[graph.value(s).producer?.0];
    let (mm_out, scale) = match prod.op_type.as_str() {
        "MatMul" => (s, 1.0),
        "Mul" | "Div" => scaled_operand(graph, prod)?,
        _ => return None,
    };
    let mm = sole_producer(graph, consumers, mm_out, "MatMul")?;
    let (a, ca) = unscaled(graph, consumers, mm.input(0)?);
    let (b, cb) = unscaled(graph, consumers, mm.input(1)?);
    let scale = scale * ca * cb;
    scale.is_finite().then_some((a, b, scale))
}

/// (x, c) of a node `x · c`, `c · x` or `x / c` with `c` a scalar expression (rank ≤ 2, so
/// that it broadcasts into the rank ≥ 2 operands of a matmul without changing their shape).
fn scaled_operand(graph: &Graph, node: &Node) -> Option<(ValueId, f64)> {
    let (a, b) = (node.input(0)?, node.input(1)?);
    let scalar = |v: ValueId| scalar_value(graph, v).filter(|&(_, rank)| rank <= 2).map(|(c, _)| c);
    let (x, c) = match (scalar(a), scalar(b)) {
        (_, Some(c)) => (a, c),
        (Some(c), None) if node.op_type == "Mul" => (b, c),
        _ => return None,
    };
    Some((x, if node.op_type == "Div" { 1.0 / c } else { c }))
}

/// A matmul operand with its scalar scaling peeled off (torchlib scales Q and Kᵀ by √scale
/// each before their product): (x, c) for `x · c` read only by the matmul, else (v, 1).
fn unscaled(graph: &Graph, consumers: &[Vec<(NodeId, usize)>], v: ValueId) -> (ValueId, f64) {
    ["Mul", "Div"]
        .iter()
        .find_map(|op| sole_producer(graph, consumers, v, op))
        .and_then(|node| scaled_operand(graph, node))
        .unwrap_or((v, 1.0))
}

/// A Dropout of the probabilities in training mode: its ratio and its node.
type ActiveDropout = (f64, NodeId);

/// (x, the dropout) of `v` = Dropout(x, ratio, training_mode) with constant ratio and mode and
/// its mask unread (an identity in inference mode or at ratio 0: no dropout), or (v, None) where
/// no Dropout makes `v`; None where a Dropout does but cannot be fused.
fn undrop(graph: &Graph, consumers: &[Vec<(NodeId, usize)>], v: ValueId) -> Option<(ValueId, Option<ActiveDropout>)> {
    let Some(d) = sole_producer(graph, consumers, v, "Dropout") else { return Some((v, None)) };
    let mask_unread = d.outputs.get(1).is_none_or(|m| consumers[m.0].is_empty() && !graph.outputs.contains(m));
    // opset 12+: ratio 0.5 and inference mode where the inputs are absent
    let ratio = d.input(1).map_or(Some(0.5), |r| scalar_const(graph, r))?;
    let training = d.input(2).map_or(Some(0.0), |t| scalar_const(graph, t))? != 0.0;
    if !mask_unread || !(0.0..1.0).contains(&ratio) {
        return None;
    }
    let at = graph.value(v).producer?;
    let active = training && ratio > 0.0;
    Some((d.input(0)?, active.then_some((ratio, at))))
}

/// What the fused node takes: its inputs (Q, Kᵀ, V, the mask), scale, NaN guard and dropout.
struct Matched {
    inputs: Vec<Option<ValueId>>,
    scale: f64,
    guard: bool,
    dropout: Option<ActiveDropout>,
}

/// The fused node replacing MatMul `node` (P' · V), if its first operand is an attention.
fn match_at(graph: &Graph, consumers: &[Vec<(NodeId, usize)>], node: &Node) -> Option<Matched> {
    let (dropped, v) = (node.input(0)?, node.input(1)?);
    let (p_prime, dropout) = undrop(graph, consumers, dropped)?;
    let (p, guard) = unguard(graph, consumers, p_prime)?;
    if !guard && consumers[p.0].len() != 1 {
        return None;
    }
    let sm = &graph.nodes[graph.value(p).producer?.0];
    if sm.op_type != "Softmax" || sm.attrs.int("axis", -1).ok()? != -1 || graph.outputs.contains(&p) {
        return None;
    }
    let x = sm.input(0)?;
    // scores [+ mask], the scores on either side of the Add
    let (a, b, scale, mask) = match sole_producer(graph, consumers, x, "Add") {
        Some(add) => {
            let (l, r) = (add.input(0)?, add.input(1)?);
            match scores_of(graph, consumers, l) {
                Some((a, b, c)) => (a, b, c, Some(r)),
                None => {
                    let (a, b, c) = scores_of(graph, consumers, r)?;
                    (a, b, c, Some(l))
                }
            }
        }
        None => {
            let (a, b, c) = scores_of(graph, consumers, x)?;
            (a, b, c, None)
        }
    };
    if mask.is_some_and(|m| depends_on_weight(graph, m)) {
        return None;
    }
    let inputs = vec![Some(a), Some(b), Some(v), mask];
    Some(Matched { inputs, scale, guard, dropout })
}

/// Whether `v`'s last dim is known to be over the CUDA kernels' largest head size.
fn heads_too_large_for_cuda(graph: &Graph, v: ValueId) -> bool {
    shape_of(graph, v).and_then(|s| s.last().cloned()).is_some_and(|d| matches!(d, SymDim::Known(n) if n > CUDA_MAX_HEAD_SIZE as i64))
}

pub fn run(graph: &mut Graph, target: Target) -> Result<usize> {
    let consumers = graph.consumers();
    let types = super::autocast::forward_types(graph);
    let mut rewrites = 0;
    for n in 0..graph.nodes.len() {
        if graph.nodes[n].op_type != "MatMul" {
            continue;
        }
        let Some(Matched { mut inputs, scale, guard, dropout }) = match_at(graph, &consumers, &graph.nodes[n]) else {
            continue;
        };
        if inputs[..3].iter().flatten().any(|x| types[x.0] == Some(DType::F64)) {
            continue;
        }
        // Q [.., T, D] and V [.., S, Dv]
        if target == Target::Cuda && [inputs[0], inputs[2]].into_iter().flatten().any(|x| heads_too_large_for_cuda(graph, x)) {
            continue;
        }
        let name = graph.nodes[n].name.clone();
        let out = graph.nodes[n].outputs[0];
        let lse = graph.add_value(&format!("{name}:lse"), ValueKind::Computed, Some(DType::F32), None);
        graph.values[lse.0].producer = Some(NodeId(n));
        let mut attrs = Attrs::default().with("scale", Attr::Float(scale as f32)).with("nan_guard", Attr::Int(guard as i64));
        if let Some((ratio, at)) = dropout {
            // the Dropout draws the stream key where it drew its mask: the fused node reads it
            let key_name = format!("{}:key", graph.nodes[at.0].name);
            let key = graph.add_value(&key_name, ValueKind::Computed, Some(DType::I64), None);
            let d = &mut graph.nodes[at.0];
            let dropped = std::mem::replace(&mut d.outputs, vec![key]);
            d.op_type = "DropoutKey".into();
            d.inputs.clear();
            d.attrs = Attrs::default();
            for o in dropped {
                graph.values[o.0].producer = None;
            }
            graph.values[key.0].producer = Some(at);
            inputs.extend([None, Some(key)]);
            attrs.set("dropout", Attr::Float(ratio as f32));
        }
        graph.nodes[n] = Node { name, op_type: "Attention".into(), inputs, outputs: vec![out, lse], attrs };
        rewrites += 1;
    }
    Ok(rewrites)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Dim;
    use crate::tensor::{Data, Tensor};

    /// Softmax(q · k) · v over [2, 3, 4] q, [2, 4, 5] k and [2, 5, 4] v of type `t`.
    fn attention(t: DType) -> Graph {
        attention_of_heads(t, 4)
    }

    /// The same with heads of `d`: [2, 3, d] q, [2, d, 5] k, [2, 5, d] v.
    fn attention_of_heads(t: DType, d: usize) -> Graph {
        let mut g = Graph::default();
        let dims = |d: &[usize]| Some(d.iter().map(|&x| Dim::Known(x)).collect());
        let q = g.add_value("q", ValueKind::Input, Some(t), dims(&[2, 3, d]));
        let k = g.add_value("k", ValueKind::Input, Some(t), dims(&[2, d, 5]));
        let v = g.add_value("v", ValueKind::Input, Some(t), dims(&[2, 5, d]));
        g.inputs.extend([q, k, v]);
        let s = g.add_node("scores", "MatMul", vec![Some(q), Some(k)], Attrs::default(), 1)[0];
        let p = g.add_node("p", "Softmax", vec![Some(s)], Attrs::default().with("axis", Attr::Int(-1)), 1)[0];
        let y = g.add_node("y", "MatMul", vec![Some(p), Some(v)], Attrs::default(), 1)[0];
        g.outputs.push(y);
        g
    }

    #[test]
    fn float64_attention_keeps_its_products() {
        let mut g = attention(DType::F32);
        assert_eq!(run(&mut g, Target::Cpu).expect("run"), 1);
        assert_eq!(g.nodes[2].op_type, "Attention");
        let mut g = attention(DType::F64);
        assert_eq!(run(&mut g, Target::Cpu).expect("run"), 0, "the CUDA attention kernels take no float64");
        assert!(g.nodes.iter().all(|n| n.op_type != "Attention"));
    }

    /// A CUDA session leaves an attention with heads over 128 (Gemma's 256) unfused: its kernels
    /// would refuse it at the first step; a CPU session fuses it.
    #[test]
    fn cuda_sessions_leave_heads_over_128_unfused() {
        for (d, cuda) in [(128, 1), (256, 0)] {
            assert_eq!(run(&mut attention_of_heads(DType::BF16, d), Target::Cuda).expect("run"), cuda, "heads of {d}");
            assert_eq!(run(&mut attention_of_heads(DType::BF16, d), Target::Cpu).expect("run"), 1, "heads of {d}");
        }
    }

    /// The attention with Dropout(p, ratio, training) between the softmax and the product.
    fn dropped_attention(ratio: f32, training: bool, mask_read: bool) -> Graph {
        let mut g = attention(DType::F32);
        let p = g.nodes[1].outputs[0];
        let r = g.add_const("ratio", Tensor::from_f32(vec![], vec![ratio]));
        let t = g.add_const("training", Tensor::new(vec![], Data::Bool(vec![training as u8])).expect("bool"));
        let outs = g.add_node("drop", "Dropout", vec![Some(p), Some(r), Some(t)], Attrs::default(), 2);
        g.nodes[2].inputs[0] = Some(outs[0]);
        // the Dropout before the product (its index after the softmax's)
        let drop = g.nodes.pop().expect("dropout");
        g.nodes.insert(2, drop);
        if mask_read {
            g.outputs.push(outs[1]);
        }
        g.renumber_producers();
        g
    }

    /// A training-mode Dropout of the probabilities becomes the fused node's `dropout` and a
    /// DropoutKey it reads, an inference-mode one goes; a Dropout whose mask is read keeps the
    /// attention unfused.
    #[test]
    fn the_probabilities_dropout_fuses_unless_its_mask_is_read() {
        let mut g = dropped_attention(0.1, true, false);
        assert_eq!(run(&mut g, Target::Cpu).expect("run"), 1);
        let (key, attn) = (&g.nodes[2], &g.nodes[3]);
        assert_eq!((key.op_type.as_str(), key.inputs.len()), ("DropoutKey", 0));
        assert_eq!(attn.op_type, "Attention");
        assert_eq!(attn.inputs.len(), 6);
        assert_eq!(attn.inputs[5], Some(key.outputs[0]));
        assert!((attn.attrs.float("dropout", 0.0).expect("dropout") - 0.1).abs() < 1e-7);
        let mut g = dropped_attention(0.1, false, false);
        assert_eq!(run(&mut g, Target::Cpu).expect("run"), 1);
        assert_eq!(g.nodes[3].inputs.len(), 4, "inference mode: no dropout, {:?}", g.nodes[3]);
        assert_eq!(g.nodes[3].attrs.float("dropout", 0.0).expect("dropout"), 0.0);
        let mut g = dropped_attention(0.1, true, true);
        assert_eq!(run(&mut g, Target::Cpu).expect("run"), 0, "the mask is read");
    }
}
