//! MatMul, Gemm, FusedMatMul (the gradient matmuls, possibly summed over broadcast batches)
//! and Linear on cuBLAS; a Gemm's or a Linear's bias through cuBLASLt's epilogue where it can
//! (blas_lt.rs), else copied into the output for the product to add to; a Linear's GELU in that
//! epilogue too (GELU_AUX_BIAS), else a GELU kernel after the product; MatMulGeluGrad as one
//! cuBLASLt product with the DGELU epilogue, else the product and the GELU-gradient kernel.
//! Batches become one strided-batched call where the operands' batch layouts allow (same
//! batch, or one operand repeated with stride 0, or a batch folded into M or K as the CPU
//! kernel does); other broadcast patterns run one call per batch.

use super::movement::{copy, expand_layout, zero};
use super::strides::broadcast;
use super::{float_suffix, input, CudaCtx, CudaTable, DView};
use crate::backend::cuda::blas::{Gemm, GemmType};
use crate::backend::cuda::blas_lt::Epilogue;
use crate::backend::cuda::launch::KArg;
use crate::error::Result;
use crate::ir::Node;
use crate::ops::linear::linear_dims;
use crate::tensor::DType;

pub(super) fn gemm_type(node: &Node, d: DType) -> Result<GemmType> {
    match d {
        DType::F32 => Ok(GemmType::F32),
        DType::F64 => Ok(GemmType::F64),
        // 16-bit activations (passes/autocast.rs): 16-bit operands and result, f32 accumulation
        DType::BF16 => Ok(GemmType::Bf16),
        DType::F16 => Ok(GemmType::F16),
        other => Err(node.err(format!("CUDA matmuls take float tensors, got {}", other.name()))),
    }
}

/// Copies `src` (shape broadcastable to `dst_shape`) into the contiguous `dst`.
fn broadcast_copy(node: &Node, ctx: &mut CudaCtx, src: &DView, dst_ptr: u64, dst_shape: &[usize]) -> Result<()> {
    let s = expand_layout(src.shape, dst_shape).map_err(|e| node.err(e.to_string()))?;
    copy(ctx, src.dtype.size(), src.ptr, dst_ptr, s, dst_shape.iter().product())
}

/// out = alpha · op(a) · op(b) (+ beta · out), batched with broadcasting; out's batch dims may
/// be fewer than the broadcast batch (those batches are summed), as FusedMatMul's target asks.
#[allow(clippy::too_many_arguments)]
fn batched(node: &Node, ctx: &mut CudaCtx, a: &DView, b: &DView, o: &DView, ta: bool, tb: bool, alpha: f64, beta: f64) -> Result<()> {
    let t = gemm_type(node, a.dtype)?;
    let a2: Vec<usize> = if a.shape.len() == 1 { vec![1, a.shape[0]] } else { a.shape.to_vec() };
    let b2: Vec<usize> = if b.shape.len() == 1 { vec![b.shape[0], 1] } else { b.shape.to_vec() };
    let (ra, rb) = (a2.len(), b2.len());
    let (m, k) = if ta { (a2[ra - 1], a2[ra - 2]) } else { (a2[ra - 2], a2[ra - 1]) };
    let n = if tb { b2[rb - 2] } else { b2[rb - 1] };
    let (ba, bb) = (&a2[..ra - 2], &b2[..rb - 2]);
    let full = crate::ops::util::broadcast_shapes(node, &[ba, bb])?;
    let out_batch: Vec<usize> = if a.shape.len() > 1 && b.shape.len() > 1 { o.shape[..o.shape.len() - 2].to_vec() } else { full.clone() };
    let (batch_a, batch_b): (usize, usize) = (ba.iter().product(), bb.iter().product());
    let (batch_full, batch_out): (usize, usize) = (full.iter().product(), out_batch.iter().product());
    if o.numel() == 0 {
        return Ok(());
    }
    let mut g = Gemm::contiguous(1, m, n, k, ta, tb, t);
    // f32 out of 16-bit operands where a FusedMatMul writes f32 (its `to`)
    g.c_type = gemm_type(node, o.dtype)?;
    g.f32_mode = ctx.f32_mode;
    g.alpha = alpha;
    g.beta = beta;
    if k == 0 {
        // nothing to multiply: out = beta · out
        return scale(node, ctx, o, beta);
    }
    let (es, es_o, rs) = (t.size() as u64, g.c_type.size() as u64, ctx.stream);
    // b has no batch and a is not transposed: a's batch folds into M
    if batch_b == 1 && bb.is_empty() && !ta && batch_out == batch_a && ba == full.as_slice() {
        g.m = batch_a * m;
        return ctx.rt.gemm(rs, &g, a.ptr, b.ptr, o.ptr);
    }
    // aᵀ·b over identical batches summed into one matrix: the batch folds into K
    if ta && !tb && batch_out == 1 && ba == bb && batch_a > 1 {
        g.k = k * batch_a;
        return ctx.rt.gemm(rs, &g, a.ptr, b.ptr, o.ptr);
    }
    if batch_out == batch_full {
        let same_or_one = |x: &[usize], p: usize| x == full.as_slice() || p == 1;
        if same_or_one(ba, batch_a) && same_or_one(bb, batch_b) {
            g.batch = batch_full;
            g.stride_a = if batch_a == 1 { 0 } else { m * k };
            g.stride_b = if batch_b == 1 { 0 } else { k * n };
            return ctx.rt.gemm(rs, &g, a.ptr, b.ptr, o.ptr);
        }
    }
    // general broadcast (or a reduced batch): one call per batch, accumulating where summed
    let sa = broadcast(ba, &full).map_err(|e| node.err(e.to_string()))?;
    let sb = broadcast(bb, &full).map_err(|e| node.err(e.to_string()))?;
    let so = broadcast(&out_batch, &full).map_err(|e| node.err(e.to_string()))?;
    let reduced = batch_out != batch_full;
    let mut written = vec![false; batch_out.max(1)];
    for bi in 0..batch_full {
        let (mut r, mut oa, mut ob, mut oo) = (bi, 0i64, 0i64, 0i64);
        for d in (0..full.len()).rev() {
            let i = (r % full[d]) as i64;
            r /= full[d];
            oa += i * sa[d];
            ob += i * sb[d];
            oo += i * so[d];
        }
        let mut gi = g;
        if reduced && std::mem::replace(&mut written[oo as usize], true) {
            gi.beta = 1.0;
        }
        let (pa, pb, po) =
            (a.ptr + oa as u64 * (m * k) as u64 * es, b.ptr + ob as u64 * (k * n) as u64 * es, o.ptr + oo as u64 * (m * n) as u64 * es_o);
        ctx.rt.gemm(rs, &gi, pa, pb, po)?;
    }
    Ok(())
}

/// out = beta · out (beta 0 writes zeros, whatever out held).
fn scale(node: &Node, ctx: &mut CudaCtx, o: &DView, beta: f64) -> Result<()> {
    if beta == 0.0 {
        return zero(ctx, o);
    }
    let n = o.numel();
    let sfx = float_suffix(node, o.dtype)?;
    ctx.rt.launch(
        ctx.stream,
        &format!("affine_{sfx}"),
        ctx.rt.elementwise_grid(n),
        &[KArg::Ptr(o.ptr), KArg::Ptr(o.ptr), KArg::I64(n as i64), KArg::F64(beta), KArg::F64(0.0)],
    )
}

/// `ORTRAIN_CUBLASLT=0` turns the cuBLASLt epilogue products off (the bias copied into the
/// output, the residual summed by a gemm with beta = 1): for comparing the two on a GPU, and for
/// the tests of the cuBLAS path. Read at each call (plans replayed from a CUDA graph keep what
/// they were recorded with).
pub const ENV_CUBLASLT: &str = "ORTRAIN_CUBLASLT";

fn epilogues_on() -> bool {
    std::env::var(ENV_CUBLASLT).map_or(true, |v| v.trim() != "0")
}

/// out = alpha · op(a) · op(b) + bias in one cuBLASLt product, the bias added as the product is
/// written (blas_lt.rs) instead of copied into `out` first for a gemm with beta = 1 to add to:
/// 2-D a and b of out's type, `bias` n values of that type. False where that does not apply or
/// cuBLASLt has no kernel for it; nothing is queued then.
#[allow(clippy::too_many_arguments)]
fn with_bias_epilogue(
    node: &Node,
    ctx: &mut CudaCtx,
    a: &DView,
    b: &DView,
    o: &DView,
    bias: &DView,
    ta: bool,
    tb: bool,
    alpha: f64,
) -> Result<bool> {
    let same_type = a.dtype == o.dtype && b.dtype == o.dtype && bias.dtype == o.dtype;
    if a.shape.len() != 2 || b.shape.len() != 2 || o.shape.len() != 2 || !same_type || !epilogues_on() {
        return Ok(false);
    }
    let (m, k) = if ta { (a.shape[1], a.shape[0]) } else { (a.shape[0], a.shape[1]) };
    let n = if tb { b.shape[0] } else { b.shape[1] };
    if bias.numel() != n || bias.shape.iter().rev().skip(1).any(|&d| d != 1) || o.shape != [m, n] || k == 0 {
        return Ok(false);
    }
    let mut g = Gemm::contiguous(1, m, n, k, ta, tb, gemm_type(node, a.dtype)?);
    g.f32_mode = ctx.f32_mode;
    g.alpha = alpha;
    ctx.rt.gemm_epilogue(ctx.stream, &g, a.ptr, b.ptr, 0, o.ptr, Epilogue::Bias(bias.ptr))
}

fn matmul(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (a, b) = (input(node, ins, 0)?, input(node, ins, 1)?);
    batched(node, ctx, a, b, &outs[0], false, false, 1.0, 0.0)
}

fn fused_matmul(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (a, b) = (input(node, ins, 0)?, input(node, ins, 1)?);
    let ta = node.attrs.int("transA", 0)? != 0;
    let tb = node.attrs.int("transB", 0)? != 0;
    let alpha = node.attrs.float("alpha", 1.0)? as f64;
    let target = if ins.get(2).is_some_and(|x| x.is_some()) { Some(outs[0].shape) } else { None };
    let (sa, sb, st) = crate::ops::matmul_fused_shapes(node, a.shape, b.shape, target)?;
    let st = st.unwrap_or_else(|| outs[0].shape.to_vec());
    let (a, b, o) = (DView { shape: &sa, ..*a }, DView { shape: &sb, ..*b }, DView { shape: &st, ..outs[0] });
    batched(node, ctx, &a, &b, &o, ta, tb, alpha, 0.0)
}

fn gemm_op(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (a, b) = (input(node, ins, 0)?, input(node, ins, 1)?);
    let ta = node.attrs.int("transA", 0)? != 0;
    let tb = node.attrs.int("transB", 0)? != 0;
    let alpha = node.attrs.float("alpha", 1.0)? as f64;
    let beta = node.attrs.float("beta", 1.0)? as f64;
    let o = &outs[0];
    if let Some(c) = ins.get(2).and_then(|c| c.as_ref()).filter(|_| beta == 1.0) {
        if with_bias_epilogue(node, ctx, a, b, o, c, ta, tb, alpha)? {
            return Ok(());
        }
    }
    let beta = match ins.get(2).and_then(|c| c.as_ref()) {
        Some(c) if beta != 0.0 => {
            broadcast_copy(node, ctx, c, o.ptr, o.shape)?;
            beta
        }
        _ => 0.0,
    };
    batched(node, ctx, a, b, o, ta, tb, alpha, beta)
}

fn linear(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (x, w) = (input(node, ins, 0)?, input(node, ins, 1)?);
    let tb = node.attrs.int("transB", 0)? != 0;
    let (k, n) = linear_dims(node, w.shape)?;
    let o = &outs[0];
    let rows = o.numel().checked_div(n).unwrap_or(0);
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let shape_x = [rows, k];
    let shape_o = [rows, n];
    let x2 = DView { shape: &shape_x, ..*x };
    let o2 = DView { shape: &shape_o, ..*o };
    let bias = ins.get(2).and_then(|b| b.as_ref());
    if let Some(residual) = ins.get(3).and_then(|r| r.as_ref()) {
        return linear_residual(node, ctx, &x2, w, bias, residual, &o2, tb);
    }
    if crate::ops::linear::gelu_after(node)? {
        let pre = outs.get(1).ok_or_else(|| node.err("a Linear with a GELU writes two outputs"))?;
        return linear_gelu(node, ctx, &x2, w, bias, &o2, &DView { shape: &shape_o, ..*pre }, tb);
    }
    linear_product(node, ctx, &x2, w, bias, &o2, tb)
}

/// o = x · op(w) (+ bias) over 2-D x and o: the bias added by cuBLASLt's epilogue where it can,
/// else copied into o for the product to add to.
fn linear_product(node: &Node, ctx: &mut CudaCtx, x: &DView, w: &DView, bias: Option<&DView>, o: &DView, tb: bool) -> Result<()> {
    if let Some(bias) = bias {
        if with_bias_epilogue(node, ctx, x, w, o, bias, false, tb, 1.0)? {
            return Ok(());
        }
    }
    let beta = match bias {
        Some(bias) => {
            broadcast_copy(node, ctx, bias, o.ptr, o.shape)?;
            1.0
        }
        None => 0.0,
    };
    batched(node, ctx, x, w, o, false, tb, 1.0, beta)
}

/// A Linear with a GELU (passes/fuse_linear_gelu.rs): pre = x · op(w) (+ bias) and h = its
/// tanh-approximated GELU. One cuBLASLt product whose GELU_AUX_BIAS (GELU_AUX) epilogue
/// writes both, the GELU taken of the f32 sum before it is rounded, so pre is not read back;
/// where cuBLASLt declines (a row length not a multiple of 8, pre or the bias off 16 bytes, f32
/// multiplied as 16 bits), pre as a Linear writes it, then kernels/activation.cu's gelu_tanh.
#[allow(clippy::too_many_arguments)]
fn linear_gelu(node: &Node, ctx: &mut CudaCtx, x: &DView, w: &DView, bias: Option<&DView>, h: &DView, pre: &DView, tb: bool) -> Result<()> {
    let (rows, k, n) = (x.shape[0], x.shape[1], h.shape[1]);
    let bias_fits = bias.is_none_or(|b| b.dtype == h.dtype && b.numel() == n);
    if k > 0 && bias_fits && epilogues_on() {
        let mut g = Gemm::contiguous(1, rows, n, k, false, tb, gemm_type(node, x.dtype)?);
        g.f32_mode = ctx.f32_mode;
        let epilogue = Epilogue::Gelu { aux: pre.ptr, bias: bias.map_or(0, |b| b.ptr) };
        if ctx.rt.gemm_epilogue(ctx.stream, &g, x.ptr, w.ptr, 0, h.ptr, epilogue)? {
            return Ok(());
        }
    }
    linear_product(node, ctx, x, w, bias, pre, tb)?;
    let count = rows * n;
    ctx.rt.launch(
        ctx.stream,
        &format!("gelu_tanh_{}", float_suffix(node, h.dtype)?),
        ctx.rt.elementwise_grid(count),
        &[KArg::Ptr(pre.ptr), KArg::Ptr(h.ptr), KArg::I64(count as i64), KArg::F32(0.01), KArg::F32(0.5)],
    )
}

/// Linear's input 3 (passes/fuse_residual_linear.rs): out = residual + x · op(w) (+ bias), out
/// and residual (and the bias) of their own type, f32 from 16-bit x and w. One cuBLASLt product
/// adding both in its epilogue where it can; else the residual copied into out, the product
/// added by a gemm with beta = 1, and the bias by a product of a ones column and the bias row.
#[allow(clippy::too_many_arguments)]
fn linear_residual(
    node: &Node,
    ctx: &mut CudaCtx,
    x: &DView,
    w: &DView,
    bias: Option<&DView>,
    r: &DView,
    o: &DView,
    tb: bool,
) -> Result<()> {
    let (rows, k, n) = (x.shape[0], x.shape[1], o.shape[1]);
    if r.dtype != o.dtype || r.numel() != o.numel() || bias.is_some_and(|b| b.dtype != o.dtype || b.numel() != n) {
        return Err(node.err(format!(
            "the residual ({} {:?}) and the bias must be of the output's type ({}) and size",
            r.dtype.name(),
            r.shape,
            o.dtype.name()
        )));
    }
    let (ab, cd) = (gemm_type(node, x.dtype)?, gemm_type(node, o.dtype)?);
    let mut g = Gemm::contiguous(1, rows, n, k, false, tb, ab);
    g.c_type = cd;
    g.f32_mode = ctx.f32_mode;
    g.beta = 1.0;
    if k > 0
        && epilogues_on()
        && ctx.rt.gemm_epilogue(ctx.stream, &g, x.ptr, w.ptr, r.ptr, o.ptr, Epilogue::Bias(bias.map_or(0, |b| b.ptr)))?
    {
        return Ok(());
    }
    let numel = [o.numel()];
    let flat = expand_layout(&numel, &numel).map_err(|e| node.err(e.to_string()))?;
    copy(ctx, o.dtype.size(), r.ptr, o.ptr, flat, o.numel())?;
    if k > 0 {
        ctx.rt.gemm(ctx.stream, &g, x.ptr, w.ptr, o.ptr)?;
    }
    if let Some(b) = bias {
        let ones = ctx.rt.ones(ctx.stream, cd, rows)?;
        let mut add = Gemm::contiguous(1, rows, n, 1, false, false, cd);
        add.beta = 1.0;
        ctx.rt.gemm(ctx.stream, &add, ones, b.ptr, o.ptr)?;
    }
    Ok(())
}

/// MatMulGeluGrad (ops/matmul_gelu_grad.rs): out = GeluGrad(op(a)·op(b), x), and with a
/// second output the sums of out's rows. One cuBLASLt product whose DGELU_BGRAD (or DGELU)
/// epilogue multiplies each element by the GELU's slope at x as it is written (the product
/// rounded once, never stored) and sums the rows; where cuBLASLt declines (a row length not a
/// multiple of 8, x off 16 bytes, f32 multiplied as 16 bits), the product into out,
/// kernels/activation.cu's gradient over it in place, and the sums as a product with ones.
fn matmul_gelu_grad(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (a, b, x) = (input(node, ins, 0)?, input(node, ins, 1)?, input(node, ins, 2)?);
    let ta = node.attrs.int("transA", 0)? != 0;
    let tb = node.attrs.int("transB", 0)? != 0;
    let (m, k, n, _) = crate::ops::matmul_gelu_grad::product_dims(node, a.shape, b.shape)?;
    let (o, bias_grad) = (&outs[0], outs.get(1));
    let rows_o = [m, n];
    let sums = |ctx: &mut CudaCtx| match bias_grad {
        Some(s) => super::reduce::column_sums(node, ctx, &DView { shape: &rows_o, ..*o }, s.ptr),
        None => Ok(()),
    };
    if m == 0 || n == 0 || k == 0 {
        // nothing multiplied: every product is 0, so is its gradient
        zero(ctx, o)?;
        return sums(ctx);
    }
    let mut g = Gemm::contiguous(1, m, n, k, ta, tb, gemm_type(node, a.dtype)?);
    g.f32_mode = ctx.f32_mode;
    if epilogues_on() {
        let aux = x.ptr;
        if let Some(s) = bias_grad {
            if ctx.rt.gemm_epilogue(ctx.stream, &g, a.ptr, b.ptr, 0, o.ptr, Epilogue::GeluGrad { aux, bias_grad: s.ptr })? {
                return Ok(());
            }
        }
        if ctx.rt.gemm_epilogue(ctx.stream, &g, a.ptr, b.ptr, 0, o.ptr, Epilogue::GeluGrad { aux, bias_grad: 0 })? {
            return sums(ctx);
        }
    }
    let rows_a = if ta { [k, m] } else { [m, k] };
    batched(node, ctx, &DView { shape: &rows_a, ..*a }, b, &DView { shape: &rows_o, ..*o }, ta, tb, 1.0, 0.0)?;
    let count = m * n;
    ctx.rt.launch(
        ctx.stream,
        &format!("gelu_tanh_grad_{}", float_suffix(node, o.dtype)?),
        ctx.rt.elementwise_grid(count),
        &[KArg::Ptr(o.ptr), KArg::Ptr(x.ptr), KArg::Ptr(o.ptr), KArg::I64(count as i64), KArg::F32(0.01), KArg::F32(0.5)],
    )?;
    sums(ctx)
}

pub fn register(t: &mut CudaTable) {
    t.add("MatMul", matmul);
    t.add("MatMulGeluGrad", matmul_gelu_grad);
    t.add("FusedMatMul", fused_matmul);
    t.add("Gemm", gemm_op);
    t.add("Linear", linear);
}
