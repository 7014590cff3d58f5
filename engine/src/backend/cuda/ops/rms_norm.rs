//! RmsNorm and RmsNormGrad (kernels/rmsnorm.cu, made by passes/fuse_rms_norm.rs): layernorm.cu's
//! row kernels without the mean, on norm.rs's launches. The gradient reads the forward's 1/rms
//! per row; dscale, when the node asks for it (a trained scale), comes from the dx kernel's
//! per-block partial sums of dy·x·r reduced by layernorm.cu's deterministic reduction (one row
//! of partials).

use super::norm::{align, partial_grid, reduce_grid, rows_grid, stat_size};
use super::{float_suffix, input, same_type, CudaCtx, CudaTable, DView};
use crate::backend::cuda::launch::KArg;
use crate::error::Result;
use crate::ir::Node;
use crate::ops::{rms_norm_layout_of, rms_norm_stat_type as stat_type};

fn optional<'v, 'a>(ins: &'v [Option<DView<'a>>], i: usize) -> Option<&'v DView<'a>> {
    ins.get(i).and_then(|v| v.as_ref())
}

/// RmsNorm(X, scale?) -> (Y, InvRms).
fn rms_norm(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let scale = optional(ins, 1);
    same_type(node, x, &[("scale", scale), ("Y", outs.first())])?;
    let (rows, n) = rms_norm_layout_of(node, x.shape, scale.map(|s| s.shape))?;
    let [y, inv] = outs else { return Err(node.err("RmsNorm has two outputs, Y and InvRms")) };
    if inv.dtype != stat_type(x.dtype) || inv.shape.iter().product::<usize>() != rows {
        return Err(node.err(format!("InvRms is {} {:?}: one {} per row", inv.dtype.name(), inv.shape, stat_type(x.dtype).name())));
    }
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let eps = node.attrs.float("epsilon", 1e-6)?;
    let p = KArg::Ptr;
    let args = [p(x.ptr), p(scale.map_or(0, |s| s.ptr)), p(y.ptr), p(inv.ptr), KArg::I64(rows as i64), KArg::I64(n as i64), KArg::F32(eps)];
    ctx.rt.launch(ctx.stream, &format!("rms_norm_{}", float_suffix(node, x.dtype)?), rows_grid(rows, n), &args)
}

/// RmsNormGrad(dY, X, scale?, InvRms) -> (dX, dscale?).
fn rms_norm_grad(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (dy, x) = (input(node, ins, 0)?, input(node, ins, 1)?);
    let (scale, inv) = (optional(ins, 2), input(node, ins, 3)?);
    same_type(node, x, &[("dY", Some(dy)), ("scale", scale), ("dX", outs.first())])?;
    let (rows, n) = rms_norm_layout_of(node, x.shape, scale.map(|s| s.shape))?;
    if dy.shape != x.shape || inv.dtype != stat_type(x.dtype) || inv.shape.iter().product::<usize>() != rows {
        return Err(node.err(format!(
            "dY {:?} must be shaped as X {:?}, and InvRms ({} {:?}) one {} per row",
            dy.shape,
            x.shape,
            inv.dtype.name(),
            inv.shape,
            stat_type(x.dtype).name()
        )));
    }
    let dscale = match outs {
        [_] => None,
        [_, ds] if scale.is_some() => Some(ds),
        _ => return Err(node.err(format!("{} outputs: dX, and dscale only with a scale", outs.len()))),
    };
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let sfx = float_suffix(node, x.dtype)?;
    let a = stat_size(x.dtype);
    let grid = if dscale.is_some() { partial_grid(rows, n, 1, a, ctx.rt.sms) } else { rows_grid(rows, n) };
    let partial = match dscale {
        Some(_) => ctx.rt.scratch(align(grid.blocks as usize * n * a))?,
        None => 0,
    };
    let (p, i) = (KArg::Ptr, |v: usize| KArg::I64(v as i64));
    let args = [p(dy.ptr), p(x.ptr), p(scale.map_or(0, |s| s.ptr)), p(inv.ptr), p(outs[0].ptr), p(partial), i(rows), i(n)];
    ctx.rt.launch(ctx.stream, &format!("rms_norm_grad_{sfx}"), grid, &args)?;
    let Some(ds) = dscale else { return Ok(()) };
    ctx.rt.launch(
        ctx.stream,
        &format!("layer_norm_grad_params_reduce_{sfx}"),
        reduce_grid(n),
        &[p(partial), p(ds.ptr), p(0), p(0), i(1), i(grid.blocks as usize), i(n)],
    )
}

pub fn register(t: &mut CudaTable) {
    t.add("RmsNorm", rms_norm);
    t.add("RmsNormGrad", rms_norm_grad);
}
