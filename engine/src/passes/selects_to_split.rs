//! selects_to_split: a tensor taken apart whole by n Gathers of constant scalar indices along
//! one axis, `x[0], x[1], …, x[n-1]` (nn.MultiheadAttention's packed projection: `q, k, v =
//! proj[0], proj[1], proj[2]` after its unflatten and transpose; `unbind`), becomes one Split of
//! x along that axis into its n parts, each Squeezed (a view). The forward pass makes the same
//! copies. The backward pass gains: each Gather's gradient was a GatherGrad (a zero fill of x's
//! shape, then a scatter of the part) and autodiff added the n of them with n − 1 Adds of x's
//! size; Split's gradient is one Concat of the parts. For the tutorial's two layers, 3n + 1 − n
//! = 7 kernels and five passes over x fewer per layer. The values are the same but for the sign
//! of a zero gradient (a sum with the fill's +0 turned −0 into +0; the Concat keeps −0).

use super::autocast::forward_types;
use super::sym_shape::{shape_of, SymDim};
use crate::ir::{Attr, Attrs, Graph, Node, ValueId, ValueKind};
use crate::tensor::{DType, Tensor};

/// A constant index of rank 0.
fn scalar_index(graph: &Graph, v: ValueId) -> Option<i64> {
    let ValueKind::Const(t) = &graph.value(v).kind else { return None };
    if !t.shape.is_empty() {
        return None;
    }
    t.to_i64_vec()?.first().copied()
}

/// One select: the Gather at node `node` takes part `part` of `x` along `axis`.
struct Select {
    node: usize,
    x: ValueId,
    axis: usize,
    part: usize,
    parts: usize,
}

/// The select node `n` makes, if it is one: a Gather of a rank-0 constant index from float data
/// (shape tensors' Gathers stay as other passes read them) along an axis whose length is known.
fn select_at(graph: &Graph, types: &[Option<DType>], n: usize) -> Option<Select> {
    let node = &graph.nodes[n];
    if node.op_type != "Gather" || node.outputs.len() != 1 {
        return None;
    }
    let (x, idx) = (node.input(0)?, node.input(1)?);
    if !types[x.0].is_some_and(|d| d.is_float()) {
        return None;
    }
    let shape = shape_of(graph, x)?;
    let axis = node.attrs.int("axis", 0).ok()?;
    let axis = if axis < 0 { axis + shape.len() as i64 } else { axis };
    let SymDim::Known(len) = shape.get(usize::try_from(axis).ok()?)? else { return None };
    let i = scalar_index(graph, idx)?;
    let part = if i < 0 { i + len } else { i };
    (0..*len).contains(&part).then_some(Select { node: n, x, axis: axis as usize, part: part as usize, parts: *len as usize })
}

/// Rewrites every complete set of selects; returns how many Splits it made.
pub fn run(graph: &mut Graph) -> usize {
    let types = forward_types(graph);
    let selects: Vec<Select> = (0..graph.nodes.len()).filter_map(|n| select_at(graph, &types, n)).collect();
    // groups by (x, axis): complete when every part is taken exactly once
    let mut groups: Vec<Vec<&Select>> = Vec::new();
    for s in &selects {
        match groups.iter_mut().find(|g| g[0].x == s.x && g[0].axis == s.axis) {
            Some(g) => g.push(s),
            None => groups.push(vec![s]),
        }
    }
    let complete = |g: &&Vec<&Select>| {
        let n = g[0].parts;
        g.len() == n && n > 1 && (0..n).all(|p| g.iter().filter(|s| s.part == p).count() == 1)
    };
    let mut replaced: Vec<Option<Vec<Node>>> = vec![None; graph.nodes.len()];
    let mut splits = 0;
    for group in groups.iter().filter(complete) {
        let (x, axis, n) = (group[0].x, group[0].axis, group[0].parts);
        let first = group.iter().map(|s| s.node).min().expect("a group has a select");
        let name = format!("{}/split", graph.nodes[first].name);
        let outs: Vec<ValueId> = (0..n).map(|p| graph.add_value(&format!("{name}:{p}"), ValueKind::Computed, None, None)).collect();
        let axes = graph.add_const(&format!("{name}/axes"), Tensor::from_i64(vec![1], vec![axis as i64]));
        let split_attrs = Attrs::default().with("axis", Attr::Int(axis as i64));
        let split = Node { name: name.clone(), op_type: "Split".into(), inputs: vec![Some(x)], outputs: outs.clone(), attrs: split_attrs };
        for s in group {
            let gather = &graph.nodes[s.node];
            let squeeze = Node {
                name: gather.name.clone(),
                op_type: "Squeeze".into(),
                inputs: vec![Some(outs[s.part]), Some(axes)],
                outputs: gather.outputs.clone(),
                attrs: Attrs::default(),
            };
            // the Split goes where the first select was (x is computed before it)
            replaced[s.node] = Some(if s.node == first { vec![split.clone(), squeeze] } else { vec![squeeze] });
        }
        splits += 1;
    }
    if splits > 0 {
        let nodes = std::mem::take(&mut graph.nodes);
        graph.nodes = nodes.into_iter().zip(replaced).flat_map(|(node, r)| r.unwrap_or_else(|| vec![node])).collect();
        graph.renumber_producers();
    }
    splits
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Dim;

    /// x f32 [3, 4, 5] (declared), Gathers along `axis` of the given indices (None: an index
    /// computed at run time), each output a graph output.
    fn selects_of(dtype: DType, axis: i64, indices: &[Option<i64>], rank1: bool) -> Graph {
        let mut g = Graph::default();
        let x = g.add_value("x", ValueKind::Input, Some(dtype), Some(vec![Dim::Known(3), Dim::Known(4), Dim::Known(5)]));
        g.inputs.push(x);
        for (k, i) in indices.iter().enumerate() {
            let idx = match i {
                Some(i) if rank1 => g.add_const(&format!("i{k}"), Tensor::from_i64(vec![1], vec![*i])),
                Some(i) => g.add_const(&format!("i{k}"), Tensor::from_i64(vec![], vec![*i])),
                None => {
                    let v = g.add_value(&format!("i{k}"), ValueKind::Input, None, None);
                    g.inputs.push(v);
                    v
                }
            };
            let y =
                g.add_node(&format!("select{k}"), "Gather", vec![Some(x), Some(idx)], Attrs::default().with("axis", Attr::Int(axis)), 1)[0];
            g.outputs.push(y);
        }
        g
    }

    fn selects(axis: i64, indices: &[Option<i64>], rank1: bool) -> Graph {
        selects_of(DType::F32, axis, indices, rank1)
    }

    #[test]
    fn every_part_taken_once_becomes_one_split() {
        // in any order, negative indices counted from the end
        let mut g = selects(0, &[Some(2), Some(0), Some(-2)], false);
        let outputs = g.outputs.clone();
        assert_eq!(run(&mut g), 1);
        let ops: Vec<&str> = g.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(ops, ["Split", "Squeeze", "Squeeze", "Squeeze"]);
        let split = &g.nodes[0];
        assert_eq!(split.input(0), g.find("x"));
        assert_eq!(split.attrs.int("axis", -1).expect("axis"), 0);
        // select k's output (index 2, 0, 1) is now the Squeeze of that part
        for (k, part) in [(0usize, 2usize), (1, 0), (2, 1)] {
            let sq = &g.nodes[g.value(outputs[k]).producer.expect("produced").0];
            assert_eq!((sq.op_type.as_str(), sq.input(0)), ("Squeeze", Some(split.outputs[part])), "select {k}");
        }
        // along the last axis (5 parts), counted from the end
        let mut g = selects(-1, &[Some(0), Some(1), Some(2), Some(3), Some(4)], false);
        assert_eq!(run(&mut g), 1);
        assert_eq!(g.nodes[0].attrs.int("axis", -1).expect("axis"), 2);
        assert_eq!(g.nodes[0].outputs.len(), 5);
    }

    #[test]
    fn partial_repeated_or_unknown_selects_stay_gathers() {
        let cases: [(&str, Graph); 6] = [
            ("integer data (a shape tensor's dims)", selects_of(DType::I64, 0, &[Some(0), Some(1), Some(2)], false)),
            ("a part missing", selects(0, &[Some(0), Some(1)], false)),
            ("a part taken twice", selects(0, &[Some(0), Some(1), Some(1), Some(2)], false)),
            ("an index known only at run time", selects(0, &[Some(0), None, Some(2)], false)),
            ("rank-1 indices (the axis kept)", selects(0, &[Some(0), Some(1), Some(2)], true)),
            ("an index out of range", selects(0, &[Some(0), Some(1), Some(3)], false)),
        ];
        for (what, mut g) in cases {
            assert_eq!(run(&mut g), 0, "{what}");
            assert!(g.nodes.iter().all(|n| n.op_type == "Gather"), "{what}");
        }
    }
}
