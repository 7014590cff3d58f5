//! layer_norm_stats (CUDA sessions): every LayerNormalization also gives its Mean and
//! InvStdDev (ONNX's optional outputs), and its gradient LayerNormGrad reads them (ops/norm.rs)
//! instead of recomputing them from x. On the GPU that recomputation is a kernel of its own
//! reading the whole normalised activation again (GPT-2 124M: 25 reads of 48 MiB a step), while
//! the statistics are 8 bytes a row. The forward kernel computes them with the same row
//! reduction as the recomputing kernel, so the gradients are the same bit for bit. The CPU keeps
//! recomputing: its gradient kernel takes each row's statistics from the row it is reading
//! anyway.

use crate::ir::{Graph, NodeId, ValueKind};

/// Adds the missing Mean and InvStdDev outputs; returns how many nodes got them.
pub fn run(graph: &mut Graph) -> usize {
    let mut added = 0;
    for i in 0..graph.nodes.len() {
        let node = &graph.nodes[i];
        if node.op_type != "LayerNormalization" || node.outputs.len() >= 3 || node.outputs.is_empty() {
            continue;
        }
        let name = node.name.clone();
        while graph.nodes[i].outputs.len() < 3 {
            let what = if graph.nodes[i].outputs.len() == 1 { "mean" } else { "inv_std_dev" };
            let v = graph.add_value(&format!("{name}:{what}"), ValueKind::Computed, None, None);
            graph.values[v.0].producer = Some(NodeId(i));
            graph.nodes[i].outputs.push(v);
        }
        added += 1;
    }
    added
}
