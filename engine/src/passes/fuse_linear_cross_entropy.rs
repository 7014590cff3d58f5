//! fuse_linear_cross_entropy: SoftmaxCrossEntropyLoss(Reshape(Linear(X, W, b), [-1, N]), labels
//! [, class weights]) with reduction mean or sum becomes one LinearCrossEntropy(X, W, b, labels,
//! class weights) (ops/loss.rs): the LM head and its loss, computed chunk by chunk so that
//! neither the logits nor their gradient are ever whole in memory. Only where nothing else
//! reads the logits (not a graph output, no other consumer of the Linear or the Reshape): were
//! they computed anyway, the fused op would add a fourth LM-head gemm to the three unfused ones.
//! The node's `target` attribute sizes its chunks for the backend (`ops::LceBudget`): a few
//! hundred rows on the CPU (fewer in a bf16/fp16 session: `cpu_half`), thousands on a GPU.

use super::sym_shape::SymDim;
use crate::error::Result;
use crate::ir::{Attr, Attrs, Graph, Node, NodeId, ValueId, ValueKind};

/// The Linear node whose output only the loss reads, through a row-flattening Reshape (or
/// FlattenRows).
fn linear_under(graph: &Graph, consumers: &[Vec<(NodeId, usize)>], scores: ValueId) -> Option<usize> {
    let only_use = |v: ValueId| consumers[v.0].len() == 1 && !graph.outputs.contains(&v);
    let r = &graph.nodes[graph.value(scores).producer?.0];
    let y = r.input(0)?;
    if !only_use(scores) || !only_use(y) {
        return None;
    }
    let lin = graph.value(y).producer?;
    let node = &graph.nodes[lin.0];
    if node.op_type != "Linear" {
        return None;
    }
    let ws = super::fuse_linear::static_shape(graph, node.input(1)?)?;
    let (_, n) = crate::ops::linear::linear_dims(node, &ws).ok()?;
    let flattens = match r.op_type.as_str() {
        "FlattenRows" => true,
        // the target shape a constant, or built from constants (HF's loss: Concat([-1], [n]))
        "Reshape" => match super::sym_shape::values(graph, r.input(1)?)?.as_slice() {
            [SymDim::Known(rows), SymDim::Known(cols)] => *cols == n as i64 && (*rows == -1 || *rows > 0),
            _ => false,
        },
        _ => false,
    };
    flattens.then_some(lin.0)
}

/// The fusion for sessions on the CPU; `half`: a mixed-precision (bf16/fp16 matmul) session.
pub fn run_cpu(graph: &mut Graph, half: bool) -> Result<usize> {
    fuse(graph, if half { "cpu_half" } else { "cpu" })
}

/// The fusion for sessions on CUDA.
pub fn run_cuda(graph: &mut Graph) -> Result<usize> {
    fuse(graph, "cuda")
}

fn fuse(graph: &mut Graph, target: &str) -> Result<usize> {
    let consumers = graph.consumers();
    let mut rewrites = 0;
    for s in 0..graph.nodes.len() {
        let node = &graph.nodes[s];
        if node.op_type != "SoftmaxCrossEntropyLoss" {
            continue;
        }
        // the optional log_prob output needs the whole logits
        let log_prob_read = node.outputs.get(1).is_some_and(|lp| !consumers[lp.0].is_empty() || graph.outputs.contains(lp));
        let reduction = node.attrs.string("reduction", "mean")?;
        if log_prob_read || !matches!(reduction.as_str(), "mean" | "sum") {
            continue;
        }
        let (Some(scores), Some(labels)) = (node.input(0), node.input(1)) else { continue };
        let Some(lin) = linear_under(graph, &consumers, scores) else { continue };
        let linear = &graph.nodes[lin];
        let (Some(x), Some(w)) = (linear.input(0), linear.input(1)) else { continue };
        let bias = linear.input(2);
        let mut attrs =
            Attrs::default().with("transB", Attr::Int(linear.attrs.int("transB", 0)?)).with("reduction", Attr::String(reduction));
        attrs.set("target", Attr::String(target.into()));
        if let Some(a) = node.attrs.get("ignore_index") {
            attrs.set("ignore_index", a.clone());
        }
        let name = node.name.clone();
        let loss = node.outputs[0];
        let class_weights = node.input(2);
        let mut outputs = vec![loss];
        for what in ["dX1", "dW1", "db1", "scratch"] {
            outputs.push(graph.add_value(&format!("{name}:{what}"), ValueKind::Computed, None, None));
        }
        for &o in &outputs {
            graph.values[o.0].producer = Some(NodeId(s));
        }
        graph.nodes[s] = Node {
            name,
            op_type: "LinearCrossEntropy".into(),
            inputs: vec![Some(x), Some(w), bias, Some(labels), class_weights],
            outputs,
            attrs,
        };
        rewrites += 1;
    }
    Ok(rewrites)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Dim;
    use crate::tensor::{DType, Tensor};

    /// loss = SoftmaxCrossEntropyLoss(Reshape(Linear(X, W), Concat([-1], [cols])), labels), as
    /// Hugging Face's loss exports it; the logits a graph output if `logits_out`.
    fn hf_loss(cols: i64, logits_out: bool) -> Graph {
        let mut g = Graph::default();
        let x = g.add_value("x", ValueKind::Input, Some(DType::F32), None);
        let labels = g.add_value("labels", ValueKind::Input, Some(DType::I64), None);
        g.inputs.extend([x, labels]);
        let w = g.add_value("w", ValueKind::Weight, Some(DType::F32), Some(vec![Dim::Known(10), Dim::Known(4)]));
        let logits = g.add_node("head", "Linear", vec![Some(x), Some(w)], Attrs::default().with("transB", Attr::Int(1)), 1)[0];
        let rows = g.add_const("rows", Tensor::from_i64(vec![1], vec![-1]));
        let classes = g.add_const("classes", Tensor::from_i64(vec![1], vec![cols]));
        let shape = g.add_node("cat", "Concat", vec![Some(rows), Some(classes)], Attrs::default().with("axis", Attr::Int(0)), 1)[0];
        let flat = g.add_node("view", "Reshape", vec![Some(logits), Some(shape)], Attrs::default(), 1)[0];
        let loss = g.add_node("ce", "SoftmaxCrossEntropyLoss", vec![Some(flat), Some(labels)], Attrs::default(), 1)[0];
        g.outputs.push(loss);
        if logits_out {
            g.outputs.push(logits);
        }
        g
    }

    fn op_of_loss(g: &Graph) -> &str {
        &g.nodes[g.value(g.outputs[0]).producer.unwrap().0].op_type
    }

    #[test]
    fn a_reshape_to_a_shape_built_from_constants_fuses() {
        let mut g = hf_loss(10, false);
        assert_eq!(run_cpu(&mut g, false).unwrap(), 1);
        assert_eq!(op_of_loss(&g), "LinearCrossEntropy");
    }

    #[test]
    fn logits_read_elsewhere_or_reshaped_to_other_rows_keep_the_graph() {
        for (cols, logits_out) in [(10, true), (5, false)] {
            let mut g = hf_loss(cols, logits_out);
            assert_eq!(run_cpu(&mut g, false).unwrap(), 0, "cols {cols}, logits an output: {logits_out}");
            assert_eq!(op_of_loss(&g), "SoftmaxCrossEntropyLoss");
        }
    }
}
