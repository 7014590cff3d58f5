//! Dropout (opset 12+: ratio and training_mode inputs; the mask output is always materialised,
//! because the gradient needs it) and its internal gradient DropoutGrad(dy, mask, ratio, mode).

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

struct DropoutGrad;
impl OpDef for DropoutGrad {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        Ok(vec![TypeOut::like(input(node, inputs, 0)?)])
    }
}

pub fn register(r: &mut Registry) {
    r.add("Dropout", Dropout);
    r.internal("DropoutGrad", DropoutGrad);
}
