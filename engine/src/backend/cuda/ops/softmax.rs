//! Softmax and LogSoftmax with their gradients (kernels/softmax.cu): the tensor seen as
//! [outer, n, inner] by the shared layout rule, one block per row.

use super::{float_suffix, input, CudaCtx, CudaTable, DView};
use crate::backend::cuda::launch::{Grid, KArg};
use crate::error::Result;
use crate::ir::Node;

/// One block per row, a warp multiple of threads covering n up to 1024.
pub(super) fn row_grid(rows: usize, n: usize) -> Grid {
    let threads = (n.div_ceil(32) * 32).clamp(32, 1024) as u32;
    Grid::new(rows.clamp(1, 65535 * 32) as u32, threads)
}

fn stem(node: &Node) -> &'static str {
    if node.op_type.starts_with("LogSoftmax") {
        "log_softmax"
    } else {
        "softmax"
    }
}

fn forward(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let (outer, n, inner) = crate::ops::softmax_layout_of(node, x.shape)?;
    let rows = outer * inner;
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let kernel = format!("{}_{}", stem(node), float_suffix(node, x.dtype)?);
    let i = |v: usize| KArg::I64(v as i64);
    ctx.rt.launch(ctx.stream, &kernel, row_grid(rows, n), &[KArg::Ptr(x.ptr), KArg::Ptr(outs[0].ptr), i(rows), i(n), i(inner)])
}

/// SoftmaxGrad(dy, y) / LogSoftmaxGrad(dy, y).
fn gradient(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (dy, y) = (input(node, ins, 0)?, input(node, ins, 1)?);
    let (outer, n, inner) = crate::ops::softmax_layout_of(node, dy.shape)?;
    let rows = outer * inner;
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let kernel = format!("{}_grad_{}", stem(node), float_suffix(node, dy.dtype)?);
    let i = |v: usize| KArg::I64(v as i64);
    ctx.rt.launch(
        ctx.stream,
        &kernel,
        row_grid(rows, n),
        &[KArg::Ptr(dy.ptr), KArg::Ptr(y.ptr), KArg::Ptr(outs[0].ptr), i(rows), i(n), i(inner)],
    )
}

pub fn register(t: &mut CudaTable) {
    t.add("Softmax", forward);
    t.add("LogSoftmax", forward);
    t.add("SoftmaxGrad", gradient);
    t.add("LogSoftmaxGrad", gradient);
}
