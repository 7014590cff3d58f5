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
            let sq = Node { name: format!("{name}/Squeeze"), op_type: "Squeeze".into(), inputs: vec![Some(sliced), Some(ax)], outputs: vec![out], attrs };
            graph.push_node(sq)?;
        }
        Ok(())
    }
}
