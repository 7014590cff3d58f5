//! CPU kernels of ops/shape_ops.rs.

use super::elementwise::first;
use super::tensor_view::{In, Out};
use super::{CpuCtx, KernelTable};
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::{DType, Tensor};

fn shape(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let (s, e) = crate::ops::shape_range(node, x.shape.len())?;
    let o = out[0].slice::<i64>()?;
    for (v, &d) in o.iter_mut().zip(&x.shape[s..e]) {
        *v = d as i64;
    }
    Ok(())
}

fn size(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    out[0].slice::<i64>()?[0] = first(node, inputs)?.numel() as i64;
    Ok(())
}

fn constant_of_shape(node: &Node, _: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let value = node.attrs.tensor("value").cloned().unwrap_or_else(|| Tensor::scalar_f32(0.0));
    let o = &mut out[0];
    let es = o.dtype.size();
    let one = value.as_bytes().get(..es).ok_or_else(|| node.err("value must hold one element"))?.to_vec();
    for chunk in o.bytes().chunks_mut(es) {
        chunk.copy_from_slice(&one);
    }
    Ok(())
}

fn range(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let v = |i: usize| -> Result<f64> {
        Ok(inputs.get(i).and_then(|x| x.as_ref()).ok_or_else(|| node.err("missing input"))?.to_tensor().to_f64_vec()[0])
    };
    let (start, delta) = (v(0)?, v(2)?);
    let o = &mut out[0];
    match o.dtype {
        DType::F32 => o.slice::<f32>()?.iter_mut().enumerate().for_each(|(i, x)| *x = (start + i as f64 * delta) as f32),
        DType::F64 => o.slice::<f64>()?.iter_mut().enumerate().for_each(|(i, x)| *x = start + i as f64 * delta),
        DType::I64 => o.slice::<i64>()?.iter_mut().enumerate().for_each(|(i, x)| *x = start as i64 + i as i64 * delta as i64),
        DType::I32 => o.slice::<i32>()?.iter_mut().enumerate().for_each(|(i, x)| *x = start as i32 + i as i32 * delta as i32),
        d => return Err(node.err(format!("Range of {} is not supported", d.name()))),
    }
    Ok(())
}

pub fn register(t: &mut KernelTable) {
    t.add("Shape", shape);
    t.add("Size", size);
    t.add("ConstantOfShape", constant_of_shape);
    t.add("Range", range);
}
