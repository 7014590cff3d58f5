//! Dropout (opset 12+: ratio and training_mode inputs; the mask output is always materialised,
//! because the gradient needs it), its internal gradient DropoutGrad(dy, mask, ratio, mode),
//! and the internal DropoutAdd(x, residual, ratio, mode) -> (Dropout(x) + residual, mask) of
//! passes/fuse_dropout_add.rs (a residual branch's dropout and its add in one pass over memory).
//! DropoutAdd's gradient is a DropoutGrad carrying its `dropped_type`: dx in x's 16-bit type
//! from an f32 dy (rounded to that type first, as the Cast it fused took dy there), so a bf16
//! branch's gradient out of an f32 stream is one pass.
//!
//! DropoutKey() -> key (internal, made by passes/fuse_attention.rs from an attention's Dropout):
//! an int64 [1] holding a fresh 64-bit key of the step's random stream, drawn where the Dropout
//! drew its mask, which the fused attention keeps its dropout's elements by (ops/attention.rs).

use super::util::input;
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::Node;
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

/// The 16-bit type `node`'s `dropped_type` names, None where it is 0 (absent).
pub fn dropped_type(node: &Node) -> Result<Option<DType>> {
    let code = node.attrs.int(DROPPED_TYPE, 0)?;
    match DType::from_onnx(code as i32) {
        _ if code == 0 => Ok(None),
        Some(t) if t.is_half() => Ok(Some(t)),
        _ => Err(node.err(format!("attribute {DROPPED_TYPE} is {code}: not 0 or a 16-bit float type's ONNX code"))),
    }
}

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
        let want = x.dtype.is_half().then_some(x.dtype);
        if dropped_type(node)? != want {
            let code = want.map_or(0, |t| t.onnx_code());
            return Err(node.err(format!("attribute {DROPPED_TYPE} must be {code} for x of type {:?}", x.dtype)));
        }
        Ok(vec![TypeOut::like(r), TypeOut::new(DType::Bool, x.shape.to_vec())])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let mask = g.y(1);
            // dropped_type comes along: dx in x's type (an f32 dy rounded to it first)
            let d = g.op_n("DropoutGrad", vec![Some(dy), Some(mask), node.input(2), node.input(3)], node.attrs.clone(), 1)[0];
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

/// dx = mask ? dy · scale : 0 in dy's type or, with a `dropped_type`, in that 16-bit type (dy
/// of that type or f32, then rounded to it before the product).
struct DropoutGrad;
impl OpDef for DropoutGrad {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let dy = input(node, inputs, 0)?;
        match dropped_type(node)? {
            None => Ok(vec![TypeOut::like(dy)]),
            Some(t) if dy.dtype == t || dy.dtype == DType::F32 => Ok(vec![TypeOut::new(t, dy.shape.to_vec())]),
            Some(t) => Err(node.err(format!("dy is {:?}: with {DROPPED_TYPE} {:?} it must be {t:?} or F32", dy.dtype, t))),
        }
    }
}

struct DropoutKey;
impl OpDef for DropoutKey {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        if inputs.iter().any(|x| x.is_some()) {
            return Err(node.err("DropoutKey takes no inputs"));
        }
        Ok(vec![TypeOut::new(DType::I64, vec![1])])
    }
    fn is_random(&self) -> bool {
        true
    }
}

pub fn register(r: &mut Registry) {
    r.add("Dropout", Dropout);
    r.internal("DropoutKey", DropoutKey);
    r.internal("DropoutGrad", DropoutGrad);
    r.internal("DropoutAdd", DropoutAdd);
}
