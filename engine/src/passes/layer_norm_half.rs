//! layer_norm_half (CUDA sessions, after autocast): a LayerNormalization whose output only a
//! cast to 16 bits reads (through views: Reshape, Flatten, Squeeze, Unsqueeze, Identity), as
//! autocast writes the input of the matmul after a pre-norm, writes the 16-bit tensor itself
//! (attribute `y_type`, ops/norm.rs) and the cast goes. The normalisation is still computed in
//! f32 and rounded once, so the values are the cast's bit for bit; its gradient LayerNormGrad then
//! reads the 16-bit incoming gradient as it is, where the cast's own gradient widened it to an f32
//! copy first. GPT-2 124M, bf16: two 12.6M-element f32 writes and reads fewer per layer and
//! direction (bench/gpu_roofline.py).

use super::VIEWS;
use crate::ir::{Attr, Graph, NodeId, ValueId};
use crate::tensor::DType;

/// From LayerNormalization output `y`: the views it goes through and the 16-bit Cast at the end
/// (node, target type), when each value on the way has that one reader and none is a graph
/// output.
fn cast_after(graph: &Graph, consumers: &[Vec<(NodeId, usize)>], y: ValueId) -> Option<(Vec<NodeId>, NodeId, DType)> {
    let mut views = Vec::new();
    let mut v = y;
    loop {
        let [(reader, slot)] = consumers[v.0][..] else { return None };
        let node = &graph.nodes[reader.0];
        if slot != 0 || graph.outputs.contains(&v) {
            return None;
        }
        if node.op_type == "Cast" {
            // a graph output keeps its name (and its gradient seed's)
            let to = node.attrs.int("to", 0).ok().and_then(|c| DType::from_onnx(c as i32))?;
            return (to.is_half() && !graph.outputs.contains(&node.outputs[0])).then_some((views, reader, to));
        }
        if !VIEWS.contains(&node.op_type.as_str()) || node.outputs.len() != 1 {
            return None;
        }
        views.push(reader);
        v = node.outputs[0];
    }
}

/// Rewrites the graph; returns how many LayerNormalizations now write 16 bits.
pub fn run(graph: &mut Graph) -> usize {
    let consumers = graph.consumers();
    let types = super::autocast::forward_types(graph);
    let mut rewired: Vec<(ValueId, ValueId)> = Vec::new();
    let mut rewrites = 0;
    for n in 0..graph.nodes.len() {
        let node = &graph.nodes[n];
        if node.op_type != "LayerNormalization" || node.attrs.int("y_type", 0).unwrap_or(0) != 0 {
            continue;
        }
        let x_f32 = node.input(0).and_then(|x| types[x.0]) == Some(DType::F32);
        let Some(&y) = node.outputs.first() else { continue };
        let Some((views, cast, half)) = cast_after(graph, &consumers, y).filter(|_| x_f32) else { continue };
        graph.nodes[n].attrs.set("y_type", Attr::Int(half.onnx_code() as i64));
        graph.values[y.0].dtype = Some(half);
        for view in &views {
            let out = graph.nodes[view.0].outputs[0];
            graph.values[out.0].dtype = Some(half);
        }
        // the cast's readers read the last view (or y) instead; the cast is then dead
        let end = views.last().map_or(y, |v| graph.nodes[v.0].outputs[0]);
        rewired.push((graph.nodes[cast.0].outputs[0], end));
        rewrites += 1;
    }
    for (from, to) in rewired {
        for node in graph.nodes.iter_mut() {
            for i in node.inputs.iter_mut().flatten() {
                if *i == from {
                    *i = to;
                }
            }
        }
        for o in graph.outputs.iter_mut() {
            if *o == from {
                *o = to;
            }
        }
    }
    rewrites
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, ValueKind};
    use crate::tensor::Tensor;

    /// x [4, 8] f32 -> LayerNormalization -> Reshape [2, 16] -> Cast(to) -> MatMul with a bf16
    /// weight; `extra`: the LayerNorm output (`cast_out`: the cast's) is also a graph output.
    fn ln_cast(to: DType, extra: bool, cast_out: bool) -> (Graph, ValueId) {
        let mut g = Graph::default();
        let x = g.add_value("x", ValueKind::Input, Some(DType::F32), None);
        g.inputs.push(x);
        let scale = g.add_const("scale", Tensor::from_f32(vec![8], vec![1.0; 8]));
        let y = g.add_node("ln", "LayerNormalization", vec![Some(x), Some(scale)], Attrs::default(), 1)[0];
        g.values[y.0].dtype = Some(DType::F32);
        let shape = g.add_const("shape", Tensor::from_i64(vec![2], vec![2, 16]));
        let r = g.add_node("flat", "Reshape", vec![Some(y), Some(shape)], Attrs::default(), 1)[0];
        let cast = Attrs::default().with("to", Attr::Int(to.onnx_code() as i64));
        let c = g.add_node("cast", "Cast", vec![Some(r)], cast, 1)[0];
        let w = g.add_value("w", ValueKind::Weight, Some(DType::BF16), None);
        let out = g.add_node("mm", "MatMul", vec![Some(c), Some(w)], Attrs::default(), 1)[0];
        g.outputs.push(out);
        if extra {
            g.outputs.push(y);
        }
        if cast_out {
            g.outputs.push(c);
        }
        (g, out)
    }

    #[test]
    fn a_layer_norm_cast_to_16_bits_writes_16_bits_and_the_cast_goes() {
        for half in [DType::BF16, DType::F16] {
            let (mut g, _) = ln_cast(half, false, false);
            assert_eq!(run(&mut g), 1);
            super::super::remove_dead_nodes(&mut g);
            let ops: Vec<&str> = g.nodes.iter().map(|n| n.op_type.as_str()).collect();
            assert_eq!(ops, ["LayerNormalization", "Reshape", "MatMul"], "{half:?}");
            assert_eq!(g.nodes[0].attrs.int("y_type", 0).ok(), Some(half.onnx_code() as i64));
            assert_eq!(g.nodes[2].input(0), Some(g.nodes[1].outputs[0]), "the matmul reads the reshape");
            assert_eq!(g.value(g.nodes[1].outputs[0]).dtype, Some(half));
        }
    }

    #[test]
    fn a_layer_norm_read_elsewhere_cast_to_an_output_or_to_f64_stays() {
        let (mut g, _) = ln_cast(DType::BF16, true, false);
        assert_eq!(run(&mut g), 0, "the f32 output is a graph output");
        let (mut g, _) = ln_cast(DType::BF16, false, true);
        assert_eq!(run(&mut g), 0, "the cast's output is a graph output");
        let (mut g, _) = ln_cast(DType::F64, false, false);
        assert_eq!(run(&mut g), 0, "a cast to f64");
        assert!(g.nodes.iter().any(|n| n.op_type == "Cast"));
    }
}
