//! 16-bit tensors for kernels instantiated for f32 only (the SIMT attention kernels, the
//! tensor-core ones for fp16 or head sizes they lack, and the scatter-add gradients of
//! GatherElements, GatherND and MaxPool, whose float atomics exist for f32 and f64): the 16-bit operands are cast to f32
//! copies in the runtime's scratch, the kernel runs on those, and its 16-bit outputs are
//! rounded back from f32 copies, as the CPU's widen.rs does. Only for kernels that use no
//! scratch of their own and write their outputs whole.

use super::elementwise::cast_kernel;
use super::{CudaCtx, CudaKernel, DView};
use crate::backend::cuda::launch::KArg;
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::DType;

/// Scratch regions start at this alignment (the runtime's own).
const ALIGN: usize = 256;

/// Queues the conversion of n `from` elements at `src` into `to` elements at `dst`.
pub(super) fn cast(ctx: &CudaCtx, from: DType, to: DType, src: u64, dst: u64, n: usize) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    ctx.rt.launch(ctx.stream, &cast_kernel(from, to), ctx.rt.elementwise_grid(n), &[KArg::Ptr(src), KArg::Ptr(dst), KArg::I64(n as i64)])
}

/// Scratch bytes of a view's f32 copy, aligned.
fn f32_bytes(v: &DView) -> usize {
    (v.numel() * 4).div_ceil(ALIGN) * ALIGN
}

/// The f32 copy of `v` at scratch address `*next`, which moves past it.
fn region<'a>(next: &mut u64, v: &DView<'a>) -> DView<'a> {
    let at = *next;
    *next += f32_bytes(v) as u64;
    // no host copy: it would hold 16-bit values under an f32 label
    DView { dtype: DType::F32, ptr: at, host: None, ..*v }
}

/// Runs `kernel` with every 16-bit input and output widened to f32.
pub fn widened(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx, kernel: CudaKernel) -> Result<()> {
    let views = ins.iter().flatten().chain(outs.iter());
    let bytes: usize = views.filter(|v| v.dtype.is_half()).map(f32_bytes).sum();
    // empty 16-bit views are relabelled too (never read): the kernel must not see 16 bits again
    let mut next = if bytes == 0 { 0 } else { ctx.rt.scratch(bytes)? };
    let mut wide_ins = Vec::with_capacity(ins.len());
    for x in ins {
        wide_ins.push(match x {
            Some(x) if x.dtype.is_half() => {
                let w = region(&mut next, x);
                cast(ctx, x.dtype, DType::F32, x.ptr, w.ptr, x.numel())?;
                Some(w)
            }
            other => *other,
        });
    }
    let wide_outs: Vec<DView> = outs.iter().map(|o| if o.dtype.is_half() { region(&mut next, o) } else { *o }).collect();
    kernel(node, &wide_ins, &wide_outs, ctx)?;
    for (o, w) in outs.iter().zip(&wide_outs) {
        if o.dtype.is_half() {
            cast(ctx, DType::F32, o.dtype, w.ptr, o.ptr, o.numel())?;
        }
    }
    Ok(())
}
