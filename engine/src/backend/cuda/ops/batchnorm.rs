//! BatchNormalization and BatchNormGrad (kernels/batchnorm.cu) with the CPU kernels' semantics
//! (backend/cpu/batchnorm.rs): per-channel statistics in f64 (the batch's in training mode,
//! the running ones otherwise) kept in the runtime's scratch memory, then one element-wise pass
//! that also writes the optional running mean and variance outputs (PyTorch's unbiased running
//! variance with `unbiased_running_var`). The gradient recomputes the statistics from x.

use super::{float_suffix, input, CudaCtx, CudaTable, DView};
use crate::backend::cuda::launch::{Grid, KArg};
use crate::error::Result;
use crate::ir::Node;

/// (n, c, plane) of an [N, C, ...] input.
fn layout(node: &Node, x: &[usize]) -> Result<(usize, usize, usize)> {
    if x.len() < 2 {
        return Err(node.err(format!("input {x:?} must be [N, C, ...]")));
    }
    Ok((x[0], x[1], x[2..].iter().product()))
}

fn float_attr(node: &Node, name: &str, default: f32) -> Result<f64> {
    Ok(node.attrs.float(name, default)? as f64)
}

/// One block of 256 threads per channel (grid-stride beyond the grid's cap).
fn per_channel(c: usize) -> Grid {
    Grid::new(c.clamp(1, 65535 * 8) as u32, 256)
}

/// Queues batch_norm_stats_T into `stats` (2·c f64).
#[allow(clippy::too_many_arguments)]
fn stats(
    ctx: &mut CudaCtx,
    sfx: &str,
    x: &DView,
    mean: &DView,
    var: &DView,
    stats: u64,
    (n, c, plane): (usize, usize, usize),
    training: bool,
) -> Result<()> {
    let i = |v: usize| KArg::I64(v as i64);
    let args =
        [KArg::Ptr(x.ptr), KArg::Ptr(mean.ptr), KArg::Ptr(var.ptr), KArg::Ptr(stats), i(n), i(c), i(plane), KArg::I32(training as i32)];
    ctx.rt.launch(ctx.stream, &format!("batch_norm_stats_{sfx}"), per_channel(c), &args)
}

fn batch_norm(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let [scale, bias, mean, var] = [1, 2, 3, 4].map(|i| input(node, ins, i));
    let (scale, bias, mean, var) = (scale?, bias?, mean?, var?);
    let sfx = float_suffix(node, x.dtype)?;
    let eps = float_attr(node, "epsilon", 1e-5)?;
    let momentum = float_attr(node, "momentum", 0.9)?;
    let training = node.attrs.int("training_mode", 0)? != 0;
    let unbiased = node.attrs.int("unbiased_running_var", 0)? != 0;
    let dims @ (n, c, plane) = layout(node, x.shape)?;
    if c == 0 {
        return Ok(());
    }
    let st = ctx.rt.scratch(2 * c * 8)?;
    stats(ctx, sfx, x, mean, var, st, dims, training)?;
    let count = n * plane;
    let var_factor = if unbiased && count > 1 { count as f64 / (count - 1) as f64 } else { 1.0 };
    let out_ptr = |k: usize| outs.get(k).map_or(0, |o| o.ptr);
    let total = x.numel();
    let i = |v: usize| KArg::I64(v as i64);
    let args = [
        KArg::Ptr(x.ptr),
        KArg::Ptr(scale.ptr),
        KArg::Ptr(bias.ptr),
        KArg::Ptr(mean.ptr),
        KArg::Ptr(var.ptr),
        KArg::Ptr(st),
        KArg::Ptr(outs[0].ptr),
        KArg::Ptr(out_ptr(1)),
        KArg::Ptr(out_ptr(2)),
        i(total),
        i(c),
        i(plane),
        KArg::F64(eps),
        KArg::F64(momentum),
        KArg::F64(var_factor),
    ];
    ctx.rt.launch(ctx.stream, &format!("batch_norm_apply_{sfx}"), ctx.rt.elementwise_grid(total.max(c)), &args)
}

/// BatchNormGrad(dy, x, scale, input_mean, input_var) -> (dx, dscale, dbias).
fn batch_norm_grad(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let [dy, x, scale, mean, var] = [0, 1, 2, 3, 4].map(|i| input(node, ins, i));
    let (dy, x, scale, mean, var) = (dy?, x?, scale?, mean?, var?);
    let [dx, dscale, dbias] = outs else {
        return Err(node.err("expected 3 outputs (dx, dscale, dbias)"));
    };
    let sfx = float_suffix(node, dy.dtype)?;
    let eps = float_attr(node, "epsilon", 1e-5)?;
    let training = node.attrs.int("training_mode", 0)? != 0;
    let dims @ (n, c, plane) = layout(node, x.shape)?;
    if c == 0 {
        return Ok(());
    }
    let st = ctx.rt.scratch(4 * c * 8)?;
    let sums = st + (2 * c * 8) as u64;
    stats(ctx, sfx, x, mean, var, st, dims, training)?;
    let i = |v: usize| KArg::I64(v as i64);
    let args = [KArg::Ptr(dy.ptr), KArg::Ptr(x.ptr), KArg::Ptr(st), KArg::Ptr(sums), i(n), i(c), i(plane), KArg::F64(eps)];
    ctx.rt.launch(ctx.stream, &format!("batch_norm_grad_sums_{sfx}"), per_channel(c), &args)?;
    let total = x.numel();
    let args = [
        KArg::Ptr(dy.ptr),
        KArg::Ptr(x.ptr),
        KArg::Ptr(scale.ptr),
        KArg::Ptr(st),
        KArg::Ptr(sums),
        KArg::Ptr(dx.ptr),
        KArg::Ptr(dscale.ptr),
        KArg::Ptr(dbias.ptr),
        i(total),
        i(c),
        i(plane),
        KArg::F64(eps),
        KArg::I32(training as i32),
    ];
    ctx.rt.launch(ctx.stream, &format!("batch_norm_grad_{sfx}"), ctx.rt.elementwise_grid(total.max(c)), &args)
}

pub fn register(t: &mut CudaTable) {
    t.add("BatchNormalization", batch_norm);
    t.add("BatchNormGrad", batch_norm_grad);
}
