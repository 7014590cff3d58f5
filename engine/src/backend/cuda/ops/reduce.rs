//! Reductions (kernels/reduce.cu). SumRows ([M, N] → [N], the bias gradient) keeps the
//! innermost dimension, so it is the one-thread-per-output kernel with coalesced reads.
//! ReduceSumTo sums a broadcast gradient back to an operand's shape: a block per output when
//! the innermost dimension is summed, a thread per output otherwise.

use super::{float_suffix, input, CudaCtx, CudaTable, DView};
use crate::backend::cuda::abi::Reduce;
use crate::backend::cuda::launch::{Grid, KArg};
use crate::error::Result;
use crate::ir::Node;

fn sum_rows(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let (m, n) = (x.shape[0], x.shape[1]);
    if n == 0 {
        return Ok(());
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
        let (rank, dims, st) = if r { (&mut l.red_rank, &mut l.red_dims, &mut l.red_stride) } else { (&mut l.out_rank, &mut l.out_dims, &mut l.out_stride) };
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
pub(super) fn launch_reduce(node: &Node, ctx: &mut CudaCtx, stem: &str, x: &DView, y: u64, l: Reduce, inner_reduced: bool, scale: f64) -> Result<()> {
    let sfx = float_suffix(node, x.dtype)?;
    if inner_reduced {
        let blocks = (l.outputs.max(1) as u64).min(65535 * 8) as u32;
        ctx.rt.launch(ctx.stream, &format!("reduce_{stem}_{sfx}"), Grid::new(blocks, 256), &[KArg::Ptr(x.ptr), KArg::Ptr(y), KArg::Reduce(l), KArg::F64(scale)])
    } else {
        let grid = ctx.rt.elementwise_grid(l.outputs as usize);
        ctx.rt.launch(ctx.stream, &format!("reduce_{stem}_thread_{sfx}"), grid, &[KArg::Ptr(x.ptr), KArg::Ptr(y), KArg::Reduce(l), KArg::F64(scale)])
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
    let l = layout(node, x.shape, &reduced)?;
    let inner = x.shape.iter().zip(&reduced).rev().find(|(&n, _)| n != 1).is_some_and(|(_, &r)| r);
    launch_reduce(node, ctx, "sum", x, o.ptr, l, inner, 1.0)
}

pub fn register(t: &mut CudaTable) {
    t.add("SumRows", sum_rows);
    t.add("ReduceSumTo", reduce_sum_to);
}
