//! fuse_residual_linear (CUDA sessions, after autocast): a 16-bit projection added back to the
//! f32 residual stream, `R + Cast(views(Gemm(A, B, Cast(b))), f32)` as autocast leaves a
//! pre-norm transformer block's output projections, becomes one Linear(A, B, b, R) writing the
//! f32 sum itself (ops/linear.rs, input 3): cuBLASLt's product adds R and the f32 bias in its
//! epilogue as it writes (backend/cuda/blas_lt.rs), where the graph wrote the 16-bit product, a
//! widened copy of it and the sum. The bias is added at f32, not rounded to 16 bits first, and
//! the product is not rounded to 16 bits before the sum: autocast's arithmetic with two
//! roundings fewer. GPT-2 124M, bf16: two kernels and 150 MB of traffic fewer per block and
//! projection (bench/gpu_roofline.py).
//!
//! Only where the Add does not broadcast (the shapes of R and the product's view are proven
//! equal, passes/sym_shape.rs) and R's last dim is the product's N, the bias is a cast of an
//! f32 vector of N, and the Gemm is a plain `A · op(B) + C` (transA 0, alpha and beta 1).

use super::sym_shape::{matmul_n, shape_of, SymDim};
use super::VIEWS;
use crate::ir::{Attr, Attrs, Graph, Node, ValueId};
use crate::tensor::DType;

/// The f32 source of the projection's bias (if it has one), its transB and its N (the weight's
/// output dim, symbolically), if `mm` is a Gemm or Linear that can take the residual.
fn projection(graph: &Graph, types: &[Option<DType>], mm: &Node) -> Option<(Option<ValueId>, bool, SymDim)> {
    let int = |k: &str, d: i64| mm.attrs.int(k, d).ok();
    let float = |k: &str| mm.attrs.float(k, 1.0).ok();
    let plain = match mm.op_type.as_str() {
        "Gemm" => int("transA", 0) == Some(0) && float("alpha") == Some(1.0) && float("beta") == Some(1.0),
        "Linear" => true,
        _ => false,
    };
    let half = mm.outputs.first().and_then(|o| types[o.0]).is_some_and(|t| t.is_half());
    if !plain || !half || mm.outputs.len() != 1 || mm.input(0).is_none() || mm.input(1).is_none() {
        return None;
    }
    let trans_b = int("transB", 0)? != 0;
    let n = matmul_n(graph, mm)?;
    let bias = match mm.input(2) {
        None => None,
        Some(b) => {
            // the f32 vector of N autocast cast to 16 bits
            let cast = &graph.nodes[graph.value(b).producer?.0];
            let source = cast.input(0).filter(|_| cast.op_type == "Cast")?;
            if types[source.0] != Some(DType::F32) || shape_of(graph, source)? != [n.clone()] {
                return None;
            }
            Some(source)
        }
    };
    Some((bias, trans_b, n))
}

/// Rewrites the graph; returns how many projections now add the residual themselves.
pub fn run(graph: &mut Graph) -> usize {
    let consumers = graph.consumers();
    let types = super::autocast::forward_types(graph);
    // the one node reading `v` (at input 0, unless `any_slot`), where `v` is no graph output
    let only_reader = |v: ValueId, any_slot: bool| match consumers[v.0][..] {
        [(n, slot)] if (slot == 0 || any_slot) && !graph.outputs.contains(&v) => Some(n),
        _ => None,
    };
    // (the Add's index, the Linear that replaces it)
    let mut fused: Vec<(usize, Node)> = Vec::new();
    for mm in &graph.nodes {
        let Some((bias, trans_b, n)) = projection(graph, &types, mm) else { continue };
        // the views, then the cast to f32, each the only reader of what it reads
        let mut v = mm.outputs[0];
        let mut next = only_reader(v, false);
        while let Some(n) = next.filter(|n| VIEWS.contains(&graph.nodes[n.0].op_type.as_str())) {
            v = graph.nodes[n.0].outputs[0];
            next = only_reader(v, false);
        }
        let Some(cast) = next.map(|n| &graph.nodes[n.0]) else { continue };
        let to_f32 = cast.op_type == "Cast" && cast.attrs.int("to", 0).ok() == Some(DType::F32.onnx_code() as i64);
        let Some(add) = only_reader(cast.outputs[0], true).filter(|_| to_f32) else { continue };
        let (widened, add_node) = (cast.outputs[0], &graph.nodes[add.0]);
        if add_node.op_type != "Add" || add_node.inputs.len() != 2 || add_node.outputs.len() != 1 || fused.iter().any(|f| f.0 == add.0) {
            continue;
        }
        let Some(residual) = add_node.inputs.iter().flatten().copied().find(|&r| r != widened) else { continue };
        // no broadcast, and rows of N (the gradient flattens dY to them)
        let same = shape_of(graph, residual).is_some_and(|r| r.last() == Some(&n) && Some(&r) == shape_of(graph, widened).as_ref());
        if types[residual.0] != Some(DType::F32) || !same {
            continue;
        }
        let attrs = Attrs::default().with("transB", Attr::Int(trans_b as i64));
        let inputs = vec![mm.input(0), mm.input(1), bias, Some(residual)];
        let name = format!("{}:residual", mm.name);
        let node = Node { name, op_type: "Linear".into(), inputs, outputs: add_node.outputs.clone(), attrs };
        fused.push((add.0, node));
    }
    let count = fused.len();
    for (at, node) in fused {
        graph.nodes[at] = node;
    }
    if count > 0 {
        graph.renumber_producers();
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Dim, ValueKind};
    use crate::tensor::Tensor;

    /// r [2, 3, 4] f32 + Cast(Reshape(Gemm(a [6, 4] bf16, w [4, 4] bf16, Cast(b [4] f32 -> bf16)),
    /// [2, 3, 4]), f32), as autocast leaves GPT-2's projections; `residual_dims` changes r's
    /// declared shape (a broadcast), `spy` gives the cast's output a second reader.
    fn projection_block(residual_dims: &[usize], spy: bool) -> Graph {
        let mut g = Graph::default();
        let dims = |d: &[usize]| Some(d.iter().map(|&v| Dim::Known(v)).collect());
        let r = g.add_value("r", ValueKind::Input, Some(DType::F32), dims(residual_dims));
        let a = g.add_value("a", ValueKind::Input, Some(DType::BF16), dims(&[6, 4]));
        let w = g.add_value("w", ValueKind::Weight, Some(DType::BF16), dims(&[4, 4]));
        let b = g.add_value("b", ValueKind::Weight, Some(DType::F32), dims(&[4]));
        g.inputs.extend([r, a]);
        let to = |t: DType| Attrs::default().with("to", Attr::Int(t.onnx_code() as i64));
        let b16 = g.add_node("b_cast", "Cast", vec![Some(b)], to(DType::BF16), 1)[0];
        let mm = g.add_node("proj", "Gemm", vec![Some(a), Some(w), Some(b16)], Attrs::default(), 1)[0];
        let shape = g.add_const("shape", Tensor::from_i64(vec![3], vec![2, 3, 4]));
        let view = g.add_node("view", "Reshape", vec![Some(mm), Some(shape)], Attrs::default(), 1)[0];
        let wide = g.add_node("widen", "Cast", vec![Some(view)], to(DType::F32), 1)[0];
        let sum = g.add_node("residual", "Add", vec![Some(r), Some(wide)], Attrs::default(), 1)[0];
        g.outputs.push(sum);
        if spy {
            let other = g.add_node("spy", "Neg", vec![Some(wide)], Attrs::default(), 1)[0];
            g.outputs.push(other);
        }
        g
    }

    #[test]
    fn a_projection_added_to_the_stream_becomes_a_linear_with_the_residual() {
        let mut g = projection_block(&[2, 3, 4], false);
        assert_eq!(run(&mut g), 1);
        super::super::remove_dead_nodes(&mut g);
        let ops: Vec<&str> = g.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(ops, ["Linear"], "the Gemm, the view, both casts and the Add go");
        let lin = &g.nodes[0];
        let name = |v: Option<ValueId>| v.map(|v| g.value(v).name.clone());
        let inputs: Vec<Option<String>> = (0..4).map(|i| name(lin.input(i))).collect();
        assert_eq!(inputs, [Some("a".into()), Some("w".into()), Some("b".into()), Some("r".into())]);
        assert_eq!(lin.attrs.int("transB", 1).ok(), Some(0));
        assert_eq!(g.outputs, [lin.outputs[0]], "the Linear writes the Add's output");
    }

    #[test]
    fn a_broadcasting_add_or_a_widened_copy_read_elsewhere_stays() {
        let mut g = projection_block(&[3, 4], false);
        assert_eq!(run(&mut g), 0, "r is broadcast over the product");
        let mut g = projection_block(&[2, 3, 4], true);
        assert_eq!(run(&mut g), 0, "the widened product has another reader");
    }

    #[test]
    fn a_bias_that_is_no_cast_of_an_f32_vector_stays() {
        let mut g = projection_block(&[2, 3, 4], false);
        // the Gemm reads a 16-bit bias of its own
        let b16 = g.add_value("b16", ValueKind::Weight, Some(DType::BF16), Some(vec![Dim::Known(4)]));
        let gemm = g.nodes.iter_mut().find(|n| n.op_type == "Gemm").expect("gemm");
        gemm.inputs[2] = Some(b16);
        assert_eq!(run(&mut g), 0);
    }

    #[test]
    fn a_bias_of_another_length_or_rows_of_another_width_stay() {
        let mut g = projection_block(&[2, 3, 4], false);
        let b = g.find("b").expect("b");
        g.values[b.0].shape = Some(vec![Dim::Known(1)]);
        assert_eq!(run(&mut g), 0, "a bias of 1 broadcast over N");
        // the product [6, 4] viewed as [2, 12]: rows of 12, not of N = 4
        let mut g = projection_block(&[2, 12], false);
        let shape = g.find("shape").expect("shape");
        g.values[shape.0].kind = ValueKind::Const(std::sync::Arc::new(Tensor::from_i64(vec![2], vec![2, 12])));
        assert_eq!(run(&mut g), 0, "the residual's rows are not the product's");
    }
}
