//! fuse_linear_gelu (CUDA sessions, on the forward graph): a tanh GELU of a product that only
//! it reads, `Gelu(views(Gemm(A, B, C)))` as GPT-2's MLP exports it (or of a Linear without a
//! residual), becomes one `Linear(A, B, C, activation="gelu_tanh")` (ops/linear.rs) writing the
//! GELU's result and, as output 1, its input, which the GELU's gradient reads: cuBLASLt's
//! GELU_AUX_BIAS epilogue writes both as the product is written (backend/cuda/blas_lt.rs), where
//! the graph wrote the product and a GELU kernel read it back. The views then show the result
//! as they showed the product, so the GELU's readers see what they saw. llm.c fuses the same
//! on sm_90 GPUs by default. GPT-2 124M, bf16, batch 16 × 1024: one kernel and 100 MB of
//! traffic fewer per layer (bench/gpu_roofline.py).
//!
//! Only where the Gemm is `A · op(B) + C` (transA 0, alpha 1, beta 1 or no C) with C a vector of
//! the product's N (proven, passes/sym_shape.rs), and every value from the product to the GELU
//! has that one reader and is no graph output.

use super::sym_shape::{matmul_n, shape_of};
use super::VIEWS;
use crate::ir::{Attr, Attrs, Graph, Node, ValueId, ValueKind};

/// The inputs and attributes of the Linear that computes what the product `mm` computes, if
/// it can take a GELU.
fn as_linear(graph: &Graph, mm: &Node) -> Option<(Vec<Option<ValueId>>, Attrs)> {
    if mm.outputs.len() != 1 || mm.input(0).is_none() || mm.input(1).is_none() {
        return None;
    }
    match mm.op_type.as_str() {
        "Linear" => {
            let plain = mm.input(3).is_none() && crate::ops::linear::gelu_after(mm).ok() == Some(false);
            plain.then(|| (mm.inputs.iter().take(3).copied().collect(), mm.attrs.clone()))
        }
        "Gemm" => {
            let int = |k: &str, d: i64| mm.attrs.int(k, d).ok();
            let float = |k: &str| mm.attrs.float(k, 1.0).ok();
            if int("transA", 0) != Some(0) || float("alpha") != Some(1.0) {
                return None;
            }
            let trans_b = int("transB", 0)? != 0;
            if let Some(c) = mm.input(2) {
                if float("beta") != Some(1.0) || shape_of(graph, c)? != [matmul_n(graph, mm)?] {
                    return None;
                }
            }
            let attrs = Attrs::default().with("transB", Attr::Int(trans_b as i64));
            Some((mm.inputs.iter().take(3).copied().collect(), attrs))
        }
        _ => None,
    }
}

/// A fusion found: the GELU, the product, and the views between them (product side first).
struct Found {
    gelu: usize,
    product: usize,
    views: Vec<usize>,
    inputs: Vec<Option<ValueId>>,
    attrs: Attrs,
}

/// Rewrites the graph; returns how many GELUs now come out of their product.
pub fn run(graph: &mut Graph) -> usize {
    let consumers = graph.consumers();
    let read_only_by = |v: ValueId, node: usize| consumers[v.0][..] == [(crate::ir::NodeId(node), 0)] && !graph.outputs.contains(&v);
    let mut found: Vec<Found> = Vec::new();
    for (gelu, node) in graph.nodes.iter().enumerate() {
        let tanh = node.attrs.string("approximate", "none").ok().as_deref() == Some("tanh");
        if node.op_type != "Gelu" || !tanh || node.inputs.len() != 1 || node.outputs.len() != 1 {
            continue;
        }
        let (mut reader, mut views) = (gelu, Vec::new());
        let mut v = node.input(0);
        let product = loop {
            let Some(x) = v.filter(|&x| read_only_by(x, reader)) else { break None };
            let Some(p) = graph.value(x).producer else { break None };
            let at = &graph.nodes[p.0];
            if !VIEWS.contains(&at.op_type.as_str()) || at.outputs.len() != 1 {
                break Some(p.0);
            }
            views.push(p.0);
            (reader, v) = (p.0, at.input(0));
        };
        let Some(product) = product else { continue };
        let Some((inputs, attrs)) = as_linear(graph, &graph.nodes[product]) else { continue };
        views.reverse();
        found.push(Found { gelu, product, views, inputs, attrs });
    }
    let mut gone = vec![false; graph.nodes.len()];
    for f in &found {
        let pre = graph.nodes[f.product].outputs[0];
        let y = graph.nodes[f.gelu].outputs[0];
        // the views now show the GELU's result, their last one writing the GELU's output
        let result = match (f.views.first(), f.views.last()) {
            (Some(&first), Some(&last)) => {
                let p = graph.value(pre);
                let (name, dtype, shape) = (format!("{}:gelu", p.name), p.dtype, p.shape.clone());
                let h = graph.add_value(&name, ValueKind::Computed, dtype, shape);
                graph.nodes[first].inputs[0] = Some(h);
                graph.nodes[last].outputs[0] = y;
                h
            }
            _ => y,
        };
        let attrs = f.attrs.clone().with("activation", Attr::String("gelu_tanh".into()));
        let name = format!("{}:gelu", graph.nodes[f.product].name);
        graph.nodes[f.product] = Node { name, op_type: "Linear".into(), inputs: f.inputs.clone(), outputs: vec![result, pre], attrs };
        gone[f.gelu] = true;
    }
    if !found.is_empty() {
        super::drop_nodes(graph, &gone);
    }
    found.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Dim;
    use crate::tensor::{DType, Tensor};

    fn dims(d: &[usize]) -> Option<Vec<Dim>> {
        Some(d.iter().map(|&v| Dim::Known(v)).collect())
    }

    fn tanh() -> Attrs {
        Attrs::default().with("approximate", Attr::String("tanh".into()))
    }

    /// a [6, 4] → Gemm(a, w [4, 8], b [8] or none) → Reshape [2, 3, 8] → Gelu → Neg (the
    /// output), as GPT-2's MLP exports it; `gemm_attrs` are the Gemm's.
    fn mlp_block(bias: bool, gemm_attrs: Attrs, gelu_attrs: Attrs) -> Graph {
        let mut g = Graph::default();
        let a = g.add_value("a", ValueKind::Input, Some(DType::F32), dims(&[6, 4]));
        let w = g.add_value("w", ValueKind::Weight, Some(DType::F32), dims(&[4, 8]));
        let b = bias.then(|| g.add_value("b", ValueKind::Weight, Some(DType::F32), dims(&[8])));
        g.inputs.push(a);
        let mm = g.add_node("c_fc", "Gemm", vec![Some(a), Some(w), b], gemm_attrs, 1)[0];
        g.values[mm.0].shape = dims(&[6, 8]);
        let shape = g.add_const("shape", Tensor::from_i64(vec![3], vec![2, 3, 8]));
        let view = g.add_node("view", "Reshape", vec![Some(mm), Some(shape)], Attrs::default(), 1)[0];
        let h = g.add_node("gelu", "Gelu", vec![Some(view)], gelu_attrs, 1)[0];
        let y = g.add_node("after", "Neg", vec![Some(h)], Attrs::default(), 1)[0];
        g.outputs.push(y);
        g
    }

    fn ops(g: &Graph) -> Vec<&str> {
        g.nodes.iter().map(|n| n.op_type.as_str()).collect()
    }

    #[test]
    fn a_gemm_and_the_gelu_of_its_view_become_one_linear() {
        let mut g = mlp_block(true, Attrs::default(), tanh());
        let (pre, gelu_out) = (g.nodes[0].outputs[0], g.nodes[2].outputs[0]);
        assert_eq!(run(&mut g), 1);
        assert_eq!(ops(&g), ["Linear", "Reshape", "Neg"], "the GELU goes");
        let lin = &g.nodes[0];
        let name = |v: Option<ValueId>| v.map(|v| g.value(v).name.clone());
        assert_eq!((0..3).map(|i| name(lin.input(i))).collect::<Vec<_>>(), [Some("a".into()), Some("w".into()), Some("b".into())]);
        assert_eq!(lin.attrs.string("activation", "none").ok().as_deref(), Some("gelu_tanh"));
        assert_eq!(lin.attrs.int("transB", 1).ok(), Some(0));
        assert_eq!(lin.outputs[1], pre, "output 1 is the product the GELU read");
        let view = &g.nodes[1];
        assert_eq!(view.input(0), Some(lin.outputs[0]), "the view shows the GELU's result");
        assert_eq!(view.outputs[0], gelu_out, "and writes what the GELU wrote");
        assert_eq!(g.nodes[2].input(0), Some(gelu_out), "its reader is unchanged");
        assert_eq!(g.value(gelu_out).producer, Some(crate::ir::NodeId(1)));
    }

    #[test]
    fn a_linear_read_by_its_gelu_directly_writes_the_gelus_output() {
        let mut g = Graph::default();
        let x = g.add_value("x", ValueKind::Input, Some(DType::F32), dims(&[2, 3, 4]));
        let w = g.add_value("w", ValueKind::Weight, Some(DType::F32), dims(&[8, 4]));
        g.inputs.push(x);
        let attrs = Attrs::default().with("transB", Attr::Int(1));
        let p = g.add_node("fc", "Linear", vec![Some(x), Some(w)], attrs, 1)[0];
        let h = g.add_node("gelu", "Gelu", vec![Some(p)], tanh(), 1)[0];
        g.outputs.push(h);
        assert_eq!(run(&mut g), 1);
        assert_eq!(ops(&g), ["Linear"]);
        assert_eq!(g.nodes[0].outputs, [h, p]);
        assert_eq!(g.nodes[0].attrs.int("transB", 0).ok(), Some(1), "its attributes are kept");
    }

    #[test]
    fn an_exact_gelu_a_transposed_or_scaled_gemm_and_a_broadcast_bias_stay() {
        let mut g = mlp_block(true, Attrs::default(), Attrs::default());
        assert_eq!(run(&mut g), 0, "the erf GELU is not cuBLASLt's");
        let mut g = mlp_block(true, Attrs::default().with("transA", Attr::Int(1)), tanh());
        assert_eq!(run(&mut g), 0);
        let mut g = mlp_block(true, Attrs::default().with("alpha", Attr::Float(0.5)), tanh());
        assert_eq!(run(&mut g), 0);
        let mut g = mlp_block(true, Attrs::default(), tanh());
        let b = g.find("b").expect("b");
        g.values[b.0].shape = dims(&[1, 8]);
        assert_eq!(run(&mut g), 0, "a [1, 8] bias is not one value per column");
        let mut g = mlp_block(false, Attrs::default().with("beta", Attr::Float(0.5)), tanh());
        assert_eq!(run(&mut g), 1, "without C, beta does not matter");
    }

    #[test]
    fn a_product_read_elsewhere_stays() {
        let mut g = mlp_block(true, Attrs::default(), tanh());
        let view = g.nodes[1].outputs[0];
        let spy = g.add_node("spy", "Neg", vec![Some(view)], Attrs::default(), 1)[0];
        g.outputs.push(spy);
        assert_eq!(run(&mut g), 0);
    }

    /// Autodiff through the fused Linear: the GELU's gradient reads output 1, and every
    /// gradient the unfused graph had is still built.
    #[test]
    fn the_gradient_goes_through_the_gelu_at_output_1() {
        let mut g = mlp_block(true, Attrs::default(), tanh());
        assert_eq!(run(&mut g), 1);
        let (w, b, pre) = (g.find("w").expect("w"), g.find("b").expect("b"), g.nodes[0].outputs[1]);
        let y = g.outputs[0];
        let seed = g.add_value("grad:y", ValueKind::Input, Some(DType::F32), None);
        let n_fwd = g.nodes.len();
        crate::autodiff::build(&mut g, &[y], &[Some(seed)], &[w, b]).expect("autodiff");
        let grad = g.nodes[n_fwd..].iter().find(|n| n.op_type == "GeluGrad").expect("GeluGrad");
        assert_eq!(grad.input(1), Some(pre));
        assert_eq!(grad.attrs.string("approximate", "none").ok().as_deref(), Some("tanh"));
    }
}
