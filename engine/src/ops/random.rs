//! Dropout (opset 12+: ratio and training_mode inputs; the mask output is always materialised,
//! because the gradient needs it), its internal gradient DropoutGrad(dy, mask, ratio, mode),
//! and the internal DropoutAdd(x, residual, ratio, mode) -> (Dropout(x) + residual, mask) of
//! passes/fuse_dropout_add.rs (a residual branch's dropout and its add in one pass over memory).

use super::util::input;
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::{Attrs, Node};
use crate::tensor::DType;

struct Dropout;
impl OpDef for Dropout {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let mut outs = vec![TypeOut::like(x)];
        if node.outputs.len() > 1 {
            outs.push(TypeOut::new(DType::Bool, x.shape.to_vec()));
        }
        Ok(outs)
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            if node.outputs.len() < 2 {
                return Err(node.err("the mask output is missing (the importer adds it)"));
            }
            let mask = g.y(1);
            let d = g.op_n("DropoutGrad", vec![Some(dy), Some(mask), node.input(1), node.input(2)], node.attrs.clone(), 1)[0];
            g.set(0, d);
            Ok(())
        })
    }
    fn is_random(&self) -> bool {
        true
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[1, 2]
    }
}

/// DropoutAdd's attribute naming x's element type (an ONNX code) where x is 16-bit: the
/// dropped value is rounded to it before the add, as the Dropout it replaces stored it (the
/// CPU computes 16-bit values widened to f32, so its kernel reads the type from here).
pub const DROPPED_TYPE: &str = "dropped_type";

/// Whether DropoutAdd may add a residual of type `r` to a dropped x of type `x`: the same type,
/// or f32 for a 16-bit x (a 16-bit branch joining an f32 stream, its Cast fused too).
pub fn residual_joins(x: DType, r: DType) -> bool {
    x == r || (x.is_half() && r == DType::F32)
}

struct DropoutAdd;
impl OpDef for DropoutAdd {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let (x, r) = (input(node, inputs, 0)?, input(node, inputs, 1)?);
        if x.shape != r.shape || !residual_joins(x.dtype, r.dtype) {
            return Err(node.err(format!(
                "the residual ({:?} {:?}) must have the dropped tensor's shape and its type or f32 ({:?} {:?})",
                r.dtype, r.shape, x.dtype, x.shape
            )));
        }
        let dropped = node.attrs.int(DROPPED_TYPE, 0)?;
        let want = if x.dtype.is_half() { x.dtype.onnx_code() as i64 } else { 0 };
        if dropped != want {
            return Err(node.err(format!("attribute {DROPPED_TYPE} is {dropped}: x is {:?}, so it must be {want}", x.dtype)));
        }
        Ok(vec![TypeOut::like(r), TypeOut::new(DType::Bool, x.shape.to_vec())])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let mask = g.y(1);
            // dy in x's type first, as the Cast's gradient did (a view where the types agree)
            let x = g.x(0)?;
            let dy_x = g.op("CastLike", &[dy, x], Attrs::default());
            let d = g.op_n("DropoutGrad", vec![Some(dy_x), Some(mask), node.input(2), node.input(3)], node.attrs.clone(), 1)[0];
            g.set(0, d);
            // the residual's shape is y's: its gradient is dy itself
            g.set(1, dy);
            Ok(())
        })
    }
    fn is_random(&self) -> bool {
        true
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[2, 3]
    }
}

struct DropoutGrad;
impl OpDef for DropoutGrad {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        Ok(vec![TypeOut::like(input(node, inputs, 0)?)])
    }
}

pub fn register(r: &mut Registry) {
    r.add("Dropout", Dropout);
    r.internal("DropoutGrad", DropoutGrad);
    r.internal("DropoutAdd", DropoutAdd);
}
