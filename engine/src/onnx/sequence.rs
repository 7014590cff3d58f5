//! Import-time rewrite of the one use of ONNX sequence types the exporters emit:
//! `seq = SplitToSequence(x, split)` read only by `SequenceAt(seq, p)` with a constant position
//! `p` (torch.split / chunk under the dynamo exporter, e.g. GPT-2's q/k/v split). Each
//! SequenceAt becomes `Slice(x, start, end, axis)` (plus `Squeeze` when keepdims=0), so the
//! engine needs no sequence type and Slice's gradient rule covers the backward pass.
//!
//! The split input must be a constant (absent, a scalar chunk size, or a 1-D list of sizes);
//! anything else that reads the sequence is refused with the node's name.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::ir::{Attr, Attrs, Graph, Node, ValueId, ValueKind};
use crate::tensor::Tensor;

/// A SplitToSequence seen during import, waiting for its SequenceAt readers.
pub struct PendingSplit {
    node: String,
    x: ValueId,
    split: Split,
    axis: i64,
    keepdims: bool,
}

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

    /// Records a SplitToSequence node (inputs x, split?; attributes axis, keepdims).
    pub fn split_to_sequence(&mut self, graph: &Graph, name: &str, inputs: &[String], output: &str, attrs: &Attrs) -> Result<()> {
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
        self.0.insert(output.to_string(), PendingSplit { node: name.to_string(), x, split, axis, keepdims });
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
        let (st, en, ax) = (c(graph, "start", start), c(graph, "end", end), c(graph, "axis", s.axis));
        let attrs = Attrs::default().with("__opset", Attr::Int(opset));
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

    fn model(split: Option<Tensor>, position: i64, reader: &str) -> Vec<u8> {
        let dims = [2i64, 6].map(|d| Dimension { value: Some(DimensionValue::DimValue(d)), ..Default::default() });
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

    /// (start, end) constants of the Slice that replaced the SequenceAt.
    fn slice_bounds(bytes: &[u8]) -> (i64, i64) {
        let g = import_bytes(bytes, None, &ImportOptions::default()).unwrap();
        let s = g.nodes.iter().find(|n| n.op_type == "Slice").expect("a Slice");
        let c = |i: usize| match &g.value(s.inputs[i].unwrap()).kind {
            ValueKind::Const(t) => t.to_i64_vec().unwrap()[0],
            _ => panic!("not a constant"),
        };
        assert_eq!(g.value(*s.outputs.first().unwrap()).name, "y");
        (c(1), c(2))
    }

    #[test]
    fn sequence_at_becomes_slice() {
        // scalar chunk size 4 over 6 columns: part 1 is [4, 8) (clamped to 6 by Slice)
        assert_eq!(slice_bounds(&model(Some(Tensor::from_i64(vec![], vec![4])), 1, "SequenceAt")), (4, 8));
        // explicit sizes [1, 2, 3]: part -1 is [3, 6)
        assert_eq!(slice_bounds(&model(Some(Tensor::from_i64(vec![3], vec![1, 2, 3])), -1, "SequenceAt")), (3, 6));
        // no split: parts of one
        assert_eq!(slice_bounds(&model(None, 2, "SequenceAt")), (2, 3));
        // anything else reading the sequence is refused by name
        let e = import_bytes(&model(None, 0, "Identity"), None, &ImportOptions::default()).unwrap_err().to_string();
        assert!(e.contains("sequence") && e.contains("at"), "{e}");
        let e = import_bytes(&model(Some(Tensor::from_i64(vec![3], vec![1, 2, 3])), 3, "SequenceAt"), None, &ImportOptions::default());
        assert!(e.unwrap_err().to_string().contains("out of range"));
    }
}
