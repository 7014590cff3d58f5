//! Ops that compute shapes and fills: Shape, Size, ConstantOfShape, Range. Their results are
//! normally known before the step and folded away by the planner.

use super::util::{const_ints, input};
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::DType;

struct Shape;
impl OpDef for Shape {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let (s, e) = shape_range(node, x.shape.len())?;
        Ok(vec![TypeOut::new(DType::I64, vec![e.saturating_sub(s)])])
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[0]
    }
}

/// Shape-15's start/end attributes, clamped.
pub fn shape_range(node: &Node, rank: usize) -> Result<(usize, usize)> {
    let r = rank as i64;
    let fix = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
    let start = fix(node.attrs.int("start", 0)?);
    // an end before the start selects nothing (Shape-15: an empty output, not an error)
    Ok((start, fix(node.attrs.int("end", r)?).max(start)))
}

struct Size;
impl OpDef for Size {
    fn infer(&self, _: &Node, _: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        Ok(vec![TypeOut::new(DType::I64, vec![])])
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[0]
    }
}

struct ConstantOfShape;
impl OpDef for ConstantOfShape {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let s = const_ints(node, &inputs[0], "shape")?;
        let dtype = node.attrs.tensor("value").map(|t| t.dtype()).unwrap_or(DType::F32);
        Ok(vec![TypeOut::new(dtype, s.into_iter().map(|d| d.max(0) as usize).collect())])
    }
}

struct Range;
impl OpDef for Range {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let start = input(node, inputs, 0)?;
        let vals: Vec<f64> = (0..3)
            .map(|i| {
                inputs[i]
                    .as_ref()
                    .and_then(|x| x.value)
                    .map(|t| t.to_f64_vec()[0])
                    .ok_or_else(|| node.err("start, limit and delta must be known before the step"))
            })
            .collect::<Result<_>>()?;
        if vals[2] == 0.0 {
            return Err(node.err("delta is 0"));
        }
        let n = ((vals[1] - vals[0]) / vals[2]).ceil().max(0.0) as usize;
        Ok(vec![TypeOut::new(start.dtype, vec![n])])
    }
}

pub fn register(r: &mut Registry) {
    r.add("Shape", Shape);
    r.add("Size", Size);
    r.add("ConstantOfShape", ConstantOfShape);
    r.add("Range", Range);
}
