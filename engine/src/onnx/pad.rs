//! Import-time rewrite of ONNX's Pad into ops both backends run with their gradients: a Slice
//! for negative pads (cropping), then per padded axis a Concat of the data with the blocks
//! before and after it. The blocks, by mode: `constant` an Expand of the value (CastLike the
//! data; 0 when absent) to the data's shape with the axis set to the pad (Shape, then a Mul
//! and an Add of constant vectors); `edge` an Expand of the first / last slice along the axis;
//! `reflect` Slices with step -1 (`b..1`, `n-2..n-1-e`); `wrap` the last `b` / first `e`.
//! Axes are padded in order, each from the array padded so far (numpy's `pad`, which ONNX's
//! reference follows). The pads (and axes) must be constants: a Pad whose pads are computed in
//! the step is refused, naming the node. Hugging Face's causal LM loss pads its labels
//! (`F.pad(labels, (0, 1), value=-100)`), so every `model(input_ids, labels=...)` holds one.

use crate::error::{Error, Result};
use crate::ir::{Attr, Attrs, Graph, Node, ValueId, ValueKind};
use crate::tensor::Tensor;

/// The registered ops a Pad becomes, for the op table (and its Shapes, computed when the step
/// is planned, as every Shape is).
pub const PARTS: &[&str] = &["Slice", "Mul", "Add", "CastLike", "Expand", "Concat", "Identity"];

struct Builder<'a> {
    graph: &'a mut Graph,
    name: &'a str,
    opset: i64,
    count: usize,
}

impl Builder<'_> {
    fn node(&mut self, op: &str, inputs: Vec<ValueId>, attrs: Attrs, output: Option<ValueId>) -> Result<ValueId> {
        self.count += 1;
        let name = format!("{}:{op}{}", self.name, self.count);
        let out = match output {
            Some(o) => o,
            None => self.graph.add_value(&format!("{name}:0"), ValueKind::Computed, None, None),
        };
        let attrs = attrs.with("__opset", Attr::Int(self.opset));
        self.graph.push_node(Node {
            name,
            op_type: op.into(),
            inputs: inputs.into_iter().map(Some).collect(),
            outputs: vec![out],
            attrs,
        })?;
        Ok(out)
    }
    fn ints(&mut self, v: &[i64]) -> ValueId {
        self.count += 1;
        let name = format!("{}:const{}", self.name, self.count);
        self.graph.add_const(&name, Tensor::from_i64(vec![v.len()], v.to_vec()))
    }
    /// `x[start:end:step]` along `axis`.
    fn slice(&mut self, x: ValueId, axis: i64, start: i64, end: i64, step: i64) -> Result<ValueId> {
        let ins = vec![x, self.ints(&[start]), self.ints(&[end]), self.ints(&[axis]), self.ints(&[step])];
        self.node("Slice", ins, Attrs::default(), None)
    }
    /// `x`'s shape with `axis` set to `len`.
    fn shape_with(&mut self, x: ValueId, rank: usize, axis: usize, len: i64) -> Result<ValueId> {
        let shape = self.node("Shape", vec![x], Attrs::default(), None)?;
        let keep: Vec<i64> = (0..rank).map(|a| i64::from(a != axis)).collect();
        let set: Vec<i64> = (0..rank).map(|a| if a == axis { len } else { 0 }).collect();
        let (keep, set) = (self.ints(&keep), self.ints(&set));
        let kept = self.node("Mul", vec![shape, keep], Attrs::default(), None)?;
        self.node("Add", vec![kept, set], Attrs::default(), None)
    }
}

/// The integers of a constant or of an initializer's data (initializers are weights until the
/// session makes the unbound ones constants).
fn constant_ints(graph: &Graph, v: Option<ValueId>) -> Option<Vec<i64>> {
    let v = v?;
    match &graph.value(v).kind {
        ValueKind::Const(t) => t.to_i64_vec(),
        ValueKind::Weight => graph.weights.iter().find(|(w, _)| *w == v)?.1.as_ref()?.to_i64_vec(),
        _ => None,
    }
}

/// Adds the nodes computing ONNX `Pad(inputs)` (attributes `attrs`) into `output`.
pub fn push(graph: &mut Graph, name: &str, inputs: &[Option<ValueId>], output: ValueId, attrs: &Attrs, opset: i64) -> Result<()> {
    let err = |msg: String| Error::Node { op_type: "Pad".into(), node: name.into(), msg };
    let data = inputs.first().copied().flatten().ok_or_else(|| err("input 0 (data) is required".into()))?;
    let mode = attrs.string("mode", "constant")?;
    if !["constant", "edge", "reflect", "wrap"].contains(&mode.as_str()) {
        return Err(err(format!("mode '{mode}' is not one of constant, edge, reflect, wrap")));
    }
    let (pads, value) = if opset < 11 {
        let pads = attrs.ints("pads")?.ok_or_else(|| err("attribute 'pads' is required".into()))?;
        let value = match attrs.0.iter().find(|(k, _)| k == "value") {
            Some((_, Attr::Float(f))) => Some(graph.add_const(&format!("{name}:value"), Tensor::from_f32(vec![], vec![*f]))),
            _ => None,
        };
        (pads, value)
    } else {
        let pads = constant_ints(graph, inputs.get(1).copied().flatten()).ok_or_else(|| {
            err("input 1 (pads) must be known before the step (a constant): pads computed in the step are not supported yet".into())
        })?;
        (pads, inputs.get(2).copied().flatten())
    };
    if pads.len() % 2 != 0 {
        return Err(err(format!("pads has {} values: expected 2 per padded axis", pads.len())));
    }
    let n = pads.len() / 2;
    let declared_rank = graph.value(data).shape.as_ref().map(Vec::len);
    let axes: Vec<i64> = match inputs.get(3).copied().flatten() {
        Some(a) => constant_ints(graph, Some(a)).ok_or_else(|| err("input 3 (axes) must be known before the step (a constant)".into()))?,
        None => (0..n as i64).collect(),
    };
    if axes.len() != n {
        return Err(err(format!("{} axes for {} pairs of pads", axes.len(), n)));
    }
    let rank = declared_rank.unwrap_or(n);
    let mut by_axis = vec![(0i64, 0i64); rank];
    for (k, &a) in axes.iter().enumerate() {
        let axis = if a < 0 { a + rank as i64 } else { a };
        if axis < 0 || axis as usize >= rank {
            return Err(err(format!("axis {a} is outside the data's rank {rank}")));
        }
        if a < 0 && declared_rank.is_none() {
            return Err(err(format!("negative axis {a} needs the data's rank, which is not declared")));
        }
        by_axis[axis as usize] = (pads[k], pads[k + n]);
    }
    let mut b = Builder { graph, name, opset: opset.max(13), count: 0 };
    let mut x = data;
    // negative pads crop
    for (axis, &(before, after)) in by_axis.iter().enumerate() {
        if before < 0 || after < 0 {
            let end = if after < 0 { after } else { i64::MAX };
            x = b.slice(x, axis as i64, (-before).max(0), end, 1)?;
        }
    }
    let padded: Vec<(usize, i64, i64)> =
        by_axis.iter().enumerate().filter(|(_, &(p, q))| p > 0 || q > 0).map(|(a, &(p, q))| (a, p.max(0), q.max(0))).collect();
    let fill = if mode == "constant" {
        let zero = value.unwrap_or_else(|| b.graph.add_const(&format!("{name}:zero"), Tensor::from_f32(vec![], vec![0.0])));
        Some(b.node("CastLike", vec![zero, data], Attrs::default(), None)?)
    } else {
        None
    };
    if padded.is_empty() {
        b.node("Identity", vec![x], Attrs::default(), Some(output))?;
        return Ok(());
    }
    for (k, &(axis, before, after)) in padded.iter().enumerate() {
        let a = axis as i64;
        let block = |b: &mut Builder, len: i64, at_start: bool| -> Result<ValueId> {
            match mode.as_str() {
                "constant" => {
                    let shape = b.shape_with(x, rank, axis, len)?;
                    let fill = fill.ok_or_else(|| err("no value to pad with".into()))?;
                    b.node("Expand", vec![fill, shape], Attrs::default(), None)
                }
                "edge" => {
                    let edge = if at_start { b.slice(x, a, 0, 1, 1)? } else { b.slice(x, a, -1, i64::MAX, 1)? };
                    let shape = b.shape_with(x, rank, axis, len)?;
                    b.node("Expand", vec![edge, shape], Attrs::default(), None)
                }
                "reflect" if at_start => b.slice(x, a, len, 0, -1),
                "reflect" => b.slice(x, a, -2, -2 - len, -1),
                _ if at_start => b.slice(x, a, -len, i64::MAX, 1),
                _ => b.slice(x, a, 0, len, 1),
            }
        };
        let mut parts = Vec::with_capacity(3);
        if before > 0 {
            parts.push(block(&mut b, before, true)?);
        }
        parts.push(x);
        if after > 0 {
            parts.push(block(&mut b, after, false)?);
        }
        let last = k + 1 == padded.len();
        x = b.node("Concat", parts, Attrs::default().with("axis", Attr::Int(a)), last.then_some(output))?;
    }
    Ok(())
}
