//! attention_keys (after attention_layout): a fused Attention still in layout BHSD whose Kᵀ
//! operand the graph made by transposing K [.., S, D] (a Transpose of the last two axes, or
//! torchlib's Reshape-Transpose-Reshape, attention_layout.rs `keys_of`) reads K itself, in
//! layout BHSD_K (ops/attention.rs): the transpose and its gradient's transpose, two copies of K
//! a step, are not made, and the keys keep d contiguous, which the CUDA flash kernels need.
//! This is the attention of the Llama family (Llama, Mistral, Qwen): rotary embeddings compute Q
//! and K with the heads already moved out and grouped-query attention repeats K and V, so
//! attention_layout cannot read them from the projections.

use super::attention_layout::keys_of;
use crate::ir::{Attr, Graph, ValueId};

/// K of an operand Kᵀ: the input of a Transpose swapping only the last two axes, or [`keys_of`].
fn untransposed(graph: &Graph, kt: ValueId) -> Option<ValueId> {
    let node = &graph.nodes[graph.value(kt).producer?.0];
    if node.op_type == "Transpose" {
        let perm = node.attrs.ints("perm").ok()??;
        let r = perm.len();
        let swaps_last_two = r >= 2
            && perm[..r - 2].iter().enumerate().all(|(i, &p)| p == i as i64)
            && perm[r - 2] == r as i64 - 1
            && perm[r - 1] == r as i64 - 2;
        return swaps_last_two.then(|| node.input(0)).flatten();
    }
    keys_of(graph, kt)
}

pub fn run(graph: &mut Graph) -> usize {
    let mut rewrites = 0;
    for n in 0..graph.nodes.len() {
        let node = &graph.nodes[n];
        if node.op_type != "Attention" || node.attrs.get("layout").is_some() {
            continue;
        }
        let Some(k) = node.input(1).and_then(|kt| untransposed(graph, kt)) else { continue };
        let node = &mut graph.nodes[n];
        node.inputs[1] = Some(k);
        node.attrs.set("layout", Attr::String("BHSD_K".into()));
        rewrites += 1;
    }
    rewrites
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, Dim, ValueKind};
    use crate::tensor::DType;

    fn perm(p: &[i64]) -> Attrs {
        Attrs::default().with("perm", Attr::Ints(p.to_vec()))
    }

    /// Attention(q, Transpose(k, `p`), v) over q, k, v [2, 3, 5, 4].
    fn transposed_keys(p: &[i64]) -> Graph {
        let mut g = Graph::default();
        let dims = Some([2, 3, 5, 4].map(Dim::Known).to_vec());
        let mut input = |name: &str| {
            let v = g.add_value(name, ValueKind::Input, Some(DType::F32), dims.clone());
            g.inputs.push(v);
            v
        };
        let (q, k, v) = (input("q"), input("k"), input("v"));
        let kt = g.add_node("kt", "Transpose", vec![Some(k)], perm(p), 1)[0];
        let outs = g.add_node("attn", "Attention", vec![Some(q), Some(kt), Some(v)], Attrs::default(), 2);
        g.outputs.push(outs[0]);
        g
    }

    #[test]
    fn an_attention_over_transposed_keys_reads_the_keys() {
        let mut g = transposed_keys(&[0, 1, 3, 2]);
        assert_eq!(run(&mut g), 1);
        let attn = &g.nodes[1];
        assert_eq!(attn.input(1), Some(g.inputs[1]), "K itself");
        assert_eq!(attn.attrs.string("layout", "BHSD").expect("layout"), "BHSD_K");
        assert_eq!(run(&mut g), 0, "done once");
    }

    #[test]
    fn other_transposes_and_laid_out_attentions_are_left_alone() {
        for p in [[0, 2, 1, 3], [1, 0, 3, 2], [0, 1, 2, 3]] {
            let mut g = transposed_keys(&p);
            assert_eq!(run(&mut g), 0, "perm {p:?}");
        }
        let mut g = transposed_keys(&[0, 1, 3, 2]);
        g.nodes[1].attrs.set("layout", Attr::String("BSHD".into()));
        assert_eq!(run(&mut g), 0, "a layout already chosen");
    }
}
