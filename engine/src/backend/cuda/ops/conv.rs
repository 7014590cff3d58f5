//! Conv and its gradients ConvGradX, ConvGradW, ConvGradB (1-D and 2-D windows, groups) on the
//! GPU, with the CPU kernels' semantics (backend/cpu/conv.rs): im2col/col2im (kernels/conv.cu)
//! around strided-batched cuBLAS products, in chunks of samples whose column matrix fits
//! `COL_BUDGET` bytes of the runtime's scratch memory. conv_plan.rs says which launches and
//! products each op makes (and tests them on the host); this file gathers the operands and
//! queues them. The products follow the session's f32 mode (exact, TF32, bf16, fp16) as MatMul
//! does. ConvGradB is dy summed over every axis but 1 (the reductions of reduce.rs).

use super::conv_plan::{calls, Call, Geo, Kind, COL_BUDGET};
use super::matmul::gemm_type;
use super::{float_suffix, input, CudaCtx, CudaTable, DView};
use crate::backend::cuda::launch::KArg;
use crate::error::Result;
use crate::ir::Node;

/// Queues `kind`'s operation list: `ops` as `conv_plan::calls` takes them, `x`/`w` the shapes
/// the geometry is read from, `d` the float type, `out` the output (its size checked first).
fn dispatch(node: &Node, ctx: &mut CudaCtx, kind: Kind, d: &DView, (x, w): (&[usize], &[usize]), ops: &[u64], out: &DView) -> Result<()> {
    let (t, sfx) = (gemm_type(node, d.dtype)?, float_suffix(node, d.dtype)?);
    let g = Geo::new(node, x, w)?;
    if out.numel() == 0 {
        return Ok(());
    }
    if g.n == 0 || (kind != Kind::Forward && g.mg == 0) {
        return super::movement::zero(ctx, out);
    }
    let (per, scratch_elems) = g.chunking(kind, t.size(), COL_BUDGET);
    let scratch = if scratch_elems == 0 { 0 } else { ctx.rt.scratch(scratch_elems * t.size())? };
    let ones = ctx.rt.ones(ctx.stream, t, per.max(g.ohw))?;
    for call in calls(&g, kind, t, ctx.f32_mode, per, ops, scratch, ones) {
        match call {
            Call::Rearrange { im2col, src, dst, n } => {
                let kernel = format!("{}_{sfx}", if im2col { "im2col" } else { "col2im" });
                let args = [KArg::Ptr(src), KArg::Ptr(dst), KArg::Win2d(g.win), KArg::I64(n as i64)];
                ctx.rt.launch(ctx.stream, &kernel, ctx.rt.elementwise_grid(n), &args)?;
            }
            Call::Gemm { g, a, b, c } => ctx.rt.gemm(ctx.stream, &g, a, b, c)?,
        }
    }
    Ok(())
}

fn conv(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (x, w) = (input(node, ins, 0)?, input(node, ins, 1)?);
    let bias = ins.get(2).and_then(|v| v.as_ref()).map_or(0, |b| b.ptr);
    dispatch(node, ctx, Kind::Forward, x, (x.shape, w.shape), &[x.ptr, w.ptr, bias, outs[0].ptr], &outs[0])
}

/// ConvGradX(dy, w, x_shape).
fn conv_grad_x(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (dy, w) = (input(node, ins, 0)?, input(node, ins, 1)?);
    dispatch(node, ctx, Kind::GradX, dy, (outs[0].shape, w.shape), &[dy.ptr, w.ptr, outs[0].ptr], &outs[0])
}

/// ConvGradW(dy, x, w_shape).
fn conv_grad_w(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (dy, x) = (input(node, ins, 0)?, input(node, ins, 1)?);
    dispatch(node, ctx, Kind::GradW, dy, (x.shape, outs[0].shape), &[dy.ptr, x.ptr, outs[0].ptr], &outs[0])
}

/// ConvGradB(dy): dy summed over every axis but the channel axis 1.
fn conv_grad_b(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let dy = input(node, ins, 0)?;
    let o = &outs[0];
    if o.numel() == 0 {
        return Ok(());
    }
    let reduced: Vec<bool> = (0..dy.shape.len()).map(|d| d != 1).collect();
    if dy.numel() > 0 && !super::reduce::reduces_anything(dy.shape, &reduced) {
        return super::movement::view_copy(node, ins, outs, ctx);
    }
    super::reduce::sum_over(node, ctx, dy, o.ptr, &reduced, 1.0)
}

pub fn register(t: &mut CudaTable) {
    t.add("Conv", conv);
    t.add("ConvGradX", conv_grad_x);
    t.add("ConvGradW", conv_grad_w);
    t.add("ConvGradB", conv_grad_b);
}
