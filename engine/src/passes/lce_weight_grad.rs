//! lce_weight_grad (train graph, both targets): a LinearCrossEntropy whose unit-seed weight
//! gradient dW₁ nothing reads (its weight is frozen: a LoRA fine-tune's LM head) gets
//! `weight_grad = 0`: dW₁ becomes an empty tensor (no arena space: a [vocab, hidden] buffer)
//! and the kernels skip its product, a third of the node's work (ops/loss.rs).

use crate::ir::{Attr, Graph};

pub fn run(graph: &mut Graph, n_fwd: usize) -> usize {
    let consumers = graph.consumers();
    let mut rewrites = 0;
    for s in 0..n_fwd.min(graph.nodes.len()) {
        let node = &graph.nodes[s];
        if node.op_type != "LinearCrossEntropy" || node.attrs.int("weight_grad", 1).ok() == Some(0) {
            continue;
        }
        let Some(&dw) = node.outputs.get(2) else { continue };
        if consumers[dw.0].is_empty() && !graph.outputs.contains(&dw) {
            graph.nodes[s].attrs.set("weight_grad", Attr::Int(0));
            graph.values[dw.0].shape = None; // re-inferred at plan time: empty
            rewrites += 1;
        }
    }
    rewrites
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, Dim, ValueKind};
    use crate::tensor::DType;

    /// loss, dX₁, dW₁, db₁, scratch = LinearCrossEntropy(x, w, labels); dW₁ read by a Mul when
    /// `weight_trains`, as autodiff wires a trainable weight's gradient.
    fn lce_graph(weight_trains: bool) -> Graph {
        let mut g = Graph::default();
        let x = g.add_value("x", ValueKind::Input, Some(DType::F32), None);
        let labels = g.add_value("labels", ValueKind::Input, Some(DType::I64), None);
        let w = g.add_value("w", ValueKind::Weight, Some(DType::F32), Some(vec![Dim::Known(10), Dim::Known(4)]));
        g.inputs.extend([x, labels]);
        let outs = g.add_node("lce", "LinearCrossEntropy", vec![Some(x), Some(w), None, Some(labels)], Attrs::default(), 5);
        g.outputs.push(outs[0]);
        if weight_trains {
            let dw = g.add_node("dw", "Mul", vec![Some(outs[2]), Some(outs[0])], Attrs::default(), 1)[0];
            g.outputs.push(dw);
        }
        g
    }

    #[test]
    fn only_an_unread_weight_gradient_is_dropped() {
        for trains in [false, true] {
            let mut g = lce_graph(trains);
            assert_eq!(run(&mut g, 1), usize::from(!trains));
            let wanted = crate::ops::loss::lce_weight_grad(&g.nodes[0]).ok();
            assert_eq!(wanted, Some(trains), "weight trains: {trains}");
        }
    }
}
