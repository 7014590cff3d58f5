//! SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss with their gradients (kernels/loss.cu):
//! per-sample losses and weights in scratch memory, one block per sample, then one block
//! reducing them. The gradient recomputes the per-sample terms from the scores (the plan keeps
//! no forward temporaries), after the weight sum when the reduction is the mean.

use super::softmax::row_grid;
use super::{float_suffix, input, same_type, CudaCtx, CudaTable, DView};
use crate::backend::cuda::launch::{Grid, KArg};
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::DType;

struct Layout {
    samples: usize,
    classes: usize,
    inner: usize,
    ignore: Option<i64>,
    /// 0 none, 1 sum, 2 mean (the kernels' code)
    reduction: i32,
    softmax: bool,
}

fn layout(node: &Node, scores: &DView, labels: &DView) -> Result<Layout> {
    if scores.shape.len() < 2 {
        return Err(node.err(format!("scores must be [N, C, ...], got {:?}", scores.shape)));
    }
    if labels.dtype != DType::I64 {
        return Err(node.err(format!("the CUDA loss kernels take int64 labels, got {}", labels.dtype.name())));
    }
    let inner: usize = scores.shape[2..].iter().product();
    let reduction = match node.attrs.string("reduction", "mean")?.as_str() {
        "none" => 0,
        "sum" => 1,
        "mean" => 2,
        other => return Err(node.err(format!("reduction '{other}' is not one of none, sum, mean"))),
    };
    Ok(Layout {
        samples: scores.shape[0] * inner,
        classes: scores.shape[1],
        inner,
        ignore: node.attrs.get("ignore_index").map(|_| node.attrs.int("ignore_index", 0)).transpose()?,
        reduction,
        softmax: node.op_type.starts_with("SoftmaxCrossEntropy"),
    })
}

fn stat_size(d: DType) -> usize {
    if d == DType::F64 {
        8
    } else {
        4
    }
}

/// Per-sample losses and weights of `x` into scratch at (loss_s, w_s); `logp` may be 0.
#[allow(clippy::too_many_arguments)]
fn per_sample(
    node: &Node,
    ctx: &mut CudaCtx,
    l: &Layout,
    x: &DView,
    labels: u64,
    weights: u64,
    loss_s: u64,
    w_s: u64,
    logp: u64,
) -> Result<()> {
    let (p, i) = (KArg::Ptr, |v: usize| KArg::I64(v as i64));
    let kernel = format!("sce_loss_{}", float_suffix(node, x.dtype)?);
    ctx.rt.launch(
        ctx.stream,
        &kernel,
        row_grid(l.samples, l.classes),
        &[
            p(x.ptr),
            p(labels),
            p(weights),
            p(loss_s),
            p(w_s),
            p(logp),
            p(0),
            i(l.samples),
            i(l.classes),
            i(l.inner),
            KArg::I64(l.ignore.unwrap_or(0)),
            KArg::I32(l.ignore.is_some() as i32),
            KArg::I32(l.softmax as i32),
            p(ctx.error_flag),
        ],
    )
}

#[allow(clippy::too_many_arguments)]
fn reduce(node: &Node, ctx: &mut CudaCtx, l: &Layout, dtype: DType, loss_s: u64, w_s: u64, out: u64, wsum: u64) -> Result<()> {
    let kernel = format!("sce_reduce_{}", float_suffix(node, dtype)?);
    ctx.rt.launch(
        ctx.stream,
        &kernel,
        Grid::new(1, 1024),
        &[KArg::Ptr(loss_s), KArg::Ptr(w_s), KArg::Ptr(out), KArg::Ptr(wsum), KArg::I64(l.samples as i64), KArg::I32(l.reduction)],
    )
}

/// Scratch for S per-sample losses and weights, a weight sum and (for the gradient's reduction
/// pass) S outputs: (loss_s, w_s, wsum, out).
fn scratch(ctx: &mut CudaCtx, l: &Layout, dtype: DType) -> Result<(u64, u64, u64, u64)> {
    let a = (l.samples * stat_size(dtype)).div_ceil(256) * 256;
    let t = (l.samples.max(1) * dtype.size()).div_ceil(256) * 256;
    let base = ctx.rt.scratch(2 * a + 256 + t)?;
    Ok((base, base + a as u64, base + 2 * a as u64, base + 2 * a as u64 + 256))
}

/// Loss(scores, labels, weights?) -> (loss, log_prob?).
fn loss(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (x, labels) = (input(node, ins, 0)?, input(node, ins, 1)?);
    same_type(node, x, &[("class weights", ins.get(2).and_then(|w| w.as_ref()))])?;
    let weights = ins.get(2).and_then(|w| w.as_ref()).map_or(0, |w| w.ptr);
    let l = layout(node, x, labels)?;
    let (loss_s, w_s, _, _) = scratch(ctx, &l, x.dtype)?;
    let logp = if l.softmax { outs.get(1).map_or(0, |o| o.ptr) } else { 0 };
    if l.samples > 0 {
        per_sample(node, ctx, &l, x, labels.ptr, weights, loss_s, w_s, logp)?;
    }
    reduce(node, ctx, &l, x.dtype, loss_s, w_s, outs[0].ptr, 0)
}

/// LossGrad(dy, scores, labels, weights?) -> dscores.
fn loss_grad(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (dy, x, labels) = (input(node, ins, 0)?, input(node, ins, 1)?, input(node, ins, 2)?);
    same_type(node, x, &[("class weights", ins.get(3).and_then(|w| w.as_ref()))])?;
    let weights = ins.get(3).and_then(|w| w.as_ref()).map_or(0, |w| w.ptr);
    let l = layout(node, x, labels)?;
    if l.samples == 0 || l.classes == 0 {
        return Ok(());
    }
    let (loss_s, w_s, wsum, out) = scratch(ctx, &l, x.dtype)?;
    if l.reduction == 2 {
        per_sample(node, ctx, &l, x, labels.ptr, weights, loss_s, w_s, 0)?;
        reduce(node, ctx, &l, x.dtype, loss_s, w_s, out, wsum)?;
    }
    let (p, i) = (KArg::Ptr, |v: usize| KArg::I64(v as i64));
    let kernel = format!("sce_grad_{}", float_suffix(node, x.dtype)?);
    ctx.rt.launch(
        ctx.stream,
        &kernel,
        row_grid(l.samples, l.classes),
        &[
            p(dy.ptr),
            p(x.ptr),
            p(labels.ptr),
            p(weights),
            p(if l.reduction == 2 { wsum } else { 0 }),
            p(outs[0].ptr),
            i(l.samples),
            i(l.classes),
            i(l.inner),
            KArg::I64(l.ignore.unwrap_or(0)),
            KArg::I32(l.ignore.is_some() as i32),
            KArg::I32(l.softmax as i32),
            KArg::I32(l.reduction),
        ],
    )
}

pub fn register(t: &mut CudaTable) {
    t.add("SoftmaxCrossEntropyLoss", loss);
    t.add("NegativeLogLikelihoodLoss", loss);
    t.add("SoftmaxCrossEntropyLossGrad", loss_grad);
    t.add("NLLLossGrad", loss_grad);
}
