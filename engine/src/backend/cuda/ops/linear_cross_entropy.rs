//! LinearCrossEntropy (ops/loss.rs: the LM head fused with its softmax cross-entropy) on the
//! GPU. The rows are walked in the chunks the node's scratch output holds (`LceBudget::CUDA`:
//! thousands of rows): per chunk, cuBLAS makes the logits X_c·op(W) in the scratch,
//! `lce_rows` (kernels/loss.cu) turns them in place into the unit-seed gradient G (bias added,
//! softmax − one-hot, times the row weight and 1/Σweights for the mean) and writes the rows'
//! loss terms (where the products read only G's 16-bit copy, a bf16 session's head without a
//! bias, the logits are made in bf16 in that copy's memory, as PyTorch's autocast makes them,
//! and `lce_rows_v16` turns them into G there), then three more products accumulate
//! dX_c = G·op(W)ᵀ, dW (+)= G's product with X_c and db (+)= 1ᵀ·G. Row weights and their sum come first (`lce_weights`, from the labels
//! alone), the loss is reduced last (`sce_reduce`, as for the unfused loss). Rows of weight 0
//! (ignore_index) are computed and come out as zeros: unlike the CPU kernel, no compaction.

use super::matmul::gemm_type;
use super::movement::zero;
use super::softmax::row_grid;
use super::{float_suffix, input, same_type, CudaCtx, CudaTable, DView};
use crate::backend::cuda::blas::{F32Mode, Gemm, GemmType};
use crate::backend::cuda::half_gemm;
use crate::backend::cuda::launch::{Grid, KArg};
use crate::backend::cuda::runtime::half_suffix;
use crate::error::Result;
use crate::ir::Node;
use crate::ops::linear::linear_dims;
use crate::tensor::DType;

/// LinearCrossEntropy(X[…, K], W, b?, labels[rows], class_weights?) -> (loss, dX₁, dW₁, db₁, scratch).
fn linear_cross_entropy(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (x, w, labels) = (input(node, ins, 0)?, input(node, ins, 1)?, input(node, ins, 3)?);
    let opt = |i: usize| ins.get(i).and_then(|v| v.as_ref());
    same_type(node, x, &[("weight", Some(w)), ("bias", opt(2)), ("class weights", opt(4))])?;
    let (bias, class_weights) = (opt(2).map_or(0, |b| b.ptr), opt(4).map_or(0, |c| c.ptr));
    let [loss, dx, dw, db, scratch] = outs else {
        return Err(node.err("expected 5 outputs (loss, dX, dW, db, scratch)"));
    };
    if labels.dtype != DType::I64 {
        return Err(node.err(format!("the CUDA loss kernels take int64 labels, got {}", labels.dtype.name())));
    }
    let (k, n) = linear_dims(node, w.shape)?;
    let trans_b = node.attrs.int("transB", 0)? != 0;
    // a frozen LM head's dW₁ is empty, its product skipped (passes/lce_weight_grad.rs)
    let weight_grad = crate::ops::loss::lce_weight_grad(node)?;
    let rows = labels.numel();
    let mean = match node.attrs.string("reduction", "mean")?.as_str() {
        "mean" => true,
        "sum" => false,
        other => return Err(node.err(format!("reduction '{other}' is not one of sum, mean"))),
    };
    let ignore = node.attrs.get("ignore_index").map(|_| node.attrs.int("ignore_index", 0)).transpose()?;
    let t = gemm_type(node, x.dtype)?;
    let sfx = float_suffix(node, x.dtype)?;
    let (es, stat) = (x.dtype.size() as u64, if x.dtype == DType::F64 { 8u64 } else { 4 });

    // per-row weights and loss terms, and the weight sum, in the runtime's scratch memory
    let per_row = (rows as u64 * stat).div_ceil(256) * 256;
    let w_s = ctx.rt.scratch(2 * per_row as usize + 256)?;
    let (loss_s, wsum) = (w_s + per_row, w_s + 2 * per_row);
    let p = KArg::Ptr;
    ctx.rt.launch(
        ctx.stream,
        &format!("lce_weights_{sfx}"),
        Grid::new(1, 1024),
        &[
            p(labels.ptr),
            p(class_weights),
            p(w_s),
            p(wsum),
            KArg::I64(rows as i64),
            KArg::I64(n as i64),
            KArg::I64(ignore.unwrap_or(0)),
            KArg::I32(ignore.is_some() as i32),
            p(ctx.error_flag),
        ],
    )?;

    let chunk = scratch.shape.first().copied().unwrap_or(0);
    // the logits' row stride: the scratch's rows, which CUDA plans pad to whole 64 columns
    // (ops/loss.rs LceBudget::row_align)
    let ld = scratch.shape.get(1).copied().unwrap_or(n);
    if ld < n {
        return Err(node.err(format!("the scratch's rows of {ld} are shorter than the {n} classes")));
    }
    if rows == 0 || n == 0 || chunk == 0 {
        zero(ctx, dx)?;
        if weight_grad {
            zero(ctx, dw)?;
        }
        zero(ctx, db)?;
        // no lce_rows: the loss terms are zeros (n = 0 leaves every label invalid: flagged)
        let acc = if stat == 8 { DType::F64 } else { DType::F32 };
        zero(ctx, &DView { dtype: acc, shape: &[rows], ptr: loss_s, host: None })?;
    } else {
        let gemm = |m: usize, nn: usize, kk: usize, ta: bool, tb: bool, accumulate: bool, mode: F32Mode| {
            let mut g = Gemm::contiguous(1, m, nn, kk, ta, tb, t);
            g.f32_mode = mode;
            g.beta = if accumulate { 1.0 } else { 0.0 };
            g
        };
        // G is the gradient of a unit loss seed (≈ softmax/Σweights: about 1e-9 per entry on
        // GPT-2 124M's 16k rows); the loss scale of an fp16 session only multiplies it later.
        // Rounded to f16 it would be almost all zeros (smallest subnormal 6e-8), so its two
        // products run at TF32 there (f16's 10-bit mantissa, f32's range).
        let g_mode = if ctx.f32_mode == F32Mode::F16 { F32Mode::Tf32 } else { ctx.f32_mode };
        // db₁ is read only where there is a bias (ops/loss.rs); without one it stays zeros
        let ones = if bias != 0 {
            Some(ctx.rt.ones(ctx.stream, t, chunk)?)
        } else {
            zero(ctx, db)?;
            None
        };
        let h = if k > 0 { Halves::new(ctx, t, ld, k, chunk, g_mode)? } else { None };
        if let Some(h) = &h {
            // W's copy has `ld` classes, zeros past n: the products then run over whole 64-class
            // tiles (the logits' padding comes out 0, and dX's inner dimension is ld)
            if trans_b {
                ctx.rt.round_f32(ctx.stream, h.t, w.ptr, h.w, n * k)?;
                let dtype = if h.t == GemmType::F16 { DType::F16 } else { DType::BF16 };
                let pad = DView { dtype, shape: &[(ld - n) * k], ptr: h.w + (n * k * h.t.size()) as u64, host: None };
                zero(ctx, &pad)?;
            } else {
                ctx.rt.round_f32_rows(ctx.stream, h.t, w.ptr, h.w, k, n, n, ld)?;
            }
        }
        // Where only G's 16-bit copy is read afterwards (no bias: no f32 column sums), the logits
        // product writes the logits in that type into the copy's memory, as PyTorch's autocast
        // keeps them, and the row pass turns them into G in place, 16 bytes a load: half the
        // bytes of f32 logits read twice and G's copy written (on GPT-2 124M, 824 MB instead of
        // 1.44 GB a chunk of 2046 rows).
        let logits16 = match &h {
            Some(h) if bias == 0 => h.g.map(|gh| (h, gh)),
            _ => None,
        };
        if logits16.is_some_and(|(h, gh)| gh % 16 != 0 || (h.g_ld * h.t.size()) % 16 != 0) {
            return Err(node.err("the LM head's 16-bit logits rows are not 16-byte aligned"));
        }
        let mut r0 = 0;
        while r0 < rows {
            let r = chunk.min(rows - r0);
            let (xc, g) = (x.ptr + (r0 * k) as u64 * es, scratch.ptr);
            let later = r0 > 0;
            if k == 0 {
                zero(ctx, &DView { shape: &[r * ld], ..*scratch })?;
            } else if let Some(h) = &h {
                ctx.rt.round_f32(ctx.stream, h.t, xc, h.x, r * k)?;
                let logits = h.gemm(gemm(r, ld, k, false, trans_b, false, F32Mode::Exact));
                match logits16 {
                    Some((_, gh)) => ctx.rt.gemm(ctx.stream, &Gemm { c_type: h.t, ldc: h.g_ld, ..logits }, h.x, h.w, gh)?,
                    None => ctx.rt.gemm(ctx.stream, &logits, h.x, h.w, g)?,
                }
            } else {
                ctx.rt.gemm(ctx.stream, &Gemm { ldc: ld, ..gemm(r, n, k, false, trans_b, false, ctx.f32_mode) }, xc, w.ptr, g)?;
            }
            let rows_at = [p(labels.ptr + r0 as u64 * 8), p(w_s + r0 as u64 * stat), p(wsum), p(loss_s + r0 as u64 * stat)];
            if let Some((h, gh)) = logits16 {
                let mut args = vec![p(gh)];
                args.extend(rows_at);
                args.extend([KArg::I64(r as i64), KArg::I64(n as i64), KArg::I64(h.g_ld as i64), KArg::I32(mean as i32)]);
                ctx.rt.launch(ctx.stream, &format!("lce_rows_v16_{}", half_suffix(h.t)?), row_grid(r, n), &args)?;
            } else {
                let mut args = vec![p(g), p(bias)];
                args.extend(rows_at);
                args.extend([KArg::I64(r as i64), KArg::I64(n as i64), KArg::I64(ld as i64), KArg::I32(mean as i32)]);
                ctx.rt.launch(ctx.stream, &format!("lce_rows_{sfx}"), row_grid(r, n), &args)?;
            }
            if k > 0 {
                // dX_c = G · op(W)ᵀ; dW (+)= its product with X_c: from G rounded once where the
                // session's products are bf16, else from the f32 G (TF32 in fp16 sessions)
                let dxc = dx.ptr + (r0 * k) as u64 * es;
                // G's rows are `g_ld` apart (its 16-bit copy) or `ld` (the logits' scratch)
                let dw_with = |g_ld: usize| {
                    if trans_b {
                        Gemm { lda: g_ld, ..gemm(n, k, r, true, false, later, g_mode) }
                    } else {
                        Gemm { ldb: g_ld, ..gemm(k, n, r, true, false, later, g_mode) }
                    }
                };
                let (gg, ww, xx, dx_g, dw_g) = match h.as_ref().and_then(|h| h.g.map(|gh| (h, gh))) {
                    Some((h, gh)) => {
                        if logits16.is_none() {
                            ctx.rt.round_f32_rows(ctx.stream, h.t, g, gh, r, n, ld, h.g_ld)?;
                        }
                        // over all `ld` classes: G's copy and W's are zeros past n
                        let dx_g = Gemm { lda: h.g_ld, ..gemm(r, k, ld, false, !trans_b, false, g_mode) };
                        (gh, h.w, h.x, h.gemm(dx_g), h.gemm(dw_with(h.g_ld)))
                    }
                    None => {
                        let (dx_g, dw_g) = (Gemm { lda: ld, ..gemm(r, k, n, false, !trans_b, false, g_mode) }, dw_with(ld));
                        // G multiplied as f32: these products must not round their operands,
                        // which would write over the rounded W and X_c in the operand memory
                        if h.is_some() && (half_gemm::half_type(&dx_g).is_some() || half_gemm::half_type(&dw_g).is_some()) {
                            return Err(node.err("the LM head's f32 G products would round over its rounded W"));
                        }
                        (g, w.ptr, xc, dx_g, dw_g)
                    }
                };
                ctx.rt.gemm(ctx.stream, &dx_g, gg, ww, dxc)?;
                if !weight_grad {
                    // no weight gradient wanted
                } else if trans_b {
                    // dW[n, k] (+)= Gᵀ · X_c
                    ctx.rt.gemm(ctx.stream, &dw_g, gg, xx, dw.ptr)?;
                } else {
                    // dW[k, n] (+)= X_cᵀ · G
                    ctx.rt.gemm(ctx.stream, &dw_g, xx, gg, dw.ptr)?;
                }
            }
            if let Some(ones) = ones {
                // db (+)= 1ᵀ · G, exact as the unfused bias gradient's column sums
                ctx.rt.gemm(ctx.stream, &Gemm { ldb: ld, ..gemm(1, n, r, false, false, later, F32Mode::Exact) }, ones, g, db.ptr)?;
            }
            r0 += r;
        }
    }
    let reduction = if mean { 2 } else { 1 };
    ctx.rt.launch(
        ctx.stream,
        &format!("sce_reduce_{sfx}"),
        Grid::new(1, 1024),
        &[p(loss_s), p(w_s), p(loss.ptr), p(0), KArg::I64(rows as i64), KArg::I32(reduction)],
    )
}

/// The operands of a mixed-precision session's products, rounded to 16 bits once instead of
/// by every gemm (`CudaRuntime::gemm` rounds both operands of each f32 product: per chunk, W
/// twice and G twice, 13 GB of casts a step on GPT-2 124M). In the runtime's operand scratch:
/// W whole with `ld` classes (zeros past n), the chunk's X_c, and (bf16 sessions; fp16 ones
/// multiply G at TF32) the chunk's G at a row stride of whole 16-byte vectors (`g_ld`). GPT-2's
/// 50257 classes would leave every row of G 2-byte aligned and every product's class dimension
/// odd; cuBLAS then ran the logits and dX products on Turing's cutlass_75 kernels on an H200
/// (24 of the step's 239 ms; nanoGPT pads its vocabulary to 50304 for the same reason). The same
/// rounding (nearest even) as the gemm's: the same operands, multiplied by whichever kernel
/// cuBLAS picks for the aligned layout.
struct Halves {
    t: GemmType,
    w: u64,
    x: u64,
    g: Option<u64>,
    g_ld: usize,
}

impl Halves {
    /// None where the products are not rounded: f32 tensors in an f32 or TF32 session, or
    /// tensors that are not f32. G gets a copy where its products (`g_mode`) are rounded. `ld`:
    /// the classes of W's copy, the logits' row stride (n or more).
    fn new(ctx: &mut CudaCtx, t: GemmType, ld: usize, k: usize, chunk: usize, g_mode: F32Mode) -> Result<Option<Halves>> {
        let half = match (t, ctx.f32_mode) {
            (GemmType::F32, F32Mode::Bf16) => GemmType::Bf16,
            (GemmType::F32, F32Mode::F16) => GemmType::F16,
            _ => return Ok(None),
        };
        let bytes = |elems: usize| (elems * half.size()).next_multiple_of(256) as u64;
        let g_ld = ld.next_multiple_of(16 / half.size());
        let g_bytes = if matches!(g_mode, F32Mode::Bf16 | F32Mode::F16) { bytes(chunk * g_ld) } else { 0 };
        let base = ctx.rt.operand_scratch((bytes(ld * k) + bytes(chunk * k) + g_bytes) as usize)?;
        let (w, x) = (base, base + bytes(ld * k));
        let g = (g_bytes > 0).then_some(x + bytes(chunk * k));
        Ok(Some(Halves { t: half, w, x, g, g_ld }))
    }
    /// `g` on the rounded copies: 16-bit operands, the f32 result, no further rounding.
    fn gemm(&self, g: Gemm) -> Gemm {
        Gemm { ab_type: self.t, f32_mode: F32Mode::Exact, ..g }
    }
}

pub fn register(t: &mut CudaTable) {
    t.add("LinearCrossEntropy", linear_cross_entropy);
}
