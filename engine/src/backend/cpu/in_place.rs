//! The kernels that write memory they also read, planned by plan/in_place.rs: `Mul(u, s)` with a
//! scalar `s` where `u` already lives in the output's memory (a gradient bound from the forward
//! phase on, e.g. LinearCrossEntropy's unit-seed dW written straight into the weight's gradient
//! buffer and scaled by the loss seed in the backward phase), `Add(m, b)` where `m` lives in the
//! output's memory (a weight read twice: its two gradients summed), and, where `b` is a
//! GatherGrad living there too, that GatherGrad adding its rows to what the memory holds (then
//! the Add has nothing left to do). Each reads only its other inputs and updates the output in
//! place; none views an operand stored in its output, so no shared and exclusive views of the
//! same bytes exist at once.

use rayon::prelude::*;

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

/// Elements per parallel chunk of the in-place Add (64 KiB of f32).
const ADD_CHUNK: usize = 16 * 1024;

/// out += b, elementwise (same shape).
fn add_into<T: FloatElem + super::tensor_view::Elem + Send + Sync>(node: &Node, b: &In, out: &mut Out) -> Result<()> {
    let b = b.slice::<T>()?;
    let o = out.slice::<T>()?;
    if b.len() != o.len() {
        return Err(node.err(format!("in-place Add of {} elements into {}", b.len(), o.len())));
    }
    o.par_chunks_mut(ADD_CHUNK).zip(b.par_chunks(ADD_CHUNK)).for_each(|(o, b)| {
        for (x, &y) in o.iter_mut().zip(b) {
            *x = *x + y;
        }
    });
    Ok(())
}

fn add_in_place(node: &Node, inputs: &[Option<In>], out: &mut [Out], other: usize) -> Result<()> {
    let b = inputs.get(other).and_then(|x| x.as_ref()).ok_or_else(|| node.err("in-place Add without its second operand"))?;
    let o = &mut out[0];
    match o.dtype {
        crate::tensor::DType::F32 => add_into::<f32>(node, b, o),
        crate::tensor::DType::F64 => add_into::<f64>(node, b, o),
        d => Err(node.err(format!("in-place Add of {} is not supported", d.name()))),
    }
}

/// Kernel for an `Add(m, b)` step whose first operand is stored in its output's memory.
pub fn add_in_place_first(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    add_in_place(node, inputs, out, 1)
}

/// Kernel for an `Add(b, m)` step whose second operand is stored in its output's memory.
pub fn add_in_place_second(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    add_in_place(node, inputs, out, 0)
}

/// Kernel for a GatherGrad step whose output memory already holds the other gradient term: the
/// rows are added to it instead of to zeros.
pub fn gather_grad_accumulate(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    super::movement::gather_grad_into(node, inputs, out, false)
}

/// Kernel for an Add step whose operands and output share one memory that already holds the sum.
pub fn sum_already_in_place(_: &Node, _: &[Option<In>], _: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    Ok(())
}
