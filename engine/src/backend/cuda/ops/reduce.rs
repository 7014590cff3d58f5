//! Reductions (kernels/reduce.cu). SumRows ([M, N] → [N], the bias gradient) keeps the
//! innermost dimension, so it is the one-thread-per-output kernel with coalesced reads.
//! ReduceSumTo sums a broadcast gradient back to an operand's shape: a block per output when
//! the innermost dimension is summed, a thread per output otherwise.

use super::{float_suffix, input, CudaCtx, CudaTable, DView};
use crate::backend::cuda::abi::Reduce;
use crate::backend::cuda::blas::{Gemm, GemmType};
use crate::backend::cuda::launch::{Grid, KArg};
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::DType;

/// Sums of a contiguous [m, n] matrix as one cuBLAS product with a vector of ones: column sums
/// (`over_rows`: out[n] = 1ᵀ·X) or row sums (out[m] = X·1). The reduction kernels give one
/// thread (or block) per output, which starves the GPU when a bias gradient sums 16k rows into
/// 768 columns; a gemm uses every SM (and f32 accumulates like the kernels do).
fn sum_by_gemm(node: &Node, ctx: &mut CudaCtx, x: &DView, out: u64, m: usize, n: usize, over_rows: bool) -> Result<()> {
    let t = match x.dtype {
        DType::F32 => GemmType::F32,
        DType::F64 => GemmType::F64,
        other => return Err(node.err(format!("sums on CUDA take f32 or f64, got {}", other.name()))),
    };
    let ones = ctx.rt.ones(ctx.stream, t.size(), if over_rows { m } else { n })?;
    let g = if over_rows { Gemm::contiguous(1, 1, n, m, false, false, t) } else { Gemm::contiguous(1, m, 1, n, false, false, t) };
    let (a, b) = if over_rows { (ones, x.ptr) } else { (x.ptr, ones) };
    ctx.rt.gemm(ctx.stream, &g, a, b, out)
}

fn sum_rows(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let (m, n) = (x.shape[0], x.shape[1]);
    if n == 0 {
        return Ok(());
    }
    if m > 0 && matches!(x.dtype, DType::F32 | DType::F64) {
        return sum_by_gemm(node, ctx, x, outs[0].ptr, m, n, true);
    }
    let mut l = Reduce { out_rank: 1, red_rank: 1, outputs: n as i64, count: m as i64, ..Default::default() };
    l.out_dims[0] = n as i64;
    l.out_stride[0] = 1;
    l.red_dims[0] = m as i64;
    l.red_stride[0] = n as i64;
    let kernel = format!("reduce_sum_thread_{}", float_suffix(node, x.dtype)?);
    let grid = Grid::new((n as u64).div_ceil(256).min(u32::MAX as u64) as u32, 256);
    ctx.rt.launch(ctx.stream, &kernel, grid, &[KArg::Ptr(x.ptr), KArg::Ptr(outs[0].ptr), KArg::Reduce(l), KArg::F64(1.0)])
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
    let sfx = float_suffix(node, x.dtype)?;
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

/// ReduceSumTo(x, shape): x summed over the dimensions where the target (aligned right) has 1
/// or nothing.
fn reduce_sum_to(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let o = &outs[0];
    if o.numel() == 0 {
        return Ok(());
    }
    let lead = x.shape.len().checked_sub(o.shape.len()).ok_or_else(|| node.err(format!("cannot sum {:?} to {:?}", x.shape, o.shape)))?;
    let reduced: Vec<bool> = (0..x.shape.len()).map(|d| d < lead || (o.shape[d - lead] == 1 && x.shape[d] != 1)).collect();
    if !reduced.iter().zip(x.shape).any(|(&r, &n)| r && n != 1) {
        return super::movement::view_copy(node, ins, outs, ctx);
    }
    // the usual gradient shapes: reduced dims all before the kept ones (a bias over rows), or
    // all after them; then the input is one [m, n] matrix and the sum is a matrix product
    let marks: Vec<bool> = reduced.iter().zip(x.shape).filter(|(_, &n)| n != 1).map(|(&r, _)| r).collect();
    let split = marks.iter().position(|&r| r != marks[0]).unwrap_or(marks.len());
    if marks[split..].iter().all(|&r| r != marks[0]) && matches!(x.dtype, DType::F32 | DType::F64) {
        let size = |want: bool| x.shape.iter().zip(&reduced).filter(|(_, &r)| r == want).map(|(&n, _)| n).product::<usize>();
        let (red, kept) = (size(true), size(false));
        return if marks[0] {
            sum_by_gemm(node, ctx, x, o.ptr, red, kept, true)
        } else {
            sum_by_gemm(node, ctx, x, o.ptr, kept, red, false)
        };
    }
    let l = layout(node, x.shape, &reduced)?;
    let inner = x.shape.iter().zip(&reduced).rev().find(|(&n, _)| n != 1).is_some_and(|(_, &r)| r);
    launch_reduce(node, ctx, "sum", x, o.ptr, l, inner, 1.0)
}

pub fn register(t: &mut CudaTable) {
    t.add("SumRows", sum_rows);
    t.add("ReduceSumTo", reduce_sum_to);
}
