//! Softmax and LogSoftmax along one axis (opset ≥ 13; older opsets flatten from `axis` on) and
//! their internal gradients SoftmaxGrad(dy, y) and LogSoftmaxGrad(dy, y).

use super::util::{input, norm_axis};
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::Node;

/// (outer, n, inner): the softmax runs over n elements at stride inner.
pub fn softmax_layout(node: &Node, shape: &[usize]) -> Result<(usize, usize, usize)> {
    let opset = node.attrs.int("__opset", 13)?;
    let rank = shape.len();
    let default = if opset >= 13 { -1 } else { 1 };
    let axis = norm_axis(node, node.attrs.int("axis", default)?, rank)?;
    let outer: usize = shape[..axis].iter().product();
    if opset < 13 {
        return Ok((outer, shape[axis..].iter().product(), 1));
    }
    Ok((outer, shape[axis], shape[axis + 1..].iter().product()))
}

struct Softmax;
impl OpDef for Softmax {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        softmax_layout(node, x.shape)?;
        Ok(vec![TypeOut::like(x)])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            if let Some(dy) = g.dy(0) {
                let y = g.y(0);
                let op = if node.op_type == "Softmax" { "SoftmaxGrad" } else { "LogSoftmaxGrad" };
                let mut attrs = node.attrs.clone();
                attrs.0.retain(|(k, _)| k == "axis" || k == "__opset");
                let d = g.op(op, &[dy, y], attrs);
                g.set(0, d);
            }
            Ok(())
        })
    }
}

struct SameAsFirst;
impl OpDef for SameAsFirst {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        Ok(vec![TypeOut::like(input(node, inputs, 0)?)])
    }
}

pub fn register(r: &mut Registry) {
    r.add("Softmax", Softmax);
    r.add("LogSoftmax", Softmax);
    r.internal("SoftmaxGrad", SameAsFirst);
    r.internal("LogSoftmaxGrad", SameAsFirst);
}
