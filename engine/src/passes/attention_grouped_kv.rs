//! attention_grouped_kv (after attention_keys): grouped-query attention without the repeated
//! keys and values. Hugging Face's `repeat_kv` (Llama, Mistral, Qwen) writes K and V of Hkv heads
//! as Reshape(Expand(K₅, [B, Hkv, r, S, D]), [B, Hkv·r, S, D]) from K₅ [B, Hkv, 1, S, D], a copy
//! r times K's size that the attention then keeps for its backward pass. A BHSD_K Attention whose
//! K and V are both such repeats (the same Hkv and r) reads K₅ and V₅ instead, with Q viewed as
//! [B, Hkv, r, T, D] (query head g·r + j is (g, j): the heads the repeat pairs with kv head g)
//! and O viewed back as [B, H, T, Dv]: the fused op's batch broadcasting (ops/attention.rs) gives
//! each query head its kv head by a zero stride, and its gradient sums dK and dV over the r
//! query heads of a group, as the Expand's gradient did. A rank-4 mask or key-padding flags one
//! per head [b, 1, .., ..] get an axis for the groups. Shapes are proved from the exporter's
//! declared ones (sym_shape.rs); anything else is left as it was.

use super::sym_shape::{shape_of, SymDim};
use crate::ir::{Attrs, Graph, Node, NodeId, ValueId, ValueKind};
use crate::ops::attention::{key_padding_input, layout_attr, Layout};
use crate::tensor::Tensor;

/// A repeat's source [B, Hkv, 1, S, D] and its Hkv and r, where `k` [B, Hkv·r, S, D] is
/// Reshape(Identity*(Expand(source))).
fn repeated(graph: &Graph, k: ValueId) -> Option<(ValueId, i64, i64)> {
    let producer = |v: ValueId| graph.value(v).producer.map(|p| &graph.nodes[p.0]);
    let reshape = producer(k).filter(|n| n.op_type == "Reshape")?;
    let mut x = reshape.input(0)?;
    while let Some(id) = producer(x).filter(|n| n.op_type == "Identity") {
        x = id.input(0)?;
    }
    let expand = producer(x).filter(|n| n.op_type == "Expand")?;
    let source = expand.input(0)?;
    let [b, h, s, d] = dims::<4>(graph, k)?;
    let [xb, g, r, xs, xd] = dims::<5>(graph, x)?;
    let [yb, yg, one, ys, yd] = dims::<5>(graph, source)?;
    let (SymDim::Known(h), SymDim::Known(g), SymDim::Known(r)) = (h, g.clone(), r) else { return None };
    let same = b == xb && xb == yb && s == xs && xs == ys && d == xd && xd == yd && yg == SymDim::Known(g);
    (same && one == SymDim::Known(1) && g * r == h && r > 1).then_some((source, g, r))
}

/// The symbolic shape of `v` as an array of N dims.
fn dims<const N: usize>(graph: &Graph, v: ValueId) -> Option<[SymDim; N]> {
    <[SymDim; N]>::try_from(shape_of(graph, v)?).ok()
}

/// How a mask or flags input of rank `rank` with dims `d` reaches the grouped batch: as it is
/// (rank ≤ 3 broadcasts from the right), or (rank 4, one head) with an axis for the groups.
enum Fit {
    Keep,
    Unsqueeze,
}

fn fit(graph: &Graph, v: ValueId) -> Option<Fit> {
    let d = shape_of(graph, v)?;
    match d.len() {
        0..=3 => Some(Fit::Keep),
        4 if d[1] == SymDim::Known(1) => Some(Fit::Unsqueeze),
        _ => None,
    }
}

/// A new node `op`(inputs, constant `ints`) whose one output is a new value named after `name`.
fn node_with_ints(graph: &mut Graph, name: &str, op: &str, input: ValueId, ints: Vec<i64>) -> (Node, ValueId) {
    let c = graph.add_const(&format!("{name}:{}", op.to_lowercase()), Tensor::from_i64(vec![ints.len()], ints));
    let out = graph.add_value(&format!("{name}:out"), ValueKind::Computed, None, None);
    let node =
        Node { name: name.into(), op_type: op.into(), inputs: vec![Some(input), Some(c)], outputs: vec![out], attrs: Attrs::default() };
    (node, out)
}

pub fn run(graph: &mut Graph) -> usize {
    let mut inserts: Vec<(usize, Vec<Node>)> = Vec::new();
    for n in 0..graph.nodes.len() {
        let node = &graph.nodes[n];
        if node.op_type != "Attention" || layout_attr(node).ok() != Some(Layout::BhsdK) {
            continue;
        }
        let (Some(q), Some(k), Some(v)) = (node.input(0), node.input(1), node.input(2)) else { continue };
        let (Some((k5, g, r)), Some((v5, vg, vr))) = (repeated(graph, k), repeated(graph, v)) else { continue };
        let (Some([_, qh, _, SymDim::Known(qd)]), Some([.., SymDim::Known(dv)])) = (dims::<4>(graph, q), dims::<4>(graph, v)) else {
            continue;
        };
        if (vg, vr) != (g, r) || qh != SymDim::Known(g * r) {
            continue;
        }
        let kp_at = key_padding_input(&node.op_type).unwrap_or(usize::MAX);
        let extra: Vec<(usize, ValueId)> = [3, kp_at].into_iter().filter_map(|i| Some((i, node.input(i)?))).collect();
        let Some(fits) = extra.iter().map(|&(_, x)| fit(graph, x)).collect::<Option<Vec<Fit>>>() else { continue };
        let name = node.name.clone();
        let o = node.outputs[0];
        let mut before = Vec::new();
        let (q_node, q5) = node_with_ints(graph, &format!("{name}:q_grouped"), "Reshape", q, vec![0, g, r, -1, qd]);
        before.push(q_node);
        let mut inputs = graph.nodes[n].inputs.clone();
        inputs[0] = Some(q5);
        inputs[1] = Some(k5);
        inputs[2] = Some(v5);
        for ((i, x), f) in extra.into_iter().zip(fits) {
            if let Fit::Unsqueeze = f {
                let (un, x5) = node_with_ints(graph, &format!("{name}:grouped_{i}"), "Unsqueeze", x, vec![2]);
                before.push(un);
                inputs[i] = Some(x5);
            }
        }
        // O [B, Hkv, r, T, Dv] from the node, viewed as the [B, H, T, Dv] its readers take
        let o5 = graph.add_value(&format!("{name}:o_grouped"), ValueKind::Computed, None, None);
        let (mut o_node, o4) = node_with_ints(graph, &format!("{name}:o_merged"), "Reshape", o5, vec![0, g * r, -1, dv]);
        o_node.outputs = vec![o];
        graph.values[o4.0].producer = None;
        let attn = &mut graph.nodes[n];
        attn.inputs = inputs;
        attn.outputs[0] = o5;
        graph.values[o5.0].producer = Some(NodeId(n));
        inserts.push((n, before));
        inserts.push((n + 1, vec![o_node]));
    }
    let rewrites = inserts.len() / 2;
    super::insert_before(graph, inserts);
    rewrites
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Attr;
    use crate::passes::sym_shape::test_dims as sym;
    use crate::tensor::DType;

    fn input(g: &mut Graph, name: &str, dims: &[&str]) -> ValueId {
        let v = g.add_value(name, ValueKind::Input, Some(DType::F32), sym(dims));
        g.inputs.push(v);
        v
    }

    /// `x` [b, 2, s, 8] repeated `r` times per head: Reshape(Identity(Expand(Unsqueeze(x))))
    /// [b, 2·r, s, 8], shapes declared as torch.export writes them.
    fn repeat(g: &mut Graph, x: ValueId, r: usize, name: &str) -> ValueId {
        let axes = g.add_const(&format!("{name}_axes"), Tensor::from_i64(vec![1], vec![2]));
        let x5 = g.add_node(&format!("{name}_un"), "Unsqueeze", vec![Some(x), Some(axes)], Attrs::default(), 1)[0];
        g.values[x5.0].shape = sym(&["b", "2", "1", "s", "8"]);
        let to = g.add_const(&format!("{name}_to"), Tensor::from_i64(vec![5], vec![1, 2, r as i64, 1, 1]));
        let e = g.add_node(&format!("{name}_expand"), "Expand", vec![Some(x5), Some(to)], Attrs::default(), 1)[0];
        let rs = r.to_string();
        g.values[e.0].shape = sym(&["b", "2", &rs, "s", "8"]);
        let c = g.add_node(&format!("{name}_clone"), "Identity", vec![Some(e)], Attrs::default(), 1)[0];
        g.values[c.0].shape = g.values[e.0].shape.clone();
        let shape = g.add_const(&format!("{name}_shape"), Tensor::from_i64(vec![4], vec![0, 2 * r as i64, -1, 8]));
        let k = g.add_node(&format!("{name}_merge"), "Reshape", vec![Some(c), Some(shape)], Attrs::default(), 1)[0];
        let hs = (2 * r).to_string();
        g.values[k.0].shape = sym(&["b", &hs, "s", "8"]);
        k
    }

    /// A BHSD_K attention over q [b, 2·r, t, 8] and K, V repeated from [b, 2, s, 8]; a mask
    /// [b, 1, t, s] if `masked`; its O read by a Tanh.
    fn grouped(r: usize, masked: bool) -> Graph {
        let mut g = Graph::default();
        let hs = (2 * r).to_string();
        let q = input(&mut g, "q", &["b", &hs, "t", "8"]);
        let (kx, vx) = (input(&mut g, "k", &["b", "2", "s", "8"]), input(&mut g, "v", &["b", "2", "s", "8"]));
        let mask = masked.then(|| input(&mut g, "mask", &["b", "1", "t", "s"]));
        let (k, v) = (repeat(&mut g, kx, r, "k"), repeat(&mut g, vx, r, "v"));
        let attrs = Attrs::default().with("layout", Attr::String("BHSD_K".into()));
        let outs = g.add_node("attn", "Attention", vec![Some(q), Some(k), Some(v), mask], attrs, 2);
        let y = g.add_node("after", "Tanh", vec![Some(outs[0])], Attrs::default(), 1)[0];
        g.outputs.push(y);
        g
    }

    fn ops(g: &Graph) -> Vec<&str> {
        g.nodes.iter().map(|n| n.op_type.as_str()).collect()
    }

    #[test]
    fn a_grouped_query_attention_reads_the_unrepeated_keys_and_values() {
        let mut g = grouped(4, true);
        let (k, v) = (g.inputs[1], g.inputs[2]);
        assert_eq!(run(&mut g), 1);
        let at = g.nodes.iter().position(|n| n.op_type == "Attention").expect("attention");
        let attn = &g.nodes[at];
        let producer = |x: ValueId| &g.nodes[g.value(x).producer.expect("producer").0];
        // K, V: the Unsqueezes' outputs [b, 2, 1, s, 8], before the repeat
        for (i, x) in [(1, k), (2, v)] {
            let source = producer(attn.input(i).expect("input"));
            assert_eq!((source.op_type.as_str(), source.input(0)), ("Unsqueeze", Some(x)), "input {i}");
        }
        let q5 = producer(attn.input(0).expect("q"));
        assert_eq!((q5.op_type.as_str(), q5.input(0)), ("Reshape", Some(g.inputs[0])));
        assert_eq!(producer(attn.input(3).expect("mask")).op_type, "Unsqueeze", "the mask gets the groups' axis");
        // O merged back before its reader, nodes in topological order
        let merged = &g.nodes[at + 1];
        assert_eq!(merged.op_type, "Reshape");
        assert_eq!(merged.input(0), Some(attn.outputs[0]));
        assert_eq!(g.nodes[at + 2].input(0), Some(merged.outputs[0]));
        let position = |x: ValueId| g.value(x).producer.map_or(0, |p| p.0);
        for (i, node) in g.nodes.iter().enumerate() {
            assert!(
                node.inputs.iter().flatten().all(|&x| position(x) <= i),
                "node {i} {} reads a later value: {:?}",
                node.op_type,
                ops(&g)
            );
        }
    }

    #[test]
    fn attentions_without_the_same_repeat_are_left_alone() {
        let mut g = grouped(1, false);
        assert_eq!(run(&mut g), 0, "r = 1: nothing is repeated");
        let mut g = grouped(4, false);
        g.nodes.iter_mut().find(|n| n.op_type == "Attention").expect("attention").attrs = Attrs::default();
        assert_eq!(run(&mut g), 0, "layout BHSD (Kᵀ): attention_keys did not apply");
        let mut g = grouped(4, false);
        let v = g.inputs[2];
        g.nodes.iter_mut().find(|n| n.op_type == "Attention").expect("attention").inputs[2] = Some(v);
        assert_eq!(run(&mut g), 0, "V not repeated");
    }
}
