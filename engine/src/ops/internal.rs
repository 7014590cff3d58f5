//! ortrain-internal helper ops that gradient rules emit: ReduceSumTo (undo broadcasting; with
//! `to`, f32 sums of 16-bit rows),
//! Affine (alpha·x + beta in x's dtype), MaskSelect (cond ? x : 0), ErfGrad.

use super::util::{const_ints, input};
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::error::Result;
use crate::ir::Node;

struct ReduceSumTo;
impl OpDef for ReduceSumTo {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let shape: Vec<usize> = const_ints(node, &inputs[1], "target shape")?.into_iter().map(|d| d.max(0) as usize).collect();
        if shape.len() > x.shape.len() {
            return Err(node.err(format!("cannot sum {:?} down to the larger rank {:?}", x.shape, shape)));
        }
        let off = x.shape.len() - shape.len();
        for (i, &d) in shape.iter().enumerate() {
            if d != 1 && d != x.shape[off + i] {
                return Err(node.err(format!("cannot sum {:?} down to {:?}", x.shape, shape)));
            }
        }
        // f32 from 16-bit rows where passes/wgrad_f32.rs asked (a bias gradient): attribute `to`
        Ok(vec![TypeOut::new(super::matmul::fused_output_type(node, x.dtype)?, shape)])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut crate::autodiff::GradCtx) -> Result<()>> {
        Some(|_, g| {
            if let Some(dy) = g.dy(0) {
                let x = g.x(0)?;
                let s = g.shape_of(x);
                let d = g.op("Expand", &[dy, s], Default::default());
                g.set(0, d);
            }
            Ok(())
        })
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[1]
    }
    fn is_view(&self) -> bool {
        true
    }
    fn is_view_for(&self, node: &Node, _inputs: &[Option<InferIn>]) -> bool {
        // one that changes the type converts, even where it sums nothing
        node.attrs.get("to").is_none()
    }
}

/// Output shaped like input 0 (or like input `like`).
struct SameAs(usize);
impl OpDef for SameAs {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        Ok(vec![TypeOut::like(input(node, inputs, self.0)?)])
    }
}

struct Affine;
impl OpDef for Affine {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        Ok(vec![TypeOut::like(input(node, inputs, 0)?)])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut crate::autodiff::GradCtx) -> Result<()>> {
        Some(|node, g| {
            if let Some(dy) = g.dy(0) {
                let alpha = node.attrs.float("alpha", 1.0)?;
                let d = g.affine(dy, alpha, 0.0);
                g.set(0, d);
            }
            Ok(())
        })
    }
}

pub fn register(r: &mut Registry) {
    r.internal("ReduceSumTo", ReduceSumTo);
    r.internal("Affine", Affine);
    r.internal("MaskSelect", SameAs(1));
    r.internal("ErfGrad", SameAs(0));
}
