//! Reductions (kernels/reduce.cu): SumRows ([M, N] → [N], the bias gradient), ReduceSumTo (a
//! broadcast gradient summed back to an operand's shape), the ONNX ReduceSum/Mean/Max/Min and
//! their gradient ReduceGrad. Sums whose reduced dimensions form one block before or after the
//! kept ones are a cuBLAS product with a ones vector; other sums, max and min use a block per
//! output when the innermost dimension is reduced, a thread per output otherwise.

use super::{float_suffix, input, CudaCtx, CudaTable, DView};
use crate::backend::cuda::abi::Reduce;
use crate::backend::cuda::blas::Gemm;
use crate::backend::cuda::launch::{Grid, KArg};
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::DType;

/// Sums of a contiguous [m, n] matrix as one cuBLAS product with a vector of ones: column sums
/// (`over_rows`: out[n] = 1ᵀ·X) or row sums (out[m] = X·1). The reduction kernels give one
/// thread (or block) per output, which starves the GPU when a bias gradient sums 16k rows into
/// 768 columns; a gemm uses every SM (and f32 accumulates like the kernels do).
#[allow(clippy::too_many_arguments)]
fn sum_by_gemm(
    node: &Node,
    ctx: &mut CudaCtx,
    x: &DView,
    out: (u64, DType),
    m: usize,
    n: usize,
    over_rows: bool,
    scale: f64,
) -> Result<()> {
    // 16-bit sums (autocast's bias gradients) too: 16-bit operands and result (or f32: a
    // ReduceSumTo with `to`), f32 accumulation
    let t = super::matmul::gemm_type(node, x.dtype)?;
    let ones = ctx.rt.ones(ctx.stream, t, if over_rows { m } else { n })?;
    let mut g = if over_rows { Gemm::contiguous(1, 1, n, m, false, false, t) } else { Gemm::contiguous(1, m, 1, n, false, false, t) };
    g.c_type = super::matmul::gemm_type(node, out.1)?;
    g.alpha = scale;
    let out = out.0;
    let (a, b) = if over_rows { (ones, x.ptr) } else { (x.ptr, ones) };
    ctx.rt.gemm(ctx.stream, &g, a, b, out)
}

fn sum_rows(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    column_sums(node, ctx, input(node, ins, 0)?, outs[0].ptr)
}

/// The sums of the rows of the contiguous [m, n] `x` (its n column sums) at `out`, of x's type.
pub(super) fn column_sums(node: &Node, ctx: &mut CudaCtx, x: &DView, out: u64) -> Result<()> {
    let (m, n) = (x.shape[0], x.shape[1]);
    if n == 0 {
        return Ok(());
    }
    if m > 0 && matches!(x.dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16) {
        return sum_by_gemm(node, ctx, x, (out, x.dtype), m, n, true, 1.0);
    }
    let mut l = Reduce { out_rank: 1, red_rank: 1, outputs: n as i64, count: m as i64, ..Default::default() };
    l.out_dims[0] = n as i64;
    l.out_stride[0] = 1;
    l.red_dims[0] = m as i64;
    l.red_stride[0] = n as i64;
    let kernel = format!("reduce_sum_thread_{}", float_suffix(node, x.dtype)?);
    let grid = Grid::new((n as u64).div_ceil(256).min(u32::MAX as u64) as u32, 256);
    ctx.rt.launch(ctx.stream, &kernel, grid, &[KArg::Ptr(x.ptr), KArg::Ptr(out), KArg::Reduce(l), KArg::F64(1.0)])
}

/// The `Reduce` layout of summing the dimensions of `shape` (contiguous) marked in `reduced`;
/// size-1 dimensions are dropped from both sides.
pub(super) fn layout(node: &Node, shape: &[usize], reduced: &[bool]) -> Result<Reduce> {
    let strides = super::strides::contiguous(shape);
    let mut l = Reduce { outputs: 1, count: 1, ..Default::default() };
    for (d, (&n, &r)) in shape.iter().zip(reduced).enumerate() {
        if n == 1 {
            continue;
        }
        let (rank, dims, st) =
            if r { (&mut l.red_rank, &mut l.red_dims, &mut l.red_stride) } else { (&mut l.out_rank, &mut l.out_dims, &mut l.out_stride) };
        if *rank as usize == crate::backend::cuda::abi::MAX_DIMS {
            return Err(node.err(format!("reducing {shape:?}: more than {} dimensions", crate::backend::cuda::abi::MAX_DIMS)));
        }
        dims[*rank as usize] = n as i64;
        st[*rank as usize] = strides[d];
        *rank += 1;
        if r {
            l.count *= n as i64;
        } else {
            l.outputs *= n as i64;
        }
    }
    Ok(l)
}

/// Launches a sum (`stem` "sum", or "max"/"min") of layout `l`, choosing the kernel by whether
/// the innermost input dimension is reduced.
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_reduce(
    node: &Node,
    ctx: &mut CudaCtx,
    stem: &str,
    x: &DView,
    y: u64,
    l: Reduce,
    inner_reduced: bool,
    scale: f64,
) -> Result<()> {
    let sfx = if stem == "sum" && x.dtype == DType::I64 { "i64" } else { float_suffix(node, x.dtype)? };
    if inner_reduced {
        let blocks = (l.outputs.max(1) as u64).min(65535 * 8) as u32;
        ctx.rt.launch(
            ctx.stream,
            &format!("reduce_{stem}_{sfx}"),
            Grid::new(blocks, 256),
            &[KArg::Ptr(x.ptr), KArg::Ptr(y), KArg::Reduce(l), KArg::F64(scale)],
        )
    } else {
        let grid = ctx.rt.elementwise_grid(l.outputs as usize);
        ctx.rt.launch(
            ctx.stream,
            &format!("reduce_{stem}_thread_{sfx}"),
            grid,
            &[KArg::Ptr(x.ptr), KArg::Ptr(y), KArg::Reduce(l), KArg::F64(scale)],
        )
    }
}

/// Sums of `x` (contiguous) over the dimensions marked in `reduced`, times `scale`, into the
/// contiguous kept dimensions at `out`. The usual shapes (reduced dimensions all before the kept
/// ones, as a bias gradient over rows, or all after them) are one [m, n] matrix summed by a
/// matrix product; the rest go to the reduction kernels.
pub(super) fn sum_over(node: &Node, ctx: &mut CudaCtx, x: &DView, out: u64, reduced: &[bool], scale: f64) -> Result<()> {
    sum_over_into(node, ctx, x, (out, x.dtype), reduced, scale)
}

/// `sum_over` into an output of type `out.1`: x's, or f32 over 16-bit x where the reduced and
/// kept dimensions form two blocks (a product with ones writes f32); else an error.
fn sum_over_into(node: &Node, ctx: &mut CudaCtx, x: &DView, out: (u64, DType), reduced: &[bool], scale: f64) -> Result<()> {
    let marks: Vec<bool> = reduced.iter().zip(x.shape).filter(|(_, &n)| n != 1).map(|(&r, _)| r).collect();
    let split = marks.iter().position(|&r| r != marks[0]).unwrap_or(marks.len());
    let two_blocks = !marks.is_empty() && marks[split..].iter().all(|&r| r != marks[0]);
    if two_blocks && x.numel() > 0 && matches!(x.dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16) {
        let size = |want: bool| x.shape.iter().zip(reduced).filter(|(_, &r)| r == want).map(|(&n, _)| n).product::<usize>();
        let (red, kept) = (size(true), size(false));
        return if marks[0] {
            sum_by_gemm(node, ctx, x, out, red, kept, true, scale)
        } else {
            sum_by_gemm(node, ctx, x, out, kept, red, false, scale)
        };
    }
    if out.1 != x.dtype {
        return Err(node.err(format!(
            "a {} sum of {} {:?} over {reduced:?}: only over leading or trailing dimensions",
            out.1.name(),
            x.dtype.name(),
            x.shape
        )));
    }
    let l = layout(node, x.shape, reduced)?;
    launch_reduce(node, ctx, "sum", x, out.0, l, innermost_reduced(x.shape, reduced), scale)
}

/// Whether the innermost dimension of size > 1 is a reduced one (picks the kernel shape).
fn innermost_reduced(shape: &[usize], reduced: &[bool]) -> bool {
    shape.iter().zip(reduced).rev().find(|(&n, _)| n != 1).is_some_and(|(_, &r)| r)
}

/// Whether `reduced` marks any dimension of size other than 1 (else the reduction is a copy).
pub(super) fn reduces_anything(shape: &[usize], reduced: &[bool]) -> bool {
    reduced.iter().zip(shape).any(|(&r, &n)| r && n != 1)
}

/// ReduceSumTo(x, shape): x summed over the dimensions where the target (aligned right) has 1
/// or nothing.
fn reduce_sum_to(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let o = &outs[0];
    if o.numel() == 0 {
        return Ok(());
    }
    if x.numel() == 0 {
        return super::movement::zero(ctx, o);
    }
    let lead = x.shape.len().checked_sub(o.shape.len()).ok_or_else(|| node.err(format!("cannot sum {:?} to {:?}", x.shape, o.shape)))?;
    let reduced: Vec<bool> = (0..x.shape.len()).map(|d| d < lead || (o.shape[d - lead] == 1 && x.shape[d] != 1)).collect();
    if !reduces_anything(x.shape, &reduced) {
        // nothing to sum: a view, or with `to` a conversion
        return if o.dtype == x.dtype {
            super::movement::view_copy(node, ins, outs, ctx)
        } else {
            super::widen::cast(ctx, x.dtype, o.dtype, x.ptr, o.ptr, o.numel())
        };
    }
    sum_over_into(node, ctx, x, (o.ptr, o.dtype), &reduced, 1.0)
}

/// The axes a ReduceSum/Mean/Max/Min or ReduceGrad node reduces over a tensor of rank `rank`,
/// read like the shape rules read them (`axes_input`: where the optional axes input sits).
fn reduced_marks(node: &Node, ins: &[Option<DView>], axes_input: usize, rank: usize) -> Result<(Vec<usize>, Vec<bool>)> {
    let mut infer = vec![None];
    infer.extend(super::infer_ins(node, ins, axes_input..axes_input + 1, "axes")?);
    let axes = crate::ops::reduce_axes_of(node, &infer, rank)?;
    let marks = (0..rank).map(|d| axes.contains(&d)).collect();
    Ok((axes, marks))
}

/// ReduceSum, ReduceMean, ReduceMax, ReduceMin (keepdims only changes the output's shape, not
/// its contiguous bytes). Max and Min propagate NaN like the CPU kernels.
fn reduce(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let o = &outs[0];
    if o.numel() == 0 {
        return Ok(());
    }
    let (axes, reduced) = reduced_marks(node, ins, 1, x.shape.len())?;
    let count: usize = axes.iter().map(|&a| x.shape[a]).product();
    if node.op_type != "ReduceSum" {
        // as the CPU kernels: only ReduceSum takes int64 (the i64 sum kernel would truncate a
        // mean's 1/count to 0)
        float_suffix(node, x.dtype)?;
    }
    if x.numel() > 0 && !reduces_anything(x.shape, &reduced) {
        return super::movement::view_copy(node, ins, outs, ctx);
    }
    match node.op_type.as_str() {
        "ReduceSum" => sum_over(node, ctx, x, o.ptr, &reduced, 1.0),
        "ReduceMean" => sum_over(node, ctx, x, o.ptr, &reduced, 1.0 / count.max(1) as f64),
        op => {
            let stem = if op == "ReduceMax" { "max" } else { "min" };
            let l = layout(node, x.shape, &reduced)?;
            launch_reduce(node, ctx, stem, x, o.ptr, l, innermost_reduced(x.shape, &reduced), 1.0)
        }
    }
}

/// ReduceGrad(dy, x_shape, axes?): dy (the kept dimensions) broadcast over the reduced ones,
/// divided by their count for a mean.
fn reduce_grad(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let dy = input(node, ins, 0)?;
    let o = &outs[0];
    if o.numel() == 0 {
        return Ok(());
    }
    let (axes, _) = reduced_marks(node, ins, 2, o.shape.len())?;
    let (keep, _) = crate::ops::reduced_shapes_of(o.shape, &axes, true);
    let count: usize = axes.iter().map(|&a| o.shape[a]).product();
    let scale = if node.attrs.int("mean", 0)? != 0 { 1.0 / count.max(1) as f64 } else { 1.0 };
    broadcast_scaled(node, ctx, dy, &keep, o, scale)
}

/// o = dy (of shape `keep`: o's shape with 1 on the reduced dimensions) broadcast to o's shape,
/// times `scale` (ReduceGrad, GlobalAveragePoolGrad).
pub(super) fn broadcast_scaled(node: &Node, ctx: &mut CudaCtx, dy: &DView, keep: &[usize], o: &DView, scale: f64) -> Result<()> {
    let n = o.numel();
    if n == 0 {
        return Ok(());
    }
    let s = super::strides::make(o.shape, &[super::strides::broadcast(keep, o.shape)?], &[]).map_err(|e| node.err(e.to_string()))?;
    let kernel = format!("reduce_grad_{}", float_suffix(node, dy.dtype)?);
    let grid = ctx.rt.elementwise_grid(n);
    ctx.rt.launch(
        ctx.stream,
        &kernel,
        grid,
        &[KArg::Ptr(dy.ptr), KArg::Ptr(o.ptr), KArg::Strides(s), KArg::I64(n as i64), KArg::F64(scale)],
    )
}

pub fn register(t: &mut CudaTable) {
    t.add("SumRows", sum_rows);
    t.add("ReduceSumTo", reduce_sum_to);
    for op in ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"] {
        t.add(op, reduce);
    }
    t.add("ReduceGrad", reduce_grad);
}
