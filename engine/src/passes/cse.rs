//! cse: common subexpressions computed once. Constants with the same type, shape and bytes
//! become one value; then, in node order, a node with the same op type, attributes and inputs
//! as an earlier one reads that node's outputs instead of computing its own (the pipeline's
//! dead-node sweep drops it). Exporters repeat work per layer: Hugging Face GPT-2's additive
//! causal mask `Where(mask, 0, -inf)` is built by every attention block, a
//! [batch, 1, seq, seq] f32 tensor each that the fused attention keeps for its backward pass.
//! Random ops are never merged (each draws its own numbers), nor nodes writing graph outputs.

use std::collections::HashMap;

use crate::error::Result;
use crate::ir::{Attrs, Graph, ValueId, ValueKind};
use crate::ops;

/// Constants larger than this many bytes are left as they are (hashing them costs more than
/// sharing them saves: the exporters' repeated constants are scalars and shape vectors).
const MAX_CONST_BYTES: usize = 4096;

/// Maps every constant to the first constant equal to it.
fn canonical_consts(graph: &Graph) -> Vec<ValueId> {
    let mut canon: Vec<ValueId> = (0..graph.values.len()).map(ValueId).collect();
    let mut first: HashMap<(String, Vec<usize>, &[u8]), ValueId> = HashMap::new();
    for (i, v) in graph.values.iter().enumerate() {
        let ValueKind::Const(t) = &v.kind else { continue };
        let bytes = t.as_bytes();
        if bytes.len() > MAX_CONST_BYTES || graph.outputs.contains(&ValueId(i)) {
            continue;
        }
        canon[i] = *first.entry((t.dtype().name().to_string(), t.shape.clone(), bytes)).or_insert(ValueId(i));
    }
    canon
}

/// Attributes equal, floats by value and sign (`==` takes -0.0 for 0.0; ConstantOfShape's
/// -0.0 is another constant: 1/x differs).
fn same_attrs(a: &Attrs, b: &Attrs) -> bool {
    a == b && format!("{a:?}") == format!("{b:?}")
}

pub fn run(graph: &mut Graph) -> Result<usize> {
    let mut canon = canonical_consts(graph);
    let mut rewrites = canon.iter().enumerate().filter(|(i, c)| c.0 != *i).count();
    // (op type, canonical inputs) -> nodes seen with them
    let mut seen: HashMap<(String, Vec<Option<usize>>), Vec<usize>> = HashMap::new();
    for n in 0..graph.nodes.len() {
        let node = &mut graph.nodes[n];
        for v in node.inputs.iter_mut().flatten() {
            *v = canon[v.0];
        }
        let node = &graph.nodes[n];
        let mergeable =
            ops::lookup(&node.op_type).is_some_and(|op| !op.is_random()) && !node.outputs.iter().any(|o| graph.outputs.contains(o));
        if !mergeable {
            continue;
        }
        let key = (node.op_type.clone(), node.inputs.iter().map(|v| v.map(|v| v.0)).collect());
        let same = seen.entry(key).or_default();
        let earlier = same.iter().copied().find(|&m| {
            let other = &graph.nodes[m];
            same_attrs(&other.attrs, &node.attrs) && other.outputs.len() == node.outputs.len()
        });
        match earlier {
            Some(m) => {
                for (k, o) in node.outputs.iter().enumerate() {
                    canon[o.0] = graph.nodes[m].outputs[k];
                }
                rewrites += 1;
            }
            None => same.push(n),
        }
    }
    Ok(rewrites)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attr, Attrs, Dim};
    use crate::tensor::{DType, Tensor};

    fn scalar(g: &mut Graph, name: &str, x: f32) -> ValueId {
        g.add_const(name, Tensor::from_f32(vec![], vec![x]))
    }

    #[test]
    fn equal_constants_and_repeated_nodes_are_computed_once() {
        let mut g = Graph::default();
        let m = g.add_value("m", ValueKind::Input, Some(DType::Bool), Some(vec![Dim::Known(4)]));
        let (zero_a, inf_a) = (scalar(&mut g, "z1", 0.0), scalar(&mut g, "i1", f32::NEG_INFINITY));
        let (zero_b, inf_b) = (scalar(&mut g, "z2", 0.0), scalar(&mut g, "i2", f32::NEG_INFINITY));
        let a = g.add_node("mask_a", "Where", vec![Some(m), Some(zero_a), Some(inf_a)], Attrs::default(), 1)[0];
        let b = g.add_node("mask_b", "Where", vec![Some(m), Some(zero_b), Some(inf_b)], Attrs::default(), 1)[0];
        // same op and inputs, other attributes: two computations
        let sa = g.add_node("sa", "Softmax", vec![Some(a)], Attrs::default().with("axis", Attr::Int(0)), 1)[0];
        let sb = g.add_node("sb", "Softmax", vec![Some(b)], Attrs::default().with("axis", Attr::Int(-1)), 1)[0];
        let sum = g.add_node("sum", "Add", vec![Some(sa), Some(sb)], Attrs::default(), 1)[0];
        let both = g.add_node("both", "Add", vec![Some(a), Some(b)], Attrs::default(), 1)[0];
        g.outputs = vec![sum, both];
        let n = run(&mut g).unwrap();
        assert_eq!(n, 3, "two constants and one Where");
        let node = |name: &str| g.nodes.iter().find(|x| x.name == name).unwrap().clone();
        assert_eq!(node("mask_b").inputs, node("mask_a").inputs);
        assert_eq!(node("sb").inputs, vec![Some(a)]);
        assert_eq!(node("sa").inputs, vec![Some(a)]);
        assert_eq!(node("both").inputs, vec![Some(a), Some(a)]);
    }

    #[test]
    fn attributes_differing_in_the_sign_of_zero_are_not_merged() {
        let mut g = Graph::default();
        let shape = g.add_value("s", ValueKind::Input, Some(DType::I64), Some(vec![Dim::Known(1)]));
        let fill = |x: f32| Attrs::default().with("value", Attr::Tensor(Tensor::from_f32(vec![1], vec![x])));
        let a = g.add_node("a", "ConstantOfShape", vec![Some(shape)], fill(0.0), 1)[0];
        let b = g.add_node("b", "ConstantOfShape", vec![Some(shape)], fill(-0.0), 1)[0];
        let s = g.add_node("sum", "Add", vec![Some(a), Some(b)], Attrs::default(), 1)[0];
        g.outputs = vec![s];
        assert_eq!(run(&mut g).unwrap(), 0);
    }

    #[test]
    fn random_ops_and_graph_outputs_are_never_merged() {
        let mut g = Graph::default();
        let x = g.add_value("x", ValueKind::Input, Some(DType::F32), Some(vec![Dim::Known(4)]));
        let ratio = scalar(&mut g, "r", 0.5);
        let d1 = g.add_node("d1", "Dropout", vec![Some(x), Some(ratio)], Attrs::default(), 1)[0];
        let d2 = g.add_node("d2", "Dropout", vec![Some(x), Some(ratio)], Attrs::default(), 1)[0];
        let r1 = g.add_node("r1", "Relu", vec![Some(x)], Attrs::default(), 1)[0];
        let r2 = g.add_node("r2", "Relu", vec![Some(x)], Attrs::default(), 1)[0];
        let s = g.add_node("s", "Add", vec![Some(d1), Some(d2)], Attrs::default(), 1)[0];
        g.outputs = vec![s, r1, r2];
        assert_eq!(run(&mut g).unwrap(), 0);
        assert_eq!(g.nodes.iter().find(|n| n.name == "s").unwrap().inputs, vec![Some(d1), Some(d2)]);
    }
}
