//! ModelProto -> ir::Graph. Initializers become weights (bindable by name at run time),
//! Constant nodes become constant values, dims become known or symbolic.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use prost::Message;

use super::proto::{attr_type, AttributeProto, DimensionValue, ModelProto, NodeProto, ValueInfoProto};
use super::sequence::Sequences;
use super::tensor_proto::tensor_from_proto;
use crate::error::{Error, Result};
use crate::ir::{Attr, Attrs, Dim, Graph, Node, ValueKind};
use crate::ops;
use crate::tensor::{DType, Tensor};

/// The default-domain opsets the importer accepts: 11 up to the newest the pinned onnx (1.23)
/// defines. Opsets 24–28 change no semantics of the registered ops for the element types the
/// engine has (they add types: float8/4/6, int2/4; Mod-28 defines float fmod=0, Range-27 adds a
/// float16 stash type); a newly registered op must check its own version history.
pub const OPSET_RANGE: std::ops::RangeInclusive<i64> = 11..=28;

#[derive(Clone, Debug, Default)]
pub struct ImportOptions {
    /// Accept ops the registry does not know (for inspection tools); execution still refuses them.
    pub allow_unknown_ops: bool,
}

pub fn import_file(path: &Path, opts: &ImportOptions) -> Result<Graph> {
    let bytes = std::fs::read(path).map_err(|e| Error::onnx(path.display().to_string(), format!("cannot read: {e}")))?;
    import_bytes(&bytes, path.parent(), opts)
}

/// External-data location of an initializer whose data the caller binds at run time (the
/// Python exporter strips the module's parameters this way): no data, only type and shape.
pub const BOUND_LOCATION: &str = "ortrain:bound";

/// (dtype, dims) of an initializer marked as bound by the caller, None for ordinary ones.
fn bound_placeholder(t: &crate::onnx::proto::TensorProto, field: &str) -> Result<Option<(crate::tensor::DType, Vec<usize>)>> {
    if t.data_location != 1 || !t.external_data.iter().any(|e| e.key == "location" && e.value == BOUND_LOCATION) {
        return Ok(None);
    }
    let dtype = crate::tensor::DType::from_onnx(t.data_type)
        .ok_or_else(|| Error::onnx(format!("{field}.data_type"), format!("element type code {} is not supported yet", t.data_type)))?;
    let dims = t
        .dims
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| Error::onnx(format!("{field}.dims"), format!("negative dimension {d}"))))
        .collect::<Result<Vec<usize>>>()?;
    Ok(Some((dtype, dims)))
}

pub fn import_bytes(bytes: &[u8], base_dir: Option<&Path>, opts: &ImportOptions) -> Result<Graph> {
    let model =
        ModelProto::decode(bytes).map_err(|e| Error::onnx("ModelProto", format!("cannot decode protobuf ({} bytes): {e}", bytes.len())))?;
    let opset = default_opset(&model)?;
    let g = model.graph.as_ref().ok_or_else(|| Error::onnx("ModelProto.graph", "missing"))?;
    if g.node.is_empty() && g.output.is_empty() {
        return Err(Error::onnx("ModelProto.graph", "the graph is empty (truncated file?)"));
    }
    let mut graph = Graph::default();

    let init_names: HashSet<&str> = g.initializer.iter().map(|t| t.name.as_str()).collect();
    for (i, t) in g.initializer.iter().enumerate() {
        let field = format!("graph.initializer[{i}] '{}'", t.name);
        if t.name.is_empty() {
            return Err(Error::onnx(field, "initializer without a name"));
        }
        if let Some((dtype, dims)) = bound_placeholder(t, &field)? {
            let v = graph.add_value(&t.name, ValueKind::Weight, Some(dtype), Some(dims.into_iter().map(Dim::Known).collect()));
            graph.weights.push((v, None));
            continue;
        }
        let tensor = tensor_from_proto(t, base_dir, &field)?;
        let shape = tensor.shape.iter().map(|&d| Dim::Known(d)).collect();
        let v = graph.add_value(&t.name, ValueKind::Weight, Some(tensor.dtype()), Some(shape));
        graph.weights.push((v, Some(Arc::new(tensor))));
    }
    for (i, vi) in g.input.iter().enumerate() {
        if init_names.contains(vi.name.as_str()) {
            continue; // an initializer also listed as input (keep_initializers_as_inputs)
        }
        let (dtype, shape) = value_type(vi, &format!("graph.input[{i}] '{}'", vi.name))?;
        let v = graph.add_value(&vi.name, ValueKind::Input, Some(dtype), Some(shape));
        graph.inputs.push(v);
    }
    let mut unknown = Vec::new();
    let mut seqs = Sequences::default();
    let declared = declared_shapes(&g.value_info);
    for (i, n) in g.node.iter().enumerate() {
        import_node(&mut graph, n, i, opset, base_dir, opts, &mut unknown, &mut seqs, &declared)?;
    }
    if !unknown.is_empty() {
        let mut types: Vec<&str> = unknown.iter().map(|(op, _)| op.as_str()).collect();
        types.sort_unstable();
        types.dedup();
        let list: Vec<String> = unknown.iter().map(|(op, n)| format!("{op} (node '{n}')")).collect();
        return Err(Error::UnknownOps { op_types: types.join(", "), nodes: list.join(", ") });
    }
    keep_declared_shapes(&mut graph, &g.value_info);
    for entry in model.metadata_props.iter().filter(|e| e.key == super::recompute_meta::KEY) {
        graph.recompute.extend(super::recompute_meta::parse(&entry.value)?);
    }
    for (i, vi) in g.output.iter().enumerate() {
        let v = graph
            .find(&vi.name)
            .ok_or_else(|| Error::onnx(format!("graph.output[{i}]"), format!("'{}' is produced by no node", vi.name)))?;
        graph.outputs.push(v);
    }
    Ok(graph)
}

fn default_opset(model: &ModelProto) -> Result<i64> {
    let v = model
        .opset_import
        .iter()
        .find(|o| o.domain.is_empty() || o.domain == "ai.onnx")
        .map(|o| o.version)
        .ok_or_else(|| Error::onnx("ModelProto.opset_import", "no default-domain (ai.onnx) opset"))?;
    if !OPSET_RANGE.contains(&v) {
        return Err(Error::onnx(
            "ModelProto.opset_import",
            format!("opset {v} is not supported (supported: {}..={})", OPSET_RANGE.start(), OPSET_RANGE.end()),
        ));
    }
    Ok(v)
}

fn value_type(vi: &ValueInfoProto, field: &str) -> Result<(DType, Vec<Dim>)> {
    let tt = vi
        .r#type
        .as_ref()
        .and_then(|t| t.tensor_type.as_ref())
        .ok_or_else(|| Error::onnx(format!("{field}.type"), "only tensor inputs are supported"))?;
    let dtype = DType::from_onnx(tt.elem_type)
        .ok_or_else(|| Error::onnx(format!("{field}.type.elem_type"), format!("element type code {} is not supported", tt.elem_type)))?;
    let dims = match &tt.shape {
        None => return Err(Error::onnx(format!("{field}.type.shape"), "the input's rank is unknown")),
        Some(s) => s
            .dim
            .iter()
            .enumerate()
            .map(|(k, d)| match &d.value {
                Some(DimensionValue::DimValue(v)) if *v >= 0 => Dim::Known(*v as usize),
                Some(DimensionValue::DimParam(p)) if !p.is_empty() => Dim::Sym(p.clone()),
                _ => Dim::Sym(format!("{}_dim{k}", vi.name)),
            })
            .collect(),
    };
    Ok((dtype, dims))
}

/// The shapes value_info declares for computed values, symbols included, kept on the values
/// (`Value::shape`) for passes that must prove what a Reshape does (passes/sym_shape.rs); plans
/// infer every shape themselves. An entry without a usable type or shape is left out.
fn keep_declared_shapes(graph: &mut Graph, value_info: &[ValueInfoProto]) {
    for vi in value_info {
        let Some(v) = graph.find(&vi.name) else { continue };
        let value = &graph.values[v.0];
        if value.kind != ValueKind::Computed || value.shape.is_some() {
            continue;
        }
        if let Ok((_, dims)) = value_type(vi, "value_info") {
            graph.values[v.0].shape = Some(dims);
        }
    }
}

/// The sizes value_info declares for intermediate values, by name (None: symbolic or absent).
/// Only import-time rewrites read them (sequence.rs); plans infer every shape themselves.
fn declared_shapes(value_info: &[ValueInfoProto]) -> HashMap<String, Vec<Option<usize>>> {
    value_info
        .iter()
        .filter_map(|vi| {
            let shape = vi.r#type.as_ref()?.tensor_type.as_ref()?.shape.as_ref()?;
            let dims = shape
                .dim
                .iter()
                .map(|d| match &d.value {
                    Some(DimensionValue::DimValue(v)) if *v >= 0 => Some(*v as usize),
                    _ => None,
                })
                .collect();
            Some((vi.name.clone(), dims))
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn import_node(
    graph: &mut Graph,
    n: &NodeProto,
    index: usize,
    opset: i64,
    base_dir: Option<&Path>,
    opts: &ImportOptions,
    unknown: &mut Vec<(String, String)>,
    seqs: &mut Sequences,
    declared: &HashMap<String, Vec<Option<usize>>>,
) -> Result<()> {
    let name = if n.name.is_empty() { format!("{}_{index}", n.op_type) } else { n.name.clone() };
    let field = format!("graph.node[{index}] '{name}' ({})", n.op_type);
    if !(n.domain.is_empty() || n.domain == "ai.onnx") {
        for out in n.output.iter().filter(|o| !o.is_empty()) {
            graph.add_value(out, ValueKind::Computed, None, None);
        }
        unknown.push((format!("{}::{}", n.domain, n.op_type), name));
        return Ok(());
    }
    let mut attrs = Attrs::default();
    for a in &n.attribute {
        attrs.0.push((a.name.clone(), convert_attr(a, base_dir, &field)?));
    }
    if n.op_type == "Constant" {
        let t = constant_value(&attrs).map_err(|e| Error::onnx(field.clone(), e.to_string()))?;
        let out = n.output.first().ok_or_else(|| Error::onnx(field.clone(), "Constant without output"))?;
        let dtype = t.dtype();
        let shape = t.shape.iter().map(|&d| Dim::Known(d)).collect();
        graph.add_value(out, ValueKind::Const(Arc::new(t)), Some(dtype), Some(shape));
        return Ok(());
    }
    // sequences: SplitToSequence read by SequenceAt(constant) becomes Slices (see sequence.rs)
    if n.op_type == "SplitToSequence" {
        let out = n.output.first().ok_or_else(|| Error::onnx(field.clone(), "SplitToSequence without output"))?;
        return seqs.split_to_sequence(graph, &name, &n.input, out, &attrs, declared);
    }
    if n.op_type == "SequenceAt" && n.input.first().is_some_and(|s| seqs.is_sequence(s)) {
        let (out, pos) = (n.output.first(), n.input.get(1));
        let (Some(out), Some(pos)) = (out, pos) else {
            return Err(Error::onnx(field, "SequenceAt needs a sequence, a position and an output"));
        };
        return seqs.sequence_at(graph, &name, &n.input[0], pos, out, opset);
    }
    let rewritten = super::variadic::rewrites(&n.op_type, n.input.len()) || n.op_type == "Pad";
    if ops::lookup(&n.op_type).is_none() && !rewritten && !opts.allow_unknown_ops {
        // define the outputs anyway, so that every unknown op is reported, not just the first
        for out in n.output.iter().filter(|o| !o.is_empty()) {
            graph.add_value(out, ValueKind::Computed, None, None);
        }
        unknown.push((n.op_type.clone(), name));
        return Ok(());
    }
    let mut inputs = Vec::with_capacity(n.input.len());
    for (k, inp) in n.input.iter().enumerate() {
        if inp.is_empty() {
            inputs.push(None);
            continue;
        }
        if seqs.is_sequence(inp) {
            return Err(Error::onnx(
                format!("{field}.input[{k}]"),
                format!("'{inp}' is a sequence (from SplitToSequence); only SequenceAt with a constant position may read it"),
            ));
        }
        let v = graph
            .find(inp)
            .ok_or_else(|| Error::onnx(format!("{field}.input[{k}]"), format!("'{inp}' is not defined before this node")))?;
        inputs.push(Some(v));
    }
    let mut outputs = Vec::with_capacity(n.output.len());
    for out in &n.output {
        // an unused optional output has an empty name; give it one so kernels can still write it
        let out_name = if out.is_empty() { format!("{name}:unused{}", outputs.len()) } else { out.clone() };
        if graph.find(&out_name).is_some() {
            return Err(Error::onnx(field.clone(), format!("output '{out_name}' is defined twice")));
        }
        outputs.push(graph.add_value(&out_name, ValueKind::Computed, None, None));
    }
    if rewritten {
        // Sum, Mean, and Max/Min of other than two inputs: chains of the binary ops (variadic.rs);
        // Pad
        let [output] = outputs[..] else {
            return Err(Error::onnx(field, format!("{} has {} outputs, expected 1", n.op_type, outputs.len())));
        };
        if n.op_type == "Pad" {
            // Slices, Expands and Concats (pad.rs)
            return super::pad::push(graph, &name, &inputs, output, &attrs, opset);
        }
        return super::variadic::push(graph, &name, &n.op_type, &inputs, output, opset);
    }
    if n.op_type == "Dropout" && outputs.len() == 1 {
        // the gradient needs the mask: always materialise it
        outputs.push(graph.add_value(&format!("{name}:mask"), ValueKind::Computed, None, None));
    }
    if n.op_type == "MaxPool" && outputs.len() == 1 {
        // the gradient scatters at the argmax positions: always materialise Indices
        outputs.push(graph.add_value(&format!("{name}:indices"), ValueKind::Computed, None, None));
    }
    attrs.set("__opset", Attr::Int(opset));
    graph.push_node(Node { name, op_type: n.op_type.clone(), inputs, outputs, attrs })?;
    Ok(())
}

fn convert_attr(a: &AttributeProto, base_dir: Option<&Path>, field: &str) -> Result<Attr> {
    let f = format!("{field}.attribute '{}'", a.name);
    let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    Ok(match a.r#type {
        attr_type::FLOAT => Attr::Float(a.f),
        attr_type::INT => Attr::Int(a.i),
        attr_type::STRING => Attr::String(s(&a.s)),
        attr_type::TENSOR => Attr::Tensor(tensor_from_proto(
            a.t.as_ref().ok_or_else(|| Error::onnx(f.clone(), "tensor attribute without a tensor"))?,
            base_dir,
            &f,
        )?),
        attr_type::FLOATS => Attr::Floats(a.floats.clone()),
        attr_type::INTS => Attr::Ints(a.ints.clone()),
        attr_type::STRINGS => Attr::Strings(a.strings.iter().map(|b| s(b)).collect()),
        attr_type::GRAPH => return Err(Error::onnx(f, "graph attributes (If/Loop/Scan bodies) are not supported yet")),
        other => return Err(Error::onnx(f, format!("attribute type {other} is not supported"))),
    })
}

fn constant_value(attrs: &Attrs) -> Result<Tensor> {
    if let Some(t) = attrs.tensor("value") {
        return Ok(t.clone());
    }
    match attrs.0.first().map(|(n, a)| (n.as_str(), a)) {
        Some(("value_float", Attr::Float(v))) => Ok(Tensor::scalar_f32(*v)),
        Some(("value_floats", Attr::Floats(v))) => Ok(Tensor::from_f32(vec![v.len()], v.clone())),
        Some(("value_int", Attr::Int(v))) => Ok(Tensor::from_i64(vec![], vec![*v])),
        Some(("value_ints", Attr::Ints(v))) => Ok(Tensor::from_i64(vec![v.len()], v.clone())),
        _ => Err(Error::other("Constant needs one of value, value_float(s), value_int(s)")),
    }
}
