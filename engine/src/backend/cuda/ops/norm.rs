//! LayerNormalization and LayerNormGrad (kernels/layernorm.cu). The gradient op reads the row
//! statistics the forward kernel saved (passes/layer_norm_stats.rs) or else recomputes them
//! (layer_norm_stats into scratch), then dx per row, the same kernel summing the parameter
//! gradients' per-block column partials from the dy and x it loaded, and a deterministic
//! reduction of those partials. A LayerNormalization with a
//! 16-bit `y_type` (passes/layer_norm_half.rs) runs the mixed kernels: f32 x, 16-bit y and dy.
//! A LayerNormGrad given the residual stream's gradient or asked for a 16-bit dx
//! (passes/layer_norm_grad_sum.rs) runs the accumulating dx kernel; one asked for dx's column
//! sums (passes/layer_norm_grad_col_sum.rs) has them summed as a third row of partials.

use super::softmax::row_grid;
use super::{float_suffix, input, same_type, CudaCtx, CudaTable, DView};
use crate::backend::cuda::launch::{Grid, KArg};
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::DType;

/// Rows up to this long go one warp per row (kernels/layernorm.cu LN_WARP_MAX): 8 rows to a block
/// of 256 threads; longer rows one block of 256 threads each (the kernels hold a warp's row in
/// registers, 80-odd a thread: a block of 1024 would not fit the register file).
const WARP_ROW_MAX: usize = 1024;

/// The launch of the forward, statistics and dx kernels for `rows` rows of `n`.
pub(super) fn rows_grid(rows: usize, n: usize) -> Grid {
    if n <= WARP_ROW_MAX {
        Grid::new(rows.div_ceil(8).clamp(1, 65535 * 32) as u32, 256)
    } else {
        row_grid(rows, 256)
    }
}

/// Bytes of the statistics type A (f32, f64 for f64).
pub(super) fn stat_size(d: DType) -> usize {
    if d == DType::F64 {
        8
    } else {
        4
    }
}

/// The dx kernel's launch when it also sums the parameter gradients' partials (one row of
/// partials a block): rows up to WARP_ROW_MAX 4 rows to a block of 128 threads, each warp's
/// column sums in shared memory (4 * parts * n statistics), at most 3 blocks an SM (at the kernels'
/// 151-168 registers, 12 warps an SM fit: sm_90, NVRTC 13.0); longer rows one block of 256 per
/// row, at most 2 an SM. Fewer blocks mean fewer partials for the reduction to add.
pub(super) fn partial_grid(rows: usize, n: usize, parts: usize, stat: usize, sms: u32) -> Grid {
    let sms = sms.max(1) as usize;
    if n <= WARP_ROW_MAX {
        let blocks = rows.div_ceil(4).clamp(1, 3 * sms) as u32;
        Grid { blocks, threads: 128, shared: (4 * parts * n * stat) as u32 }
    } else {
        Grid::new(rows.clamp(1, 2 * sms) as u32, 256)
    }
}

/// The reduction of `partial_grid`'s partials: a block of 32 columns x 32 chunk lanes per 32
/// columns (the partials number a few hundred: each thread adds about a tenth of them).
pub(super) fn reduce_grid(n: usize) -> Grid {
    Grid::new(n.div_ceil(32).clamp(1, 65535) as u32, 1024)
}

pub(super) fn align(v: usize) -> usize {
    v.div_ceil(256) * 256
}

/// The kernel suffix for x of type `x` and y (or dy: `what`) of type `io`: `f32`, ..., or
/// `f32_y_bf16` / `f32_dy_f16` for f32 x and 16-bit y or dy.
fn io_suffix(node: &Node, x: DType, io: DType, what: &str) -> Result<String> {
    match (x, io) {
        (x, io) if x == io => Ok(float_suffix(node, x)?.to_string()),
        (DType::F32, io) if io.is_half() => Ok(format!("f32_{what}_{}", float_suffix(node, io)?)),
        _ => Err(node.err(format!(
            "{what} is {} and x {}: the kernels take {what} of x's type, or 16-bit {what} with f32 x",
            io.name(),
            x.name()
        ))),
    }
}

/// LayerNormalization(X, Scale, B?) -> (Y, Mean?, InvStdDev?).
fn layer_norm(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (x, scale) = (input(node, ins, 0)?, input(node, ins, 1)?);
    same_type(node, x, &[("scale", Some(scale)), ("bias", ins.get(2).and_then(|b| b.as_ref()))])?;
    let bias = ins.get(2).and_then(|b| b.as_ref()).map_or(0, |b| b.ptr);
    let (rows, n) = crate::ops::layer_norm_layout_of(node, x.shape)?;
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let eps = node.attrs.float("epsilon", 1e-5)?;
    let mean = outs.get(1).map_or(0, |o| o.ptr);
    let rstd = outs.get(2).map_or(0, |o| o.ptr);
    let kernel = format!("layer_norm_{}", io_suffix(node, x.dtype, outs[0].dtype, "y")?);
    let p = KArg::Ptr;
    ctx.rt.launch(
        ctx.stream,
        &kernel,
        rows_grid(rows, n),
        &[p(x.ptr), p(scale.ptr), p(bias), p(outs[0].ptr), p(mean), p(rstd), KArg::I64(rows as i64), KArg::I64(n as i64), KArg::F32(eps)],
    )
}

/// The forward's saved Mean and InvStdDev (LayerNormGrad's inputs 3 and 4): one statistic a
/// row, in the statistics type of `x`; None where the gradient recomputes them.
fn saved_stats(node: &Node, ins: &[Option<DView>], x: &DView, rows: usize) -> Result<Option<(u64, u64)>> {
    let stat = if x.dtype == DType::F64 { DType::F64 } else { DType::F32 };
    let fits = |v: &DView| v.dtype == stat && v.shape.iter().product::<usize>() == rows;
    match (ins.get(3).and_then(|v| v.as_ref()), ins.get(4).and_then(|v| v.as_ref())) {
        (None, None) => Ok(None),
        (Some(m), Some(r)) if fits(m) && fits(r) => Ok(Some((m.ptr, r.ptr))),
        _ => Err(node.err(format!("the saved mean and inverse std-dev must both be {rows} {} values, one a row", stat.name()))),
    }
}

/// `layer_norm_grad_acc_f32_dy_D_H`, the dx kernel that adds `dres` and writes the 16-bit copy
/// `dx_half` (either may be absent; H is then either type): f32 x only.
fn accumulating_kernel(node: &Node, x: &DView, dy: &DView, dres: Option<&DView>, dx_half: Option<&DView>) -> Result<String> {
    if x.dtype != DType::F32 || dres.is_some_and(|r| r.dtype != DType::F32 || r.shape != x.shape) {
        return Err(node.err(format!(
            "a LayerNormGrad summing the residual gradient takes f32 x and an f32 residual gradient of x's shape, got x {} {:?}",
            x.dtype.name(),
            x.shape
        )));
    }
    let half = match dx_half.map(|v| v.dtype) {
        None => DType::BF16,
        Some(h) if h.is_half() => h,
        Some(other) => return Err(node.err(format!("dx's 16-bit copy is {}, not bf16 or f16", other.name()))),
    };
    Ok(format!("layer_norm_grad_acc_f32_dy_{}_{}", float_suffix(node, dy.dtype)?, float_suffix(node, half)?))
}

/// LayerNormGrad(dy, x, scale, mean?, inv_std_dev?, dres?) -> (dx, dscale, dbias, dx_half?,
/// dx_col_sum?).
fn layer_norm_grad(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (dy, x, scale) = (input(node, ins, 0)?, input(node, ins, 1)?, input(node, ins, 2)?);
    same_type(node, x, &[("scale", Some(scale))])?;
    let (rows, n) = crate::ops::layer_norm_layout_of(node, x.shape)?;
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let eps = node.attrs.float("epsilon", 1e-5)?;
    let sfx = float_suffix(node, x.dtype)?;
    // the dx kernel reads dy (16-bit beside f32 x after layer_norm_half)
    let dy_sfx = io_suffix(node, x.dtype, dy.dtype, "dy")?;
    let a = stat_size(x.dtype);
    let saved = saved_stats(node, ins, x, rows)?;
    let (half_at, col_sum_at) = crate::ops::layer_norm_grad_extras_of(node)?;
    let dscale = outs.get(1).map_or(0, |o| o.ptr);
    let dbias = outs.get(2).map_or(0, |o| o.ptr);
    let dsum = col_sum_at.and_then(|k| outs.get(k)).map_or(0, |o| o.ptr);
    let with_params = dscale != 0 || dbias != 0 || dsum != 0;
    let parts = if dsum != 0 { 3 } else { 2 };
    let grid = if with_params { partial_grid(rows, n, parts, a, ctx.rt.sms) } else { rows_grid(rows, n) };
    let stats_bytes = if saved.is_some() { 0 } else { align(rows * a) };
    let partial_bytes = if with_params { grid.blocks as usize * parts * n * a } else { 0 };
    let base = ctx.rt.scratch(2 * stats_bytes + align(partial_bytes))?;
    let partial = if with_params { base + 2 * stats_bytes as u64 } else { 0 };
    let (p, i) = (KArg::Ptr, |v: usize| KArg::I64(v as i64));
    let (mean, rstd) = match saved {
        Some(stats) => stats,
        None => {
            let (mean, rstd) = (base, base + stats_bytes as u64);
            let args = [p(x.ptr), p(mean), p(rstd), i(rows), i(n), KArg::F32(eps)];
            ctx.rt.launch(ctx.stream, &format!("layer_norm_stats_{sfx}"), rows_grid(rows, n), &args)?;
            (mean, rstd)
        }
    };
    let dres = ins.get(5).and_then(|v| v.as_ref());
    let dx_half = half_at.and_then(|k| outs.get(k));
    if dres.is_some() || dx_half.is_some() {
        // passes/layer_norm_grad_sum.rs: the residual gradient summed in, a 16-bit copy written
        let kernel = accumulating_kernel(node, x, dy, dres, dx_half)?;
        let (dres, dxh) = (dres.map_or(0, |v| v.ptr), dx_half.map_or(0, |v| v.ptr));
        let args =
            [p(dy.ptr), p(x.ptr), p(scale.ptr), p(mean), p(rstd), p(dres), p(outs[0].ptr), p(dxh), p(partial), i(parts), i(rows), i(n)];
        ctx.rt.launch(ctx.stream, &kernel, grid, &args)?;
    } else {
        ctx.rt.launch(
            ctx.stream,
            &format!("layer_norm_grad_{dy_sfx}"),
            grid,
            &[p(dy.ptr), p(x.ptr), p(scale.ptr), p(mean), p(rstd), p(outs[0].ptr), p(partial), i(parts), i(rows), i(n)],
        )?;
    }
    if !with_params {
        return Ok(());
    }
    ctx.rt.launch(
        ctx.stream,
        &format!("layer_norm_grad_params_reduce_{sfx}"),
        reduce_grid(n),
        &[p(partial), p(dscale), p(dbias), p(dsum), i(parts), i(grid.blocks as usize), i(n)],
    )
}

pub fn register(t: &mut CudaTable) {
    t.add("LayerNormalization", layer_norm);
    t.add("LayerNormGrad", layer_norm_grad);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-2's LayerNormGrad on an H200 (132 SMs): 16 x 1024 rows of 768 take 396 blocks of 4
    /// warps (3 an SM), 24 KiB of shared memory each (4 warps x 2 x 768 f32 sums, 36 KiB with
    /// dx's column sums); short inputs take a block per 4 rows; f64 sums take twice the memory;
    /// rows over 1024 a block per row, 2 an SM, no shared memory. The reduction: 24 blocks of 32
    /// columns x 32 chunk lanes.
    #[test]
    fn the_partial_summing_launch_fills_the_gpu_with_few_blocks() {
        let g = partial_grid(16 * 1024, 768, 2, 4, 132);
        assert_eq!((g.blocks, g.threads, g.shared), (396, 128, 24576));
        assert_eq!(partial_grid(16 * 1024, 768, 3, 4, 132).shared, 36864, "with dx's column sums");
        assert_eq!(partial_grid(37, 768, 2, 4, 132).blocks, 10);
        assert_eq!(partial_grid(1, 1024, 2, 8, 132).shared, 65536);
        let long = partial_grid(16 * 1024, 4096, 3, 4, 132);
        assert_eq!((long.blocks, long.threads, long.shared), (264, 256, 0));
        assert_eq!(partial_grid(3, 4096, 2, 4, 132).blocks, 3);
        let r = reduce_grid(768);
        assert_eq!((r.blocks, r.threads, r.shared), (24, 1024, 0));
        assert_eq!(reduce_grid(1).blocks, 1);
    }
}
