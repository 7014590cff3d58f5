//! MaxPool, AveragePool and GlobalAveragePool with their gradients (kernels/pool.cu and the
//! reductions of reduce.rs), with the CPU kernels' semantics (backend/cpu/pool.rs): the first
//! maximum of a window wins (a NaN over a number), Indices are flat offsets into X, an
//! average's divisor counts the taps inside the input (or the padded input with
//! count_include_pad). MaxPoolGrad scatters with float atomics (f32, f64); a saved index outside
//! its (n, c) plane is dropped and sets the step's error flag.

use super::{float_suffix, input, widen, CudaCtx, CudaTable, DView};
use crate::backend::cuda::abi::Win2d;
use crate::backend::cuda::launch::KArg;
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::DType;

fn window(node: &Node, x: &[usize]) -> Result<Win2d> {
    let w = crate::ops::pool_geometry_of(node, x)?;
    Ok(Win2d::new(&w, x[1]))
}

fn count_include_pad(node: &Node) -> Result<KArg> {
    Ok(KArg::I32((node.attrs.int("count_include_pad", 0)? != 0) as i32))
}

/// Elements per (n, c) plane of an [N, C, ...] shape.
fn plane(shape: &[usize]) -> usize {
    shape.get(2..).map_or(1, |s| s.iter().product())
}

fn max_pool(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let win = window(node, x.shape)?;
    let y = &outs[0];
    let idx = outs.get(1).map_or(0, |o| o.ptr);
    let n = y.numel();
    if n == 0 {
        return Ok(());
    }
    let kernel = format!("max_pool_{}", float_suffix(node, x.dtype)?);
    let args = [KArg::Ptr(x.ptr), KArg::Ptr(y.ptr), KArg::Ptr(idx), KArg::Win2d(win), KArg::I64(n as i64)];
    ctx.rt.launch(ctx.stream, &kernel, ctx.rt.elementwise_grid(n), &args)
}

/// MaxPoolGrad(dy, indices, x_shape): dy added at the saved indices of zeros shaped like x.
fn max_pool_grad(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (dy, idx) = (input(node, ins, 0)?, input(node, ins, 1)?);
    if dy.dtype.is_half() {
        // float atomics: the scatter kernels exist for f32 and f64 only
        return widen::widened(node, ins, outs, ctx, max_pool_grad);
    }
    if idx.dtype != DType::I64 {
        return Err(node.err(format!("the indices must be int64, got {}", idx.dtype.name())));
    }
    let dx = &outs[0];
    let kernel = format!("max_pool_grad_{}", float_suffix(node, dy.dtype)?);
    super::movement::zero(ctx, dx)?;
    let (n, out_plane, in_plane) = (dy.numel(), plane(dy.shape), plane(dx.shape));
    if n == 0 || out_plane == 0 {
        return Ok(());
    }
    let i = |v: usize| KArg::I64(v as i64);
    let args = [KArg::Ptr(dy.ptr), KArg::Ptr(idx.ptr), KArg::Ptr(dx.ptr), i(n), i(out_plane), i(in_plane), KArg::Ptr(ctx.error_flag)];
    ctx.rt.launch(ctx.stream, &kernel, ctx.rt.elementwise_grid(n), &args)
}

/// avg_pool_T (src x, dst y) or avg_pool_grad_T (src dy, dst dx) over `dst`'s elements, the window
/// read from the input shape `x_shape`.
fn average(node: &Node, ctx: &mut CudaCtx, stem: &str, src: &DView, dst: &DView, x_shape: &[usize]) -> Result<()> {
    let win = window(node, x_shape)?;
    let n = dst.numel();
    if n == 0 {
        return Ok(());
    }
    let kernel = format!("{stem}_{}", float_suffix(node, src.dtype)?);
    let args = [KArg::Ptr(src.ptr), KArg::Ptr(dst.ptr), KArg::Win2d(win), KArg::I64(n as i64), count_include_pad(node)?];
    ctx.rt.launch(ctx.stream, &kernel, ctx.rt.elementwise_grid(n), &args)
}

fn average_pool(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    average(node, ctx, "avg_pool", x, &outs[0], x.shape)
}

/// AveragePoolGrad(dy, x_shape).
fn average_pool_grad(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let dy = input(node, ins, 0)?;
    average(node, ctx, "avg_pool_grad", dy, &outs[0], outs[0].shape)
}

/// GlobalAveragePool: the mean over every axis after the first two.
fn global_average_pool(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let y = &outs[0];
    if y.numel() == 0 {
        return Ok(());
    }
    let reduced: Vec<bool> = (0..x.shape.len()).map(|d| d >= 2).collect();
    if x.numel() > 0 && !super::reduce::reduces_anything(x.shape, &reduced) {
        return super::movement::view_copy(node, ins, outs, ctx);
    }
    super::reduce::sum_over(node, ctx, x, y.ptr, &reduced, 1.0 / plane(x.shape).max(1) as f64)
}

/// GlobalAveragePoolGrad(dy, x_shape): dy spread evenly over each plane.
fn global_average_pool_grad(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let dy = input(node, ins, 0)?;
    let dx = &outs[0];
    let keep: Vec<usize> = dx.shape.iter().enumerate().map(|(d, &n)| if d < 2 { n } else { 1 }).collect();
    super::reduce::broadcast_scaled(node, ctx, dy, &keep, dx, 1.0 / plane(dx.shape).max(1) as f64)
}

pub fn register(t: &mut CudaTable) {
    t.add("MaxPool", max_pool);
    t.add("MaxPoolGrad", max_pool_grad);
    t.add("AveragePool", average_pool);
    t.add("AveragePoolGrad", average_pool_grad);
    t.add("GlobalAveragePool", global_average_pool);
    t.add("GlobalAveragePoolGrad", global_average_pool_grad);
}
