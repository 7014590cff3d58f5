//! Import-time rewrite of the one use of ONNX sequence types the exporters emit:
//! `seq = SplitToSequence(x, split)` read only by `SequenceAt(seq, p)` with a constant position
//! `p` (torch.split / chunk under the dynamo exporter, e.g. GPT-2's q/k/v split). Where the
//! part sizes are known at import (explicit sizes, or chunks of a dimension the model declares,
//! at most `MAX_PARTS` of them), the sequence becomes one `Split` node and each SequenceAt reads
//! its part (`Identity`, a view; `Squeeze` when keepdims=0): the backward pass is then one
//! Concat of the parts' gradients. Otherwise each SequenceAt becomes `Slice(x, start, end,
//! axis)`, whose gradients are summed as full-size zero-padded tensors. Either way the engine
//! needs no sequence type.
//!
//! The split input must be a constant (absent, a scalar chunk size, or a 1-D list of sizes);
//! anything else that reads the sequence is refused with the node's name.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::ir::{Attr, Attrs, Dim, Graph, Node, ValueId, ValueKind};
use crate::tensor::Tensor;

/// A SplitToSequence seen during import, waiting for its SequenceAt readers.
pub struct PendingSplit {
    node: String,
    x: ValueId,
    split: Split,
    axis: i64,
    keepdims: bool,
    /// The outputs of the Split node made for it, when the part sizes are known.
    parts: Option<Vec<ValueId>>,
}

/// More parts than this (a split into ones of a long axis) keep the per-reader Slices: a Split
/// computes every part, read or not.
const MAX_PARTS: usize = 64;

enum Split {
    /// No split input: chunks of 1.
    Ones,
    /// A scalar: chunks of this size, the last one possibly shorter.
    Chunk(i64),
    /// Explicit sizes.
    Sizes(Vec<i64>),
}

#[derive(Default)]
pub struct Sequences(HashMap<String, PendingSplit>);

impl Sequences {
    pub fn is_sequence(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    fn const_of<'g>(graph: &'g Graph, name: &str) -> Option<&'g Tensor> {
        match &graph.value(graph.find(name)?).kind {
            ValueKind::Const(t) => Some(t),
            _ => None,
        }
    }

    /// Records a SplitToSequence node (inputs x, split?; attributes axis, keepdims). `declared`:
    /// the sizes the model's value_info declares, by value name (None: symbolic).
    pub fn split_to_sequence(
        &mut self,
        graph: &mut Graph,
        name: &str,
        inputs: &[String],
        output: &str,
        attrs: &Attrs,
        declared: &HashMap<String, Vec<Option<usize>>>,
    ) -> Result<()> {
        let err = |msg: String| Error::Node { op_type: "SplitToSequence".into(), node: name.into(), msg };
        let x = inputs.first().and_then(|n| graph.find(n)).ok_or_else(|| err("input 0 is not defined before this node".into()))?;
        let split = match inputs.get(1).filter(|s| !s.is_empty()) {
            None => Split::Ones,
            Some(s) => {
                let t = Self::const_of(graph, s).ok_or_else(|| err(format!("split '{s}' must be a constant")))?;
                let v = t.to_i64_vec().ok_or_else(|| err("split must be integers".into()))?;
                if t.shape.is_empty() {
                    Split::Chunk(v[0].max(1))
                } else {
                    Split::Sizes(v)
                }
            }
        };
        let axis = attrs.int("axis", 0).map_err(|e| err(e.to_string()))?;
        let keepdims = attrs.int("keepdims", 1).map_err(|e| err(e.to_string()))? != 0;
        if !keepdims && !matches!(split, Split::Ones) {
            return Err(err("keepdims=0 is only valid without a split input".into()));
        }
        let parts = match part_sizes(&split, declared_dim(graph, declared, x, axis)) {
            Some(sizes) => Some(split_node(graph, name, x, output, axis, &sizes)?),
            None => None,
        };
        self.0.insert(output.to_string(), PendingSplit { node: name.to_string(), x, split, axis, keepdims, parts });
        Ok(())
    }

    /// Rewrites `output = SequenceAt(seq, position)` into Slice (+ Squeeze) nodes.
    pub fn sequence_at(&self, graph: &mut Graph, name: &str, seq: &str, position: &str, output: &str, opset: i64) -> Result<()> {
        let err = |msg: String| Error::Node { op_type: "SequenceAt".into(), node: name.into(), msg };
        let s = self.0.get(seq).ok_or_else(|| err(format!("'{seq}' is not a sequence made by SplitToSequence")))?;
        let p = Self::const_of(graph, position)
            .and_then(|t| t.to_i64_vec())
            .and_then(|v| v.first().copied())
            .ok_or_else(|| err(format!("position '{position}' must be a constant integer (sequence values are not supported)")))?;
        let (start, end) = match &s.split {
            Split::Ones => (p, if p == -1 { i64::MAX } else { p + 1 }),
            Split::Chunk(c) if p >= 0 => (p * c, (p + 1) * c),
            Split::Chunk(_) => return Err(err(format!("negative position {p} into a sequence of unknown length (split by '{}')", s.node))),
            Split::Sizes(v) => {
                let n = v.len() as i64;
                let q = if p < 0 { p + n } else { p };
                if q < 0 || q >= n {
                    return Err(err(format!("position {p} is out of range for {n} parts")));
                }
                let start: i64 = v[..q as usize].iter().sum();
                (start, start + v[q as usize])
            }
        };
        let c = |g: &mut Graph, what: &str, v: i64| g.add_const(&format!("{name}/{what}"), Tensor::from_i64(vec![1], vec![v]));
        let attrs = Attrs::default().with("__opset", Attr::Int(opset));
        if let Some(parts) = &s.parts {
            let n = parts.len() as i64;
            let q = if p < 0 { p + n } else { p };
            let part = *usize::try_from(q)
                .ok()
                .and_then(|q| parts.get(q))
                .ok_or_else(|| err(format!("position {p} is out of range for {n} parts")))?;
            let out = graph.add_value(output, ValueKind::Computed, None, None);
            let (op_type, mut inputs) = if s.keepdims { ("Identity", vec![Some(part)]) } else { ("Squeeze", vec![Some(part)]) };
            if !s.keepdims {
                inputs.push(Some(c(graph, "axis", s.axis)));
            }
            let read = Node { name: format!("{name}/{op_type}"), op_type: op_type.into(), inputs, outputs: vec![out], attrs };
            graph.push_node(read)?;
            return Ok(());
        }
        let (st, en, ax) = (c(graph, "start", start), c(graph, "end", end), c(graph, "axis", s.axis));
        let out = graph.add_value(output, ValueKind::Computed, None, None);
        let sliced = if s.keepdims { out } else { graph.add_value(&format!("{name}/sliced"), ValueKind::Computed, None, None) };
        let slice = Node {
            name: format!("{name}/Slice"),
            op_type: "Slice".into(),
            inputs: vec![Some(s.x), Some(st), Some(en), Some(ax)],
            outputs: vec![sliced],
            attrs: attrs.clone(),
        };
        graph.push_node(slice)?;
        if !s.keepdims {
            let sq = Node {
                name: format!("{name}/Squeeze"),
                op_type: "Squeeze".into(),
                inputs: vec![Some(sliced), Some(ax)],
                outputs: vec![out],
                attrs,
            };
            graph.push_node(sq)?;
        }
        Ok(())
    }
}

/// x's size along `axis` where it is known at import: from its own declared shape (an input, a
/// weight, a constant) or the model's value_info.
fn declared_dim(graph: &Graph, declared: &HashMap<String, Vec<Option<usize>>>, x: ValueId, axis: i64) -> Option<usize> {
    let v = graph.value(x);
    let dims: Vec<Option<usize>> = match &v.shape {
        Some(shape) => shape.iter().map(|d| if let Dim::Known(k) = d { Some(*k) } else { None }).collect(),
        None => declared.get(&v.name)?.clone(),
    };
    let rank = dims.len() as i64;
    let a = if axis < 0 { axis + rank } else { axis };
    if !(0..rank).contains(&a) {
        return None;
    }
    dims[a as usize]
}

/// Every part's size, where known: explicit sizes, or chunks of a declared dimension (the last
/// one possibly shorter); None past `MAX_PARTS` parts.
fn part_sizes(split: &Split, dim: Option<usize>) -> Option<Vec<i64>> {
    let sizes = match (split, dim) {
        (Split::Sizes(v), _) => v.clone(),
        (Split::Chunk(c), Some(d)) => {
            let c = usize::try_from(*c).ok()?.max(1);
            (0..d.div_ceil(c)).map(|i| (c.min(d - i * c)) as i64).collect()
        }
        (Split::Ones, Some(d)) => vec![1; d],
        _ => return None,
    };
    (!sizes.is_empty() && sizes.len() <= MAX_PARTS && sizes.iter().all(|&s| s >= 0)).then_some(sizes)
}

/// One Split node of `x` into parts of `sizes` along `axis`; its outputs.
fn split_node(graph: &mut Graph, name: &str, x: ValueId, seq: &str, axis: i64, sizes: &[i64]) -> Result<Vec<ValueId>> {
    let split = graph.add_const(&format!("{name}/split"), Tensor::from_i64(vec![sizes.len()], sizes.to_vec()));
    let parts: Vec<ValueId> =
        (0..sizes.len()).map(|i| graph.add_value(&format!("{seq}/part{i}"), ValueKind::Computed, None, None)).collect();
    graph.push_node(Node {
        name: format!("{name}/Split"),
        op_type: "Split".into(),
        inputs: vec![Some(x), Some(split)],
        outputs: parts.clone(),
        attrs: Attrs::default().with("axis", Attr::Int(axis)),
    })?;
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use crate::ir::ValueKind;
    use crate::onnx::proto::*;
    use crate::onnx::{import_bytes, tensor_to_proto, ImportOptions};
    use crate::tensor::Tensor;

    fn constant(out: &str, t: Tensor) -> NodeProto {
        let value =
            AttributeProto { name: "value".into(), r#type: attr_type::TENSOR, t: Some(tensor_to_proto("", &t)), ..Default::default() };
        NodeProto { output: vec![out.into()], op_type: "Constant".into(), attribute: vec![value], ..Default::default() }
    }

    /// x [2, 6] (the 6 symbolic when `symbolic`) split along axis 1, part `position` read by `reader`.
    fn model_of(split: Option<Tensor>, position: i64, reader: &str, symbolic: bool) -> Vec<u8> {
        let dim = |d: i64| {
            let value = if symbolic && d == 6 { DimensionValue::DimParam("width".into()) } else { DimensionValue::DimValue(d) };
            Dimension { value: Some(value), ..Default::default() }
        };
        let dims = [dim(2), dim(6)];
        let ty = TypeProto {
            tensor_type: Some(TypeProtoTensor { elem_type: 1, shape: Some(TensorShapeProto { dim: dims.to_vec() }) }),
            ..Default::default()
        };
        let mut nodes = vec![constant("pos", Tensor::from_i64(vec![], vec![position]))];
        let mut split_inputs = vec!["x".to_string()];
        if let Some(s) = split {
            nodes.push(constant("split", s));
            split_inputs.push("split".into());
        }
        let axis = AttributeProto { name: "axis".into(), r#type: attr_type::INT, i: 1, ..Default::default() };
        nodes.push(NodeProto {
            input: split_inputs,
            output: vec!["seq".into()],
            name: "s2s".into(),
            op_type: "SplitToSequence".into(),
            attribute: vec![axis],
            ..Default::default()
        });
        nodes.push(NodeProto {
            input: vec!["seq".into(), "pos".into()],
            output: vec!["y".into()],
            name: "at".into(),
            op_type: reader.into(),
            ..Default::default()
        });
        let graph = GraphProto {
            node: nodes,
            input: vec![ValueInfoProto { name: "x".into(), r#type: Some(ty), ..Default::default() }],
            output: vec![ValueInfoProto { name: "y".into(), ..Default::default() }],
            ..Default::default()
        };
        let m = ModelProto {
            ir_version: 8,
            opset_import: vec![OperatorSetIdProto { domain: String::new(), version: 18 }],
            graph: Some(graph),
            ..Default::default()
        };
        m.encode_to_vec()
    }

    fn model(split: Option<Tensor>, position: i64, reader: &str) -> Vec<u8> {
        model_of(split, position, reader, false)
    }

    /// (start, end) constants of the Slice that replaced the SequenceAt (x's width symbolic).
    fn slice_bounds(split: Option<Tensor>, position: i64) -> (i64, i64) {
        let g = import_bytes(&model_of(split, position, "SequenceAt", true), None, &ImportOptions::default()).unwrap();
        assert!(!g.nodes.iter().any(|n| n.op_type == "Split"));
        let s = g.nodes.iter().find(|n| n.op_type == "Slice").expect("a Slice");
        let c = |i: usize| match &g.value(s.inputs[i].unwrap()).kind {
            ValueKind::Const(t) => t.to_i64_vec().unwrap()[0],
            _ => panic!("not a constant"),
        };
        assert_eq!(g.value(*s.outputs.first().unwrap()).name, "y");
        (c(1), c(2))
    }

    /// The sizes of the Split that replaced the sequence (x's width declared), and the part `y` reads.
    fn split_parts(split: Option<Tensor>, position: i64) -> (Vec<i64>, usize) {
        let g = import_bytes(&model(split, position, "SequenceAt"), None, &ImportOptions::default()).unwrap();
        assert!(!g.nodes.iter().any(|n| n.op_type == "Slice"));
        let s = g.nodes.iter().find(|n| n.op_type == "Split").expect("a Split");
        let sizes = match &g.value(s.inputs[1].unwrap()).kind {
            ValueKind::Const(t) => t.to_i64_vec().unwrap(),
            _ => panic!("not a constant"),
        };
        let read = g.nodes.iter().find(|n| n.op_type == "Identity").expect("an Identity");
        assert_eq!(g.value(read.outputs[0]).name, "y");
        (sizes, s.outputs.iter().position(|&o| Some(o) == read.inputs[0]).expect("reads a part"))
    }

    #[test]
    fn a_sequence_of_known_parts_becomes_one_split() {
        // scalar chunk size 4 over 6 columns: parts [4, 2], part 1 read
        assert_eq!(split_parts(Some(Tensor::from_i64(vec![], vec![4])), 1), (vec![4, 2], 1));
        // explicit sizes [1, 2, 3]: part -1 is the last
        assert_eq!(split_parts(Some(Tensor::from_i64(vec![3], vec![1, 2, 3])), -1), (vec![1, 2, 3], 2));
        // no split: parts of one
        assert_eq!(split_parts(None, 2), (vec![1; 6], 2));
        let e = import_bytes(&model(Some(Tensor::from_i64(vec![], vec![4])), 2, "SequenceAt"), None, &ImportOptions::default());
        assert!(e.unwrap_err().to_string().contains("out of range"));
    }

    #[test]
    fn sequence_at_becomes_slice() {
        // scalar chunk size 4 over a symbolic width: part 1 is [4, 8) (clamped by Slice)
        assert_eq!(slice_bounds(Some(Tensor::from_i64(vec![], vec![4])), 1), (4, 8));
        // no split: parts of one
        assert_eq!(slice_bounds(None, 2), (2, 3));
        // anything else reading the sequence is refused by name
        let e = import_bytes(&model(None, 0, "Identity"), None, &ImportOptions::default()).unwrap_err().to_string();
        assert!(e.contains("sequence") && e.contains("at"), "{e}");
        let e = import_bytes(&model(Some(Tensor::from_i64(vec![3], vec![1, 2, 3])), 3, "SequenceAt"), None, &ImportOptions::default());
        assert!(e.unwrap_err().to_string().contains("out of range"));
    }
}
