//! attention_packed_qkv (CUDA sessions, after attention_layout, before autocast): a self-attention
//! whose Q, K and V are the three parts of one projection, X [B, T, 3·H·D] split on its last
//! axis and each part reshaped to [B, T, H, D] (GPT-2's `c_attn(x).split(n_embd, dim=2)`), reads
//! X itself (`layout = "BS3HD"`, `heads = H`, ops/attention.rs): the kernels address Q, K and V
//! inside X's rows, and AttentionGrad writes dQ, dK and dV into one tensor laid out as X. The
//! Split (three [B, T, H·D] copies a layer) and its gradient's Concat (one [B, T, 3·H·D] copy)
//! are not made. The reshapes are proved from the exporter's declared shapes (sym_shape.rs).

use super::attention_layout::reshaped;
use super::sym_shape::{reshapes_to, shape_of, values, SymDim};
use crate::ir::{Attr, Graph, NodeId, ValueId};
use crate::ops::attention::{layout_attr, Layout};

/// X and the heads H when `parts` (Q, K, V of an attention in layout BSHD)
/// are outputs 0, 1, 2 of one Split of X on its last axis (read through Identity nodes, as the
/// importer writes SplitToSequence + SequenceAt), each through a Reshape that splits H·D into
/// [H, D], and nothing else reads their data.
fn packed_source(graph: &Graph, consumers: &[Vec<(NodeId, usize)>], attention: NodeId, parts: [ValueId; 3]) -> Option<(ValueId, usize)> {
    // Shape nodes may read a part too (the exporters' reshape targets): they need no data
    let only_reader = |v: ValueId, want: (NodeId, usize)| {
        let mut data = consumers[v.0].iter().filter(|(c, _)| graph.nodes[c.0].op_type != "Shape");
        data.next() == Some(&want) && data.next().is_none() && !graph.outputs.contains(&v)
    };
    let mut split = None;
    let mut heads = None;
    for (i, &x) in parts.iter().enumerate() {
        let (mut part, target) = reshaped(graph, x)?;
        // the part [B, T, H·D] and the reshape's target [B, T, H, D]
        let [b, t, SymDim::Known(hd)] = <[SymDim; 3]>::try_from(shape_of(graph, part)?).ok()? else { return None };
        // the heads may be written -1 (Hugging Face's `x.size()[:-1] + (-1, head_dim)`)
        let [.., SymDim::Known(h), SymDim::Known(d)] = target[..] else { return None };
        let h = if h == -1 && d > 0 { hd / d } else { h };
        if h <= 0 || d <= 0 || h * d != hd || !reshapes_to(&target, &[b, t, SymDim::Known(h), SymDim::Known(d)]) {
            return None;
        }
        if *heads.get_or_insert((h, d)) != (h, d) || !only_reader(x, (attention, i)) {
            return None;
        }
        let mut reader = (graph.value(x).producer?, 0);
        let producer = loop {
            if !only_reader(part, reader) {
                return None;
            }
            let p = graph.value(part).producer?;
            if graph.nodes[p.0].op_type != "Identity" {
                break p;
            }
            reader = (p, 0);
            part = graph.nodes[p.0].input(0)?;
        };
        let node = &graph.nodes[producer.0];
        let at = node.outputs.iter().position(|&o| o == part)?;
        if node.op_type != "Split" || at != i || node.outputs.len() != 3 || *split.get_or_insert(producer) != producer {
            return None;
        }
    }
    let node = &graph.nodes[split?.0];
    let (h, d) = heads?;
    // the parts' shapes are [B, T, H·D]: axis 2 is the last
    if !matches!(node.attrs.int("axis", 0).ok()?, 2 | -1) {
        return None;
    }
    // explicit sizes, if any, are the three equal parts
    let sizes = match node.input(1) {
        Some(s) => Some(values(graph, s)?),
        None => node.attrs.ints("split").ok()?.map(|v| v.into_iter().map(SymDim::Known).collect()),
    };
    if sizes.is_some_and(|s| s != vec![SymDim::Known(h * d); 3]) {
        return None;
    }
    Some((node.input(0)?, h as usize))
}

pub fn run(graph: &mut Graph) -> usize {
    let consumers = graph.consumers();
    let mut rewrites = 0;
    for n in 0..graph.nodes.len() {
        let node = &graph.nodes[n];
        if node.op_type != "Attention" || layout_attr(node).ok() != Some(Layout::Bshd) {
            continue;
        }
        let (Some(q), Some(k), Some(v)) = (node.input(0), node.input(1), node.input(2)) else { continue };
        let Some((x, heads)) = packed_source(graph, &consumers, NodeId(n), [q, k, v]) else { continue };
        let node = &mut graph.nodes[n];
        node.inputs[..3].fill(Some(x));
        node.attrs.set("layout", Attr::String("BS3HD".into()));
        node.attrs.set("heads", Attr::Int(heads as i64));
        // the Split and the Reshapes now write values nobody reads: the dead-node sweep drops them
        rewrites += 1;
    }
    rewrites
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, ValueKind};
    use crate::tensor::{DType, Tensor};

    use crate::passes::sym_shape::test_dims as sym;

    /// GPT-2's self-attention after attention_layout: X [b, t, 96] split in three on axis
    /// `axis` (sizes `sizes`), each part [b, t, 32] reshaped to [b, t, 4, 8], into an Attention
    /// in layout BSHD; `swap`: K and V's parts the other way round; `extra`: the K part is also
    /// a graph output.
    fn gpt2_like(axis: i64, sizes: &[i64], swap: bool, extra: bool) -> Graph {
        let mut g = Graph::default();
        let x = g.add_value("x", ValueKind::Input, Some(DType::BF16), sym(&["b", "t", "96"]));
        g.inputs.push(x);
        let split_sizes = g.add_const("sizes", Tensor::from_i64(vec![sizes.len()], sizes.to_vec()));
        let attrs = Attrs::default().with("axis", Attr::Int(axis));
        let split = g.add_node("split", "Split", vec![Some(x), Some(split_sizes)], attrs, 3);
        // SequenceAt as the importer writes it: an Identity of the part, with the declared shape
        let parts: Vec<ValueId> = (0..3)
            .map(|i| {
                let p = g.add_node(&format!("at{i}"), "Identity", vec![Some(split[i])], Attrs::default(), 1)[0];
                g.values[p.0].shape = sym(&["b", "t", "32"]);
                p
            })
            .collect();
        // [b, t, -1, 8] as Hugging Face's GPT-2 writes it: the part's leading dims, the heads left
        // to the reshape, the head size
        let shape = g.add_node("shape", "Shape", vec![Some(parts[0])], Attrs::default().with("end", Attr::Int(2)), 1)[0];
        let tail = g.add_const("tail", Tensor::from_i64(vec![2], vec![-1, 8]));
        let heads = g.add_node("target", "Concat", vec![Some(shape), Some(tail)], Attrs::default().with("axis", Attr::Int(0)), 1)[0];
        let order = if swap { [0, 2, 1] } else { [0, 1, 2] };
        let xs: Vec<ValueId> = order
            .iter()
            .map(|&i| {
                let r = g.add_node(&format!("r{i}"), "Reshape", vec![Some(parts[i]), Some(heads)], Attrs::default(), 1)[0];
                g.values[r.0].shape = sym(&["b", "t", "4", "8"]);
                r
            })
            .collect();
        let attrs = Attrs::default().with("layout", Attr::String("BSHD".into()));
        let outs = g.add_node("attn", "Attention", xs.iter().map(|&v| Some(v)).collect(), attrs, 2);
        g.outputs.push(outs[0]);
        if extra {
            g.outputs.push(split[1]);
        }
        g
    }

    #[test]
    fn one_split_projection_is_read_in_place() {
        for (axis, sizes) in [(2, vec![32, 32, 32]), (-1, vec![32, 32, 32])] {
            let mut g = gpt2_like(axis, &sizes, false, false);
            assert_eq!(run(&mut g), 1);
            super::super::remove_dead_nodes(&mut g);
            let a = g.nodes.iter().find(|n| n.op_type == "Attention").expect("attention");
            let names: Vec<&str> = a.inputs.iter().flatten().map(|v| g.value(*v).name.as_str()).collect();
            assert_eq!(names, ["x", "x", "x"]);
            assert_eq!(a.attrs.string("layout", "").expect("layout"), "BS3HD");
            assert_eq!(a.attrs.int("heads", 0).expect("heads"), 4);
            let ops: Vec<&str> = g.nodes.iter().map(|n| n.op_type.as_str()).collect();
            assert_eq!(ops, ["Attention"], "the split, the reshapes and their shape expressions are gone");
        }
    }

    #[test]
    fn other_splits_keep_their_parts() {
        let mut g = gpt2_like(2, &[32, 32, 32], true, false);
        assert_eq!(run(&mut g), 0, "K and V from each other's parts");
        let mut g = gpt2_like(2, &[32, 32, 32], false, true);
        assert_eq!(run(&mut g), 0, "a part read elsewhere");
        let mut g = gpt2_like(1, &[32, 32, 32], false, false);
        assert_eq!(run(&mut g), 0, "a split on another axis");
        let mut g = gpt2_like(2, &[16, 32, 48], false, false);
        assert_eq!(run(&mut g), 0, "unequal parts");
    }
}
