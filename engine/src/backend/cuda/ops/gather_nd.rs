//! GatherND and its scatter-add gradient GatherNDGrad (kernels/gather.cu), with the layout of
//! `crate::ops::gather_nd` (batch_dims, index tuples of length k, slices copied whole). As for
//! Gather, an index out of range writes 0 (drops the gradient) and sets the step's error flag;
//! the gradient accumulates with float atomics (f32 and f64).

use super::gather::int64_indices;
use super::{float_suffix, input, widen, CudaCtx, CudaTable, DView};
use crate::backend::cuda::abi::{Strides, MAX_DIMS};
use crate::backend::cuda::launch::KArg;
use crate::error::Result;
use crate::ir::Node;
use crate::ops::gather_nd::GatherNdLayout;

/// The kernels' `Strides` for a layout: rank k and the k indexed dimensions.
fn tuple_dims(node: &Node, l: &GatherNdLayout) -> Result<Strides> {
    if l.k > MAX_DIMS {
        return Err(node.err(format!("index tuples of length {} exceed the CUDA kernels' {MAX_DIMS}", l.k)));
    }
    let mut s = Strides { rank: l.k as i32, ..Default::default() };
    for (d, &n) in l.dims.iter().enumerate() {
        s.dims[d] = n as i64;
    }
    Ok(s)
}

/// The arguments shared by gather_nd_W and gather_nd_grad_T: `n` elements moved between `src`
/// and `dst`.
fn args(node: &Node, src: u64, idx: u64, dst: u64, l: &GatherNdLayout, n: usize, flag: u64) -> Result<[KArg; 9]> {
    let i = |v: usize| KArg::I64(v as i64);
    Ok([
        KArg::Ptr(src),
        KArg::Ptr(idx),
        KArg::Ptr(dst),
        KArg::Strides(tuple_dims(node, l)?),
        i(n),
        i(l.slice),
        i(l.tuples.max(1)),
        i(l.batch_block),
        KArg::Ptr(flag),
    ])
}

fn gather_nd(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (x, idx) = (input(node, ins, 0)?, input(node, ins, 1)?);
    int64_indices(node, idx)?;
    let l = crate::ops::gather_nd_layout_of(node, x.shape, idx.shape)?;
    let n = outs[0].numel();
    if n == 0 || l.slice == 0 {
        return Ok(());
    }
    let kernel = format!("gather_nd_{}", super::movement::width(x.dtype.size()));
    let a = args(node, x.ptr, idx.ptr, outs[0].ptr, &l, n, ctx.error_flag)?;
    ctx.rt.launch(ctx.stream, &kernel, ctx.rt.elementwise_grid(n), &a)
}

/// GatherNDGrad(dy, indices, x_shape): dy's slices added into zeros shaped like x.
fn gather_nd_grad(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (dy, idx) = (input(node, ins, 0)?, input(node, ins, 1)?);
    if dy.dtype.is_half() {
        // float atomics: the scatter kernels exist for f32 and f64 only
        return widen::widened(node, ins, outs, ctx, gather_nd_grad);
    }
    int64_indices(node, idx)?;
    let o = &outs[0];
    let sfx = float_suffix(node, dy.dtype)?;
    let l = crate::ops::gather_nd_layout_of(node, o.shape, idx.shape)?;
    super::movement::zero(ctx, o)?;
    let n = dy.numel();
    if n == 0 || l.slice == 0 {
        return Ok(());
    }
    let a = args(node, dy.ptr, idx.ptr, o.ptr, &l, n, ctx.error_flag)?;
    ctx.rt.launch(ctx.stream, &format!("gather_nd_grad_{sfx}"), ctx.rt.elementwise_grid(n), &a)
}

pub fn register(t: &mut CudaTable) {
    t.add("GatherND", gather_nd);
    t.add("GatherNDGrad", gather_nd_grad);
}
