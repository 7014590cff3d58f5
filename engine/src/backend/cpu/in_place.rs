//! The one kernel that writes memory it also reads: `Mul(u, s)` with a scalar `s`, planned so
//! that `u` already lives in the output's memory (plan/mod.rs: a gradient bound from the forward
//! phase on, e.g. LinearCrossEntropy's unit-seed dW written straight into the weight's gradient
//! buffer and scaled by the loss seed in the backward phase). It reads only the scalar input and
//! scales the output in place; it never views input `u`, so no shared and exclusive views of the
//! same bytes exist at once.

use super::elementwise::FloatElem;
use super::tensor_view::{In, Out};
use super::CpuCtx;
use crate::error::Result;
use crate::ir::Node;

/// out *= s.
fn scale<T: FloatElem + super::tensor_view::Elem>(node: &Node, s: &In, out: &mut Out) -> Result<()> {
    let s = *s.slice::<T>()?.first().ok_or_else(|| node.err("the scale factor is empty"))?;
    if s != T::one() {
        out.slice::<T>()?.iter_mut().for_each(|v| *v = *v * s);
    }
    Ok(())
}

/// Kernel for a `Mul(u, s)` step whose operand `u` (input 0) is stored in its output's memory
/// and `s` (input 1) is a scalar.
pub fn mul_scalar_in_place(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let scalar = inputs.get(1).and_then(|x| x.as_ref()).filter(|x| x.numel() == 1);
    let scalar = scalar.ok_or_else(|| node.err("in-place Mul without a scalar second operand"))?;
    let o = &mut out[0];
    match o.dtype {
        crate::tensor::DType::F32 => scale::<f32>(node, scalar, o),
        crate::tensor::DType::F64 => scale::<f64>(node, scalar, o),
        d => Err(node.err(format!("in-place Mul of {} is not supported", d.name()))),
    }
}
