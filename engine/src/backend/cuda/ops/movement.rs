//! Data movement: Transpose (copy_W with permuted source strides) and the view ops when the
//! plan could not alias them (a device-to-device copy on the stream).

use cudarc::driver::result;

use super::strides::{contiguous, make};
use super::{input, CudaCtx, CudaTable, DView};
use crate::backend::cuda::launch::KArg;
use crate::error::{Error, Result};
use crate::ir::Node;

/// The copy kernel for an element size.
pub(super) fn width(size: usize) -> &'static str {
    match size {
        1 => "u8",
        2 => "u16",
        4 => "u32",
        _ => "u64",
    }
}

fn transpose(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let o = &outs[0];
    let n = o.numel();
    if n == 0 {
        return Ok(());
    }
    let perm = crate::ops::movement_perm(node, x.shape.len())?;
    let xs = contiguous(x.shape);
    // output dim d reads input dim perm[d]
    let src: Vec<i64> = perm.iter().map(|&p| xs[p]).collect();
    let s = make(o.shape, &[src, contiguous(o.shape)], &[])?;
    let kernel = format!("copy_{}", width(x.dtype.size()));
    ctx.rt.launch(ctx.stream, &kernel, ctx.rt.elementwise_grid(n), &[KArg::Ptr(x.ptr), KArg::Ptr(o.ptr), KArg::Strides(s), KArg::I64(n as i64)])
}

/// A view op the plan kept as a step: the same bytes, copied.
pub(super) fn view_copy(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let bytes = x.numel() * x.dtype.size();
    if bytes == 0 || x.ptr == outs[0].ptr {
        return Ok(());
    }
    // SAFETY: both addresses hold `bytes` bytes of planned device memory (input and output of
    // a view have the same size) and do not overlap (distinct live values).
    unsafe { result::memcpy_dtod_async(outs[0].ptr, x.ptr, bytes, ctx.stream) }.map_err(|e| Error::Cuda(format!("copy: {e}")))
}

pub fn register(t: &mut CudaTable) {
    t.add("Transpose", transpose);
    for op in ["Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "FlattenRows"] {
        t.add(op, view_copy);
    }
}
