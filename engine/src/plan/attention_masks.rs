//! Which values only ever become an attention mask: read by fused attention nodes in their mask
//! slot, directly or through nodes all of whose outputs are such values. The planner folds a
//! constant computation ending there whatever its size (up to [`MASK_FOLD_MAX`] elements),
//! where other constant computations over [`FOLD_MAX`] elements are left to run time.
//!
//! Why: Hugging Face models build their [B, 1, T, T] mask from positions (Equal, LessOrEqual,
//! And, Expand, Where): GPT-2 124M at batch 16 × seq 1024 makes 16 M elements of it, which the
//! general limit left to six kernels a step, and a mask computed at run time can never be
//! recognised as causal (backend/cuda/ops/causal_mask.rs needs the constant): the CUDA
//! attention then reads 64 MB of mask per call and the flash kernels, which take no read mask,
//! never run. Folded, it is a constant found causal once per plan.

use crate::ir::{Graph, NodeId, ValueId};
use crate::ops::attention::q_input;

/// The largest constant computation folded at plan time in general (elements of its outputs).
pub const FOLD_MAX: usize = 1 << 22;
/// The largest folded when its outputs only become attention masks (1 GiB of f32).
pub const MASK_FOLD_MAX: usize = 1 << 28;

/// Per value: true where every reader among the `needed` nodes takes it as an attention mask,
/// or is a node whose outputs all are such values (so a chain of mask-building nodes counts).
/// A value nobody reads is false. `consumers`: the graph's (`Graph::consumers`).
pub fn mask_only_values(g: &Graph, consumers: &[Vec<(NodeId, usize)>], needed: &[bool]) -> Vec<bool> {
    let mut mask_only = vec![false; g.values.len()];
    // nodes are in topological order: every reader is decided before the node it reads from
    for n in (0..g.nodes.len()).rev().filter(|&n| needed[n]) {
        for &o in &g.nodes[n].outputs {
            let readers: Vec<_> = consumers[o.0].iter().filter(|(c, _)| needed[c.0]).collect();
            mask_only[o.0] = !readers.is_empty()
                && readers.iter().all(|(c, slot)| {
                    let reader = &g.nodes[c.0];
                    q_input(&reader.op_type).map(|q| q + 3) == Some(*slot)
                        || (!reader.outputs.is_empty() && reader.outputs.iter().all(|r| mask_only[r.0]))
                });
        }
    }
    mask_only
}

/// The fold limit of a node with these outputs.
pub fn fold_limit(mask_only: &[bool], outputs: &[ValueId]) -> usize {
    if !outputs.is_empty() && outputs.iter().all(|o| mask_only[o.0]) {
        MASK_FOLD_MAX
    } else {
        FOLD_MAX
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, Dim, ValueKind};
    use crate::tensor::DType;

    #[test]
    fn a_chain_that_only_feeds_attention_masks_is_mask_only() {
        let mut g = Graph::default();
        let shape = Some(vec![Dim::Known(4), Dim::Known(4)]);
        let q = g.add_value("q", ValueKind::Input, Some(DType::F32), shape.clone());
        let pos = g.add_value("pos", ValueKind::Input, Some(DType::I64), shape.clone());
        let le = g.add_node("le", "LessOrEqual", vec![Some(pos), Some(pos)], Attrs::default(), 1)[0];
        let m = g.add_node("where", "Where", vec![Some(le), Some(q), Some(q)], Attrs::default(), 1)[0];
        let o = g.add_node("attn", "Attention", vec![Some(q), Some(q), Some(q), Some(m)], Attrs::default(), 2)[0];
        let shared = g.add_node("shared", "Not", vec![Some(le)], Attrs::default(), 1)[0];
        let both = g.add_node("both", "Where", vec![Some(shared), Some(q), Some(q)], Attrs::default(), 1)[0];
        let _ = g.add_node("attn2", "Attention", vec![Some(q), Some(q), Some(both), Some(both)], Attrs::default(), 2);
        let all = vec![true; g.nodes.len()];
        let only = mask_only_values(&g, &g.consumers(), &all);
        assert!(only[m.0], "read as a mask only");
        assert!(!only[both.0], "also read as V");
        assert!(!only[shared.0] && !only[le.0], "feeds a value that is not mask-only");
        assert!(!only[o.0], "an attention output");
        assert_eq!(fold_limit(&only, &[m]), MASK_FOLD_MAX);
        assert_eq!(fold_limit(&only, &[both]), FOLD_MAX);
        // without the second attention (not needed), the shared chain is mask-only too
        let mut some = all.clone();
        some[g.nodes.len() - 1] = false;
        some[g.nodes.len() - 2] = false;
        some[g.nodes.len() - 3] = false;
        let only = mask_only_values(&g, &g.consumers(), &some);
        assert!(only[le.0] && only[m.0]);
    }
}
