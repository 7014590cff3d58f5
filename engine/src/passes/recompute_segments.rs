//! recompute_segments: the forward nodes of the model's checkpointed parts run again in the
//! backward pass, as `torch.utils.checkpoint` does in PyTorch (run on the train graph, after
//! autodiff). The parts come from the model (`graph.recompute`, read at import from the
//! ModelProto metadata the exporter writes, onnx/recompute_segments.rs): each one a module's
//! input and output values. Its nodes are the forward nodes its outputs are computed from,
//! up to its inputs (or another part's boundary); every value one of them makes that a backward
//! node reads, other than the part's outputs, is computed again by copies of the nodes it
//! comes from, inserted just before the first backward node that reads one of them, and those
//! readers read the copies. So the part's intermediate values die with their last forward
//! reader; its inputs (and the weights) live until its backward pass, as PyTorch keeps a
//! checkpoint's inputs.
//!
//! Random nodes are not run twice (a second draw would differ from the first): a Dropout's
//! copy is a DropoutGrad of the recomputed input with the forward pass's mask (y = x·mask/(1-p),
//! the same product), so the part keeps the 1-byte mask instead of the output; other random
//! ops keep their outputs. Same kernels on the same inputs: the gradients are bit for bit those
//! without recomputation.

use std::collections::BTreeSet;

use crate::ir::{Graph, Node, ValueId, ValueKind};

fn is_random(node: &Node) -> bool {
    crate::ops::lookup(&node.op_type).is_some_and(|op| op.is_random())
}

/// A Dropout whose mask is an output: recomputed from its mask (DropoutGrad).
fn dropout_with_mask(node: &Node) -> bool {
    node.op_type == "Dropout" && node.outputs.len() == 2
}

/// A new value for the copy of `o`: its type and declared shape.
fn recomputed_value(graph: &mut Graph, o: ValueId) -> ValueId {
    let value = graph.value(o);
    let (name, dtype, shape) = (format!("{}:recomputed", value.name), value.dtype, value.shape.clone());
    graph.add_value(&name, ValueKind::Computed, dtype, shape)
}

/// Rewrites the train graph whose first `n_fwd` nodes are the forward pass; returns how many
/// parts are now recomputed.
pub fn run(graph: &mut Graph, n_fwd: usize) -> usize {
    if graph.recompute.is_empty() {
        return 0;
    }
    let segments = graph.recompute.clone();
    let n_fwd = n_fwd.min(graph.nodes.len());
    let mut boundary = vec![false; graph.values.len()];
    for s in &segments {
        for v in s.inputs.iter().chain(&s.outputs).filter_map(|n| graph.find(n)) {
            boundary[v.0] = true;
        }
    }
    let mut consumers = graph.consumers();
    for readers in consumers.iter_mut() {
        readers.retain(|(n, k)| !crate::ops::reads_type_only(&graph.nodes[n.0].op_type, *k));
    }
    let producer = |g: &Graph, v: ValueId| g.values[v.0].producer.map(|p| p.0).filter(|&p| p < n_fwd);
    let mut taken = vec![false; n_fwd];
    let mut inserts: Vec<(usize, Vec<Node>)> = Vec::new();
    let mut count = 0;
    for seg in &segments {
        let outs: Vec<ValueId> = seg.outputs.iter().filter_map(|n| graph.find(n)).collect();
        // the part's nodes: from its outputs up to its inputs and the other parts' boundaries
        let mut nodes = BTreeSet::new();
        let mut stack: Vec<usize> = outs.iter().filter_map(|&v| producer(graph, v)).collect();
        while let Some(f) = stack.pop() {
            if taken[f] || !nodes.insert(f) {
                continue;
            }
            for v in graph.nodes[f].inputs.iter().flatten() {
                if !boundary[v.0] {
                    stack.extend(producer(graph, *v));
                }
            }
        }
        for &f in &nodes {
            taken[f] = true;
        }
        // the values the backward pass reads from the part (not its outputs: kept for the
        // readers after it)
        let backward_readers = |v: ValueId| consumers[v.0].iter().filter(|(n, _)| n.0 >= n_fwd).copied().collect::<Vec<_>>();
        let mut needed = Vec::new();
        for &f in &nodes {
            let node = &graph.nodes[f];
            let kept = |k: usize| is_random(node) && !(dropout_with_mask(node) && k == 0);
            for (k, &o) in node.outputs.iter().enumerate() {
                if !outs.contains(&o) && !kept(k) && !graph.outputs.contains(&o) && !backward_readers(o).is_empty() {
                    needed.push(o);
                }
            }
        }
        if needed.is_empty() {
            continue;
        }
        // the nodes that compute them again, in forward order
        let mut copies = BTreeSet::new();
        let mut stack: Vec<usize> = needed.iter().filter_map(|&v| producer(graph, v)).collect();
        while let Some(f) = stack.pop() {
            if !nodes.contains(&f) || !copies.insert(f) {
                continue;
            }
            let node = &graph.nodes[f];
            if is_random(node) && !dropout_with_mask(node) {
                continue;
            }
            let reads = if dropout_with_mask(node) {
                node.input(0).into_iter().collect()
            } else {
                node.inputs.iter().flatten().copied().collect::<Vec<_>>()
            };
            for v in reads {
                stack.extend(producer(graph, v));
            }
        }
        let mut again: Vec<Option<ValueId>> = vec![None; graph.values.len()];
        let mut added = Vec::new();
        for &f in &copies {
            let original = graph.nodes[f].clone();
            if is_random(&original) && !dropout_with_mask(&original) {
                continue; // its outputs are read as they are
            }
            let read = |again: &[Option<ValueId>], v: Option<ValueId>| v.map(|v| again.get(v.0).copied().flatten().unwrap_or(v));
            let name = format!("{}:recompute", original.name);
            let (op_type, inputs, computed) = if dropout_with_mask(&original) {
                let inputs = vec![read(&again, original.input(0)), Some(original.outputs[1]), original.input(1), original.input(2)];
                ("DropoutGrad".to_string(), inputs, vec![original.outputs[0]])
            } else {
                let inputs = original.inputs.iter().map(|&v| read(&again, v)).collect();
                (original.op_type.clone(), inputs, original.outputs.clone())
            };
            let outputs: Vec<ValueId> = computed.iter().map(|&o| recomputed_value(graph, o)).collect();
            again.resize(graph.values.len(), None);
            for (o, n) in computed.iter().zip(&outputs) {
                again[o.0] = Some(*n);
            }
            added.push(Node { name, op_type, inputs, outputs, attrs: original.attrs });
        }
        let mut first = usize::MAX;
        for &v in &needed {
            let Some(copy) = again.get(v.0).copied().flatten() else { continue };
            for (n, k) in backward_readers(v) {
                first = first.min(n.0);
                graph.nodes[n.0].inputs[k] = Some(copy);
            }
        }
        if first == usize::MAX {
            continue;
        }
        count += 1;
        inserts.push((first, added));
    }
    super::insert_before(graph, inserts);
    count
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, Dim, RecomputeSegment};
    use crate::tensor::{DType, Tensor};

    /// Whether a backward node reads the data of `x`.
    fn read_in_backward(g: &Graph, n_fwd: usize, x: ValueId) -> bool {
        g.nodes[n_fwd..]
            .iter()
            .any(|n| n.inputs.iter().enumerate().any(|(k, i)| *i == Some(x) && !crate::ops::reads_type_only(&n.op_type, k)))
    }

    /// Two layers `h = x + Dropout(Gelu(x·W1))·W2`, each a checkpointed part, then a head; the
    /// train graph by autodiff. Returns the graph, n_fwd and each layer's
    /// (product, gelu, dropout output, mask, layer output).
    fn two_layers(parts: bool) -> (Graph, usize, Vec<[ValueId; 5]>) {
        let mut g = Graph::default();
        let f32 = Some(DType::F32);
        let mut x = g.add_value("x", ValueKind::Input, f32, Some(vec![Dim::Known(4), Dim::Known(8)]));
        let ratio = g.add_const("ratio", Tensor::from_f32(vec![], vec![0.25]));
        let on = g.add_const("on", Tensor::from_bytes(DType::Bool, vec![], &[1]).expect("bool"));
        let mut wrt = Vec::new();
        let mut layers = Vec::new();
        for l in 0..2 {
            let w1 = g.add_value(&format!("w1_{l}"), ValueKind::Weight, f32, Some(vec![Dim::Known(8), Dim::Known(16)]));
            let w2 = g.add_value(&format!("w2_{l}"), ValueKind::Weight, f32, Some(vec![Dim::Known(16), Dim::Known(8)]));
            let u = g.add_node(&format!("fc{l}"), "MatMul", vec![Some(x), Some(w1)], Attrs::default(), 1)[0];
            let v = g.add_node(&format!("act{l}"), "Gelu", vec![Some(u)], Attrs::default(), 1)[0];
            let d = g.add_node(&format!("drop{l}"), "Dropout", vec![Some(v), Some(ratio), Some(on)], Attrs::default(), 2);
            let p = g.add_node(&format!("proj{l}"), "MatMul", vec![Some(d[0]), Some(w2)], Attrs::default(), 1)[0];
            let h = g.add_node(&format!("res{l}"), "Add", vec![Some(x), Some(p)], Attrs::default(), 1)[0];
            if parts {
                let name = |v: ValueId| g.value(v).name.clone();
                g.recompute.push(RecomputeSegment { name: format!("layers.{l}"), inputs: vec![name(x)], outputs: vec![name(h)] });
            }
            layers.push([u, v, d[0], d[1], h]);
            wrt.extend([w1, w2]);
            x = h;
        }
        let wh = g.add_value("wh", ValueKind::Weight, f32, Some(vec![Dim::Known(8), Dim::Known(3)]));
        let y = g.add_node("head", "MatMul", vec![Some(x), Some(wh)], Attrs::default(), 1)[0];
        wrt.push(wh);
        g.outputs = vec![y];
        let n_fwd = g.nodes.len();
        let seed = g.add_value("grad:y", ValueKind::Input, f32, None);
        crate::autodiff::build(&mut g, &[y], &[Some(seed)], &wrt).expect("autodiff");
        (g, n_fwd, layers)
    }

    #[test]
    fn a_checkpointed_parts_intermediates_are_computed_again_for_the_backward_pass() {
        let (mut g, n_fwd, layers) = two_layers(true);
        for [u, _, d, _, _] in &layers {
            assert!(read_in_backward(&g, n_fwd, *u) && read_in_backward(&g, n_fwd, *d), "GELU's and the product's gradients read them");
        }
        assert_eq!(run(&mut g, n_fwd), 2);
        for (l, [u, v, d, mask, h]) in layers.iter().enumerate() {
            for (what, x) in [("product", u), ("GELU", v), ("dropout output", d)] {
                assert!(!read_in_backward(&g, n_fwd, *x), "layer {l}'s {what} is not kept for the backward pass");
            }
            assert!(read_in_backward(&g, n_fwd, *mask), "the mask is kept");
            let copy = |name: &str| g.nodes.iter().position(|n| n.name == name).unwrap_or_else(|| panic!("{name}"));
            let (fc, act, drop) =
                (copy(&format!("fc{l}:recompute")), copy(&format!("act{l}:recompute")), copy(&format!("drop{l}:recompute")));
            assert!(n_fwd <= fc && fc < act && act < drop, "copies in the backward pass, in forward order");
            let dropped = &g.nodes[drop];
            assert_eq!(
                (dropped.op_type.as_str(), dropped.input(0), dropped.input(1)),
                ("DropoutGrad", Some(g.nodes[act].outputs[0]), Some(*mask))
            );
            let first_reader = g.nodes.iter().position(|n| n.inputs.contains(&Some(dropped.outputs[0]))).expect("read");
            assert!(drop < first_reader);
            assert!(!g.nodes.iter().any(|n| n.name == format!("res{l}:recompute")), "the part's output is not computed again");
            if l == 0 {
                assert!(read_in_backward(&g, n_fwd, *h), "layer 0's output, layer 1's input, is read by layer 1's copies");
            }
        }
        for (i, n) in g.nodes.iter().enumerate() {
            for o in &n.outputs {
                assert_eq!(g.values[o.0].producer, Some(crate::ir::NodeId(i)), "producers renumbered");
            }
        }
    }

    #[test]
    fn a_model_without_checkpointed_parts_is_left_as_it_is() {
        let (mut g, n_fwd, _) = two_layers(false);
        let before = g.nodes.len();
        assert_eq!(run(&mut g, n_fwd), 0);
        assert_eq!(g.nodes.len(), before);
    }
}
