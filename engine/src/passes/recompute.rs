//! recompute: activations recomputed in the backward pass instead of kept from the forward
//! pass (run on the train graph, after autodiff). Where a one-input activation `v = f(u)`
//! (GELU, LeakyReLU, ...) is read by backward nodes, directly or through views (a Reshape of
//! it shares its memory), and its input `u` is kept for the backward pass anyway (the
//! activation's own gradient reads it), the backward readers get `f(u)` (and the views of it)
//! computed again just before the first of them: `v` is dead once the forward pass has used
//! it. In GPT-2 that is the MLP's GELU output, read by the second projection's weight gradient:
//! [batch·seq, 4·width] per layer, the largest saved activation after the fused attention. It
//! costs one elementwise pass per layer; torch.compile's min-cut partitioner makes the same
//! trade on GPUs. Bitwise the same results: the same kernel on the same input. A Linear with a
//! GELU (passes/fuse_linear_gelu.rs) is an activation of its output 1 here: its output 0 is
//! recomputed by a Gelu of output 1, which the GELU's gradient reads. That GELU's kernel reads
//! the stored (rounded) product where cuBLASLt's epilogue took the GELU of the unrounded sum:
//! in 16 bits the two may differ in the last bit, as llm.c's recomputation does.

use super::VIEWS;
use crate::ir::{Attr, Attrs, Graph, Node, NodeId, ValueId, ValueKind};

/// Cheap one-input activations (one elementwise pass to recompute).
const RECOMPUTABLE: &[&str] = &["Gelu", "LeakyRelu", "Relu", "Tanh", "Sigmoid", "Erf", "Softplus", "HardSigmoid"];

/// The input `u` of an activation `v = f(u)` that `node` computes as its output 0: a
/// RECOMPUTABLE op's one input, or a Linear with a GELU's output 1.
fn activation_input(node: &Node) -> Option<ValueId> {
    if node.op_type == "Linear" {
        let gelu = crate::ops::linear::gelu_after(node).ok() == Some(true);
        return node.outputs.get(1).copied().filter(|_| gelu && node.outputs.len() == 2);
    }
    let one_to_one = node.outputs.len() == 1 && node.inputs.len() == 1;
    one_to_one.then(|| node.input(0)).flatten().filter(|_| RECOMPUTABLE.contains(&node.op_type.as_str()))
}

/// Rewrites the train graph whose first `n_fwd` nodes are the forward pass; returns how many
/// activations are now recomputed.
pub fn run(graph: &mut Graph, n_fwd: usize) -> usize {
    // reads of the data (a Shape of a value reads its type only: it keeps no memory alive)
    let mut consumers = graph.consumers();
    for readers in consumers.iter_mut() {
        readers.retain(|(n, k)| !crate::ops::reads_type_only(&graph.nodes[n.0].op_type, *k));
    }
    let backward = |readers: &[(NodeId, usize)]| readers.iter().filter(|(n, _)| n.0 >= n_fwd).copied().collect::<Vec<_>>();
    // (index of the first backward reader, the nodes recomputing there, in order)
    let mut inserts: Vec<(usize, Vec<Node>)> = Vec::new();
    let mut count = 0;
    for f in 0..n_fwd.min(graph.nodes.len()) {
        let Some(u) = activation_input(&graph.nodes[f]) else { continue };
        if backward(&consumers[u.0]).is_empty() {
            continue;
        }
        // the activation and its views, each with the forward nodes from the activation to it
        let mut targets = vec![(graph.nodes[f].outputs[0], vec![f])];
        let mut found = Vec::new();
        while let Some((value, chain)) = targets.pop() {
            if graph.outputs.contains(&value) {
                found.clear(); // a graph output stays as it is, and so must what it views
                break;
            }
            let readers = backward(&consumers[value.0]);
            if !readers.is_empty() {
                found.push((chain.clone(), readers));
            }
            for &(n, k) in &consumers[value.0] {
                let view = &graph.nodes[n.0];
                if n.0 < n_fwd && k == 0 && view.outputs.len() == 1 && VIEWS.contains(&view.op_type.as_str()) {
                    let mut longer = chain.clone();
                    longer.push(n.0);
                    targets.push((view.outputs[0], longer));
                }
            }
        }
        if !found.is_empty() {
            count += 1;
        }
        for (chain, readers) in found {
            let mut nodes = Vec::with_capacity(chain.len());
            let mut input = u;
            for &c in &chain {
                let original = graph.nodes[c].clone();
                let value = graph.value(original.outputs[0]);
                let (v_name, dtype) = (value.name.clone(), value.dtype);
                let again = graph.add_value(&format!("{v_name}:recomputed"), ValueKind::Computed, dtype, None);
                let name = format!("{}:recompute", original.name);
                let node = if original.op_type == "Linear" {
                    let tanh = Attrs::default().with("approximate", Attr::String("tanh".into()));
                    Node { name, op_type: "Gelu".into(), inputs: vec![Some(input)], outputs: vec![again], attrs: tanh }
                } else {
                    let mut inputs = original.inputs.clone();
                    inputs[0] = Some(input);
                    Node { name, inputs, outputs: vec![again], ..original }
                };
                nodes.push(node);
                input = again;
            }
            let first = readers.iter().map(|(n, _)| n.0).min().unwrap_or(n_fwd);
            for (n, k) in readers {
                graph.nodes[n.0].inputs[k] = Some(input);
            }
            inserts.push((first, nodes));
        }
    }
    super::insert_before(graph, inserts);
    count
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Dim;
    use crate::tensor::DType;

    /// Whether a backward node reads the data of `x` (not only its type).
    fn read_in_backward(g: &Graph, n_fwd: usize, x: crate::ir::ValueId) -> bool {
        g.nodes[n_fwd..]
            .iter()
            .any(|n| n.inputs.iter().enumerate().any(|(k, i)| *i == Some(x) && !crate::ops::reads_type_only(&n.op_type, k)))
    }

    /// x → MatMul(W1) → u → `act` → v → MatMul(W2) → y, with the gradient of W2 (reads v) and
    /// Gelu's gradient (reads u) built by autodiff.
    fn mlp(act: &str) -> (Graph, usize) {
        mlp_viewed(act, false)
    }

    /// As `mlp`, with `viewed`: the projection reads a Reshape of the activation.
    fn mlp_viewed(act: &str, viewed: bool) -> (Graph, usize) {
        let mut g = Graph::default();
        let x = g.add_value("x", ValueKind::Input, Some(DType::F32), Some(vec![Dim::Known(4), Dim::Known(8)]));
        let w1 = g.add_value("w1", ValueKind::Weight, Some(DType::F32), Some(vec![Dim::Known(8), Dim::Known(16)]));
        let w2 = g.add_value("w2", ValueKind::Weight, Some(DType::F32), Some(vec![Dim::Known(16), Dim::Known(8)]));
        let u = g.add_node("fc", "MatMul", vec![Some(x), Some(w1)], Attrs::default(), 1)[0];
        let v = g.add_node("act", act, vec![Some(u)], Attrs::default(), 1)[0];
        let v = if viewed {
            let shape = g.add_const("shape", crate::tensor::Tensor::from_i64(vec![2], vec![4, 16]));
            g.add_node("view", "Reshape", vec![Some(v), Some(shape)], Attrs::default(), 1)[0]
        } else {
            v
        };
        let y = g.add_node("proj", "MatMul", vec![Some(v), Some(w2)], Attrs::default(), 1)[0];
        g.outputs = vec![y];
        let n_fwd = g.nodes.len();
        let seed = g.add_value("grad:y", ValueKind::Input, Some(DType::F32), None);
        crate::autodiff::build(&mut g, &[y], &[Some(seed)], &[w1, w2]).expect("autodiff");
        (g, n_fwd)
    }

    #[test]
    fn the_backward_pass_reads_a_recomputed_activation() {
        let (mut g, n_fwd) = mlp("Gelu");
        let v = g.nodes[1].outputs[0];
        assert!(read_in_backward(&g, n_fwd, v), "W2's gradient reads the GELU output");
        assert_eq!(run(&mut g, n_fwd), 1);
        assert!(!read_in_backward(&g, n_fwd, v), "no backward node reads the saved output");
        let again = g.nodes.iter().position(|n| n.name == "act:recompute").expect("recomputing node");
        assert!(again >= n_fwd, "recomputed in the backward pass");
        let out = g.nodes[again].outputs[0];
        let first_reader = g.nodes.iter().position(|n| n.inputs.contains(&Some(out))).expect("read");
        assert!(again < first_reader, "before its first reader");
        for (i, n) in g.nodes.iter().enumerate() {
            for o in &n.outputs {
                assert_eq!(g.values[o.0].producer, Some(NodeId(i)), "producers renumbered");
            }
        }
    }

    /// A Linear with a GELU (passes/fuse_linear_gelu.rs): its output 0 is recomputed by a tanh
    /// Gelu of output 1, the input its gradient reads anyway.
    #[test]
    fn a_linears_gelu_is_recomputed_from_its_output_1() {
        let mut g = Graph::default();
        let x = g.add_value("x", ValueKind::Input, Some(DType::F32), Some(vec![Dim::Known(4), Dim::Known(8)]));
        let w1 = g.add_value("w1", ValueKind::Weight, Some(DType::F32), Some(vec![Dim::Known(8), Dim::Known(16)]));
        let w2 = g.add_value("w2", ValueKind::Weight, Some(DType::F32), Some(vec![Dim::Known(16), Dim::Known(8)]));
        let gelu = Attrs::default().with("activation", Attr::String("gelu_tanh".into()));
        let fc = g.add_node("fc", "Linear", vec![Some(x), Some(w1)], gelu, 2);
        let (h, pre) = (fc[0], fc[1]);
        let y = g.add_node("proj", "MatMul", vec![Some(h), Some(w2)], Attrs::default(), 1)[0];
        g.outputs = vec![y];
        let n_fwd = g.nodes.len();
        let seed = g.add_value("grad:y", ValueKind::Input, Some(DType::F32), None);
        crate::autodiff::build(&mut g, &[y], &[Some(seed)], &[w1, w2]).expect("autodiff");
        assert!(read_in_backward(&g, n_fwd, h) && read_in_backward(&g, n_fwd, pre));
        assert_eq!(run(&mut g, n_fwd), 1);
        assert!(!read_in_backward(&g, n_fwd, h), "no backward node reads the saved result");
        let again = g.nodes.iter().find(|n| n.name == "fc:recompute").expect("recomputing node");
        assert_eq!((again.op_type.as_str(), again.input(0)), ("Gelu", Some(pre)));
        assert_eq!(again.attrs.string("approximate", "none").ok().as_deref(), Some("tanh"));
    }

    #[test]
    fn an_activation_whose_input_is_not_kept_stays_saved() {
        // Relu's gradient reads its output, not its input: recomputing would keep u alive instead
        let (mut g, n_fwd) = mlp("Relu");
        assert_eq!(run(&mut g, n_fwd), 0);
    }

    #[test]
    fn a_view_of_the_activation_is_recomputed_with_it() {
        let (mut g, n_fwd) = mlp_viewed("Gelu", true);
        let (v, w) = (g.nodes[1].outputs[0], g.nodes[2].outputs[0]);
        assert!(read_in_backward(&g, n_fwd, w), "W2's gradient reads the view");
        assert_eq!(run(&mut g, n_fwd), 1);
        assert!(!read_in_backward(&g, n_fwd, v) && !read_in_backward(&g, n_fwd, w), "no backward node reads the activation or its view");
        let names: Vec<&str> = g.nodes[n_fwd..].iter().map(|n| n.name.as_str()).filter(|n| n.ends_with(":recompute")).collect();
        assert_eq!(names, ["act:recompute", "view:recompute"]);
    }
}
