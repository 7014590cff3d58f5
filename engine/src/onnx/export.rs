//! ir::Graph -> ONNX ModelProto bytes: the forward graph (internal ops are refused), constants
//! and weights as initializers with the data the caller supplies (e.g. trained parameters).

use std::collections::HashMap;

use prost::Message;

use super::proto::{
    attr_type, AttributeProto, Dimension, DimensionValue, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorShapeProto,
    TypeProto, TypeProtoTensor, ValueInfoProto,
};
use super::tensor_proto::tensor_to_proto;
use crate::error::{Error, Result};
use crate::ir::{Attr, Dim, Graph, ValueId, ValueKind};
use crate::ops;
use crate::tensor::Tensor;

/// Serialises the first `n_nodes` nodes of `graph` (the forward graph) as an ONNX model;
/// `weights` gives the data of every weight by name (missing ones use their imported data).
pub fn export_model(graph: &Graph, n_nodes: usize, weights: &HashMap<String, Tensor>, opset: i64) -> Result<Vec<u8>> {
    let mut g = GraphProto { name: "ortrain".into(), ..Default::default() };
    let mut used: Vec<bool> = vec![false; graph.values.len()];
    for node in &graph.nodes[..n_nodes] {
        if ops::is_internal(&node.op_type) {
            return Err(node.err("internal ortrain op cannot be exported to ONNX"));
        }
        for v in node.inputs.iter().flatten() {
            used[v.0] = true;
        }
        let mut attribute = Vec::new();
        for (name, a) in &node.attrs.0 {
            if name.starts_with("__") {
                continue;
            }
            attribute.push(attr_proto(name, a));
        }
        let name_of = |v: &Option<ValueId>| v.map(|v| graph.value(v).name.clone()).unwrap_or_default();
        let outputs: Vec<String> = node.outputs.iter().map(|&v| graph.value(v).name.clone()).collect();
        g.node.push(NodeProto {
            input: node.inputs.iter().map(name_of).collect(),
            output: outputs,
            name: node.name.clone(),
            op_type: node.op_type.clone(),
            attribute,
            ..Default::default()
        });
    }
    for &o in &graph.outputs {
        used[o.0] = true;
    }
    let imported: HashMap<ValueId, &Tensor> = graph.weights.iter().filter_map(|(v, t)| t.as_deref().map(|t| (*v, t))).collect();
    for (i, v) in graph.values.iter().enumerate() {
        if !used[i] {
            continue;
        }
        match &v.kind {
            ValueKind::Const(t) => g.initializer.push(tensor_to_proto(&v.name, t)),
            ValueKind::Weight => {
                let t = weights
                    .get(&v.name)
                    .or_else(|| imported.get(&ValueId(i)).copied())
                    .ok_or_else(|| Error::Input { name: v.name.clone(), msg: "no data for this weight".into() })?;
                g.initializer.push(tensor_to_proto(&v.name, t));
            }
            ValueKind::Input => g.input.push(value_info(&v.name, v.dtype.map_or(1, |d| d.onnx_code()), v.shape.as_deref())),
            ValueKind::Computed => {}
        }
    }
    for &o in &graph.outputs {
        let v = graph.value(o);
        g.output.push(value_info(&v.name, v.dtype.map_or(1, |d| d.onnx_code()), v.shape.as_deref()));
    }
    let model = ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetIdProto { domain: String::new(), version: opset }],
        producer_name: "ortrain".into(),
        producer_version: env!("CARGO_PKG_VERSION").into(),
        graph: Some(g),
        metadata_props: super::recompute_meta::entry(&graph.recompute).into_iter().collect(),
        ..Default::default()
    };
    Ok(model.encode_to_vec())
}

fn value_info(name: &str, elem_type: i32, shape: Option<&[Dim]>) -> ValueInfoProto {
    let shape = shape.map(|dims| TensorShapeProto {
        dim: dims
            .iter()
            .map(|d| Dimension {
                value: Some(match d {
                    Dim::Known(k) => DimensionValue::DimValue(*k as i64),
                    Dim::Sym(s) => DimensionValue::DimParam(s.clone()),
                }),
                denotation: String::new(),
            })
            .collect(),
    });
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto { tensor_type: Some(TypeProtoTensor { elem_type, shape }), denotation: String::new() }),
        doc_string: String::new(),
    }
}

fn attr_proto(name: &str, a: &Attr) -> AttributeProto {
    let mut p = AttributeProto { name: name.into(), ..Default::default() };
    match a {
        Attr::Float(f) => (p.r#type, p.f) = (attr_type::FLOAT, *f),
        Attr::Int(i) => (p.r#type, p.i) = (attr_type::INT, *i),
        Attr::String(s) => (p.r#type, p.s) = (attr_type::STRING, s.as_bytes().to_vec()),
        Attr::Tensor(t) => (p.r#type, p.t) = (attr_type::TENSOR, Some(tensor_to_proto("", t))),
        Attr::Floats(v) => (p.r#type, p.floats) = (attr_type::FLOATS, v.clone()),
        Attr::Ints(v) => (p.r#type, p.ints) = (attr_type::INTS, v.clone()),
        Attr::Strings(v) => (p.r#type, p.strings) = (attr_type::STRINGS, v.iter().map(|s| s.as_bytes().to_vec()).collect()),
    }
    p
}
