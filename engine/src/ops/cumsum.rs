//! CumSum (opset 14): running sum of x along the axis given by the scalar input 1 (known before
//! the step), attributes exclusive and reverse. Its gradient is the CumSum of dy in the other
//! direction with the same exclusivity.

use super::util::{const_ints, input, norm_axis};
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::{Attr, Node};
use crate::tensor::DType;

/// The normalised axis of a CumSum node from its (constant) axis input.
pub fn cumsum_axis(node: &Node, axis: &Option<InferIn>, rank: usize) -> Result<usize> {
    let a = const_ints(node, axis, "axis")?;
    if a.len() != 1 {
        return Err(node.err(format!("axis must be a scalar, got {a:?}")));
    }
    norm_axis(node, a[0], rank)
}

struct CumSum;
impl OpDef for CumSum {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        // 16-bit floats sum in f32 (the CPU runs them widened, CUDA's kernel accumulates in f32),
        // each running sum rounded once, as PyTorch's cumsum of a half tensor does
        if !matches!(x.dtype, DType::F32 | DType::F64 | DType::I64 | DType::I32 | DType::BF16 | DType::F16) {
            return Err(node.err(format!("element type {} is not supported", x.dtype.name())));
        }
        cumsum_axis(node, inputs.get(1).unwrap_or(&None), x.shape.len())?;
        Ok(vec![TypeOut::like(x)])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let axis = g.x(1)?;
            let mut attrs = node.attrs.clone();
            attrs.0.retain(|(k, _)| k == "exclusive");
            attrs.set("reverse", Attr::Int(if node.attrs.int("reverse", 0)? != 0 { 0 } else { 1 }));
            let d = g.op("CumSum", &[dy, axis], attrs);
            g.set(0, d);
            Ok(())
        })
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[1]
    }
}

pub fn register(r: &mut Registry) {
    r.add("CumSum", CumSum);
}
