//! fuse_rms_norm: the RMS normalisation Llama-style models write out,
//! `X · Reciprocal(Sqrt(ReduceMean(Pow(X, 2), [-1]) + eps))` (or `1 / Sqrt(..)`, the product in
//! either order), and the scale multiplying it when that is a value of shape [n], becomes one
//! RmsNorm(X, scale?) (ops/rms_norm.rs): six element-wise passes over the activations forward
//! and about twice that backward become one each way, and only X and one value per row are kept
//! for the gradient. Only where every intermediate has no other reader, the mean is over the last
//! axis alone (kept), and eps is a one-element constant. Kernels: backend/cpu/rms_norm.rs and
//! kernels/rmsnorm.cu.

use super::sym_shape::{declared, values, SymDim};
use super::{scalar_const, scalar_value, sole_producer};
use crate::error::Result;
use crate::ir::{Attr, Attrs, Graph, Node, NodeId, ValueId, ValueKind};
use crate::tensor::DType;

/// Whether `node`'s axes (input 1 from opset 18, else the attribute) are exactly the last axis
/// of `x` and the reduced axis is kept.
fn over_last_axis(graph: &Graph, node: &Node, x: ValueId) -> bool {
    if node.attrs.int("keepdims", 1).ok() != Some(1) {
        return false;
    }
    let axes: Option<Vec<i64>> = match node.input(1) {
        Some(a) => values(graph, a).and_then(|v| v.into_iter().map(|d| if let SymDim::Known(k) = d { Some(k) } else { None }).collect()),
        None => node.attrs.ints("axes").ok().flatten(),
    };
    let rank = declared(graph, x).map(|d| d.len() as i64);
    match axes.as_deref() {
        Some([-1]) => true,
        Some([a]) => rank.is_some_and(|r| *a == r - 1),
        _ => false,
    }
}

/// The other operand of a binary `node` one of whose operands is `v`.
fn other_operand(node: &Node, v: ValueId) -> Option<ValueId> {
    match (node.input(0)?, node.input(1)?) {
        (a, b) if a == v => Some(b),
        (a, b) if b == v => Some(a),
        _ => None,
    }
}

/// (X, eps) of r = Reciprocal(Sqrt(Add(ReduceMean(Pow(X, 2)), eps))) or 1 / Sqrt(..), each step
/// read only on the way.
fn inverse_rms(graph: &Graph, consumers: &[Vec<(NodeId, usize)>], r: ValueId) -> Option<(ValueId, f64)> {
    let sqrt_out = match sole_producer(graph, consumers, r, "Reciprocal") {
        Some(rec) => rec.input(0)?,
        None => {
            let div = sole_producer(graph, consumers, r, "Div")?;
            (scalar_const(graph, div.input(0)?) == Some(1.0)).then_some(div.input(1)?)?
        }
    };
    let sqrt = sole_producer(graph, consumers, sqrt_out, "Sqrt")?;
    let add = sole_producer(graph, consumers, sqrt.input(0)?, "Add")?;
    let (mean_out, eps) = [(add.input(0)?, add.input(1)?), (add.input(1)?, add.input(0)?)]
        .into_iter()
        .find_map(|(m, e)| Some((m, scalar_value(graph, e).filter(|&(_, rank)| rank <= 1)?.0)))?;
    let mean = sole_producer(graph, consumers, mean_out, "ReduceMean")?;
    let pow = sole_producer(graph, consumers, mean.input(0)?, "Pow")?;
    let x = pow.input(0)?;
    (scalar_value(graph, pow.input(1)?).map(|(p, _)| p) == Some(2.0) && over_last_axis(graph, mean, x) && eps.is_finite() && eps >= 0.0)
        .then_some((x, eps))
}

/// The scale multiplying `normed` (read only by that Mul) if it is a value of shape [n] with `n`
/// the last dim of X, and the Mul's node index.
fn scale_of(
    graph: &Graph,
    consumers: &[Vec<(NodeId, usize)>],
    types: &[Option<DType>],
    normed: ValueId,
    x: ValueId,
) -> Option<(ValueId, NodeId)> {
    if consumers[normed.0].len() != 1 || graph.outputs.contains(&normed) {
        return None;
    }
    let (at, _) = consumers[normed.0][0];
    let mul = &graph.nodes[at.0];
    if mul.op_type != "Mul" {
        return None;
    }
    let scale = other_operand(mul, normed)?;
    let n = declared(graph, x)?.last().cloned()?;
    let same_type = types[scale.0].is_some() && types[scale.0] == types[x.0];
    (declared(graph, scale)? == [n] && same_type).then_some((scale, at))
}

pub fn run(graph: &mut Graph) -> Result<usize> {
    let consumers = graph.consumers();
    let types = super::autocast::forward_types(graph);
    let mut rewrites = 0;
    for n in 0..graph.nodes.len() {
        let node = &graph.nodes[n];
        if node.op_type != "Mul" {
            continue;
        }
        // X · r with r computed from X
        let Some((x, eps)) = [0usize, 1].into_iter().find_map(|i| {
            let r = node.input(1 - i)?;
            let (x, eps) = inverse_rms(graph, &consumers, r)?;
            (node.input(i) == Some(x)).then_some((x, eps))
        }) else {
            continue;
        };
        let Some(dtype) = types[x.0].filter(|d| d.is_float()) else { continue };
        let normed = node.outputs[0];
        let (inputs, at, out) = match scale_of(graph, &consumers, &types, normed, x) {
            Some((scale, mul)) => (vec![Some(x), Some(scale)], mul, graph.nodes[mul.0].outputs[0]),
            None => (vec![Some(x)], NodeId(n), normed),
        };
        let name = graph.nodes[at.0].name.clone();
        let stat = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
        let inv = graph.add_value(&format!("{name}:inv_rms"), ValueKind::Computed, Some(stat), None);
        graph.values[inv.0].producer = Some(at);
        let attrs = Attrs::default().with("epsilon", Attr::Float(eps as f32));
        graph.nodes[at.0] = Node { name, op_type: "RmsNorm".into(), inputs, outputs: vec![out, inv], attrs };
        rewrites += 1;
    }
    Ok(rewrites)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Dim;
    use crate::tensor::Tensor;

    /// w · (x · Reciprocal(Sqrt(ReduceMean(Pow(x, 2), [-1]) + 1e-6))) over x [2, 3, 8]; the
    /// normalised value also a graph output when `shared`.
    fn rms_norm_graph(shared: bool) -> Graph {
        let mut g = Graph::default();
        let dims = |d: &[usize]| Some(d.iter().map(|&x| Dim::Known(x)).collect());
        let x = g.add_value("x", ValueKind::Input, Some(DType::F32), dims(&[2, 3, 8]));
        let w = g.add_value("w", ValueKind::Weight, Some(DType::F32), dims(&[8]));
        g.inputs.push(x);
        let two = g.add_const("two", Tensor::from_f32(vec![], vec![2.0]));
        let axes = g.add_const("axes", Tensor::new(vec![1], crate::tensor::Data::I64(vec![-1])).expect("axes"));
        let eps = g.add_const("eps", Tensor::from_f32(vec![], vec![1e-6]));
        let none = Attrs::default;
        let p = g.add_node("pow", "Pow", vec![Some(x), Some(two)], none(), 1)[0];
        let m = g.add_node("mean", "ReduceMean", vec![Some(p), Some(axes)], none(), 1)[0];
        let a = g.add_node("add", "Add", vec![Some(m), Some(eps)], none(), 1)[0];
        let s = g.add_node("sqrt", "Sqrt", vec![Some(a)], none(), 1)[0];
        let r = g.add_node("rsqrt", "Reciprocal", vec![Some(s)], none(), 1)[0];
        let n = g.add_node("normed", "Mul", vec![Some(x), Some(r)], none(), 1)[0];
        let y = g.add_node("scaled", "Mul", vec![Some(w), Some(n)], none(), 1)[0];
        g.outputs.push(y);
        if shared {
            g.outputs.push(n);
        }
        g
    }

    #[test]
    fn the_written_out_norm_and_its_scale_become_one_node() {
        let mut g = rms_norm_graph(false);
        assert_eq!(run(&mut g).expect("run"), 1);
        super::super::remove_dead_nodes(&mut g);
        let ops: Vec<&str> = g.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(ops, ["RmsNorm"]);
        let node = &g.nodes[0];
        assert_eq!(node.inputs.len(), 2, "X and the scale");
        assert!((node.attrs.float("epsilon", 0.0).expect("eps") - 1e-6).abs() < 1e-12);
        assert_eq!(node.outputs[0], g.outputs[0]);
    }

    #[test]
    fn a_normalised_value_read_elsewhere_keeps_its_scale_apart() {
        let mut g = rms_norm_graph(true);
        assert_eq!(run(&mut g).expect("run"), 1);
        super::super::remove_dead_nodes(&mut g);
        let ops: Vec<&str> = g.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(ops, ["RmsNorm", "Mul"]);
        assert_eq!(g.nodes[0].inputs.len(), 1, "no scale");
    }
}
