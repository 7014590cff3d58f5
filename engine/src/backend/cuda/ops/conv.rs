//! Conv and its gradients ConvGradX, ConvGradW, ConvGradB (1-D and 2-D windows, groups) with
//! the CPU kernels' semantics (backend/cpu/conv.rs), as im2col (kernels/conv.cu) and cuBLAS:
//! per chunk of samples, one strided-batched gemm per group, the weight repeated over the
//! samples (stride 0). A 1×1, stride-1, unpadded convolution multiplies the input planes
//! directly. The column matrix lives in the runtime's scratch memory, in chunks of samples of
//! at most `COL_BUDGET` bytes.
//!
//! - Conv: Y[s, g] = W_g · col[s, g], then the bias as a rank-1 update (b · 1ᵀ, beta 1).
//! - ConvGradX: col[s, g] = W_gᵀ · dY[s, g], folded back by col2im (gathered, no atomics).
//! - ConvGradW: P[s, g] = dY[s, g] · col[s, g]ᵀ per sample, then dW = Σ_s P[s] as a product
//!   with a ones vector, accumulated over chunks (beta 1).
//! - ConvGradB: dy summed over every axis but 1 (the reductions of reduce.rs).
//! The products follow the session's f32 mode (exact, TF32 or bf16) as MatMul does.

use super::matmul::gemm_type;
use super::{float_suffix, input, CudaCtx, CudaTable, DView};
use crate::backend::cuda::abi::Win2d;
use crate::backend::cuda::blas::{Gemm, GemmType};
use crate::backend::cuda::launch::KArg;
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::DType;

/// Bytes of column matrix (and, for ConvGradW, per-sample partial products) per chunk.
const COL_BUDGET: usize = 256 << 20;

/// Per-sample geometry: samples, channels, output channels, group, output channels per group,
/// kernel taps, im2col rows per group (channels per group · kk), output and input plane sizes.
struct Geo {
    n: usize,
    c: usize,
    m: usize,
    group: usize,
    mg: usize,
    kk: usize,
    rows: usize,
    ohw: usize,
    in_plane: usize,
    /// 1×1 kernel, stride 1, no padding: the input planes are the column matrix.
    direct: bool,
    win: Win2d,
}

impl Geo {
    fn new(node: &Node, x: &[usize], w: &[usize]) -> Result<Geo> {
        let (group, win) = crate::ops::conv_geometry_of(node, x, w)?;
        let w2 = win.as_2d();
        let direct = w2.kernel == [1, 1] && w2.strides == [1, 1] && w2.pad_begin == [0, 0] && w2.pad_end == [0, 0];
        let (cg, kk) = (x[1] / group, w2.kernel_size());
        Ok(Geo {
            n: x[0],
            c: x[1],
            m: w[0],
            group,
            mg: w[0] / group,
            kk,
            rows: cg * kk,
            ohw: w2.out_size(),
            in_plane: w2.in_size(),
            direct,
            win: Win2d::new(&win, x[1]),
        })
    }
    /// Elements of one sample's column matrix (all groups), 0 when direct.
    fn col_sample(&self) -> usize {
        if self.direct {
            0
        } else {
            self.c * self.kk * self.ohw
        }
    }
    /// Samples per chunk when each takes `bytes` of scratch.
    fn chunk(&self, bytes: usize) -> usize {
        (COL_BUDGET / bytes.max(1)).clamp(1, self.n.max(1))
    }
    /// Where group `gi` of sample `s0`'s column matrix starts, and the stride between samples,
    /// for input `x` (direct) or the column matrix at `col`.
    fn source(&self, x_chunk: u64, col: u64, gi: usize, es: usize) -> (u64, usize) {
        let at = (gi * self.rows * self.ohw * es) as u64;
        if self.direct {
            (x_chunk + at, self.c * self.in_plane)
        } else {
            (col + at, self.col_sample())
        }
    }
}

/// The gemm type, kernel suffix, element size and geometry of a Conv-family node whose float
/// operands have type `d`, for input shape `x` and weight shape `w`.
fn setup(node: &Node, d: DType, x: &[usize], w: &[usize]) -> Result<(GemmType, &'static str, usize, Geo)> {
    let t = gemm_type(node, d)?;
    Ok((t, float_suffix(node, d)?, t.size(), Geo::new(node, x, w)?))
}

/// im2col_T / col2im_T over `n` elements.
fn rearrange(ctx: &mut CudaCtx, kernel: &str, src: u64, dst: u64, win: Win2d, n: usize) -> Result<()> {
    let grid = ctx.rt.elementwise_grid(n);
    ctx.rt.launch(ctx.stream, kernel, grid, &[KArg::Ptr(src), KArg::Ptr(dst), KArg::Win2d(win), KArg::I64(n as i64)])
}

/// A strided-batched gemm over `batch` samples in the session's f32 mode.
#[allow(clippy::too_many_arguments)]
fn batched_gemm(
    ctx: &mut CudaCtx,
    t: GemmType,
    (m, n, k): (usize, usize, usize),
    ta: bool,
    tb: bool,
    batch: usize,
    strides: [usize; 3],
    ptrs: [u64; 3],
) -> Result<()> {
    let mut g = Gemm::contiguous(batch, m, n, k, ta, tb, t);
    g.f32_mode = ctx.f32_mode;
    [g.stride_a, g.stride_b, g.stride_c] = strides;
    ctx.rt.gemm(ctx.stream, &g, ptrs[0], ptrs[1], ptrs[2])
}

fn conv(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (x, w) = (input(node, ins, 0)?, input(node, ins, 1)?);
    let y = &outs[0];
    let (t, sfx, es, g) = setup(node, x.dtype, x.shape, w.shape)?;
    if y.numel() == 0 {
        return Ok(());
    }
    let per = g.chunk(g.col_sample() * es);
    let col = if g.direct { 0 } else { ctx.rt.scratch(per * g.col_sample() * es)? };
    for s0 in (0..g.n).step_by(per) {
        let s = per.min(g.n - s0);
        let x0 = x.ptr + (s0 * g.c * g.in_plane * es) as u64;
        if !g.direct {
            rearrange(ctx, &format!("im2col_{sfx}"), x0, col, g.win, s * g.col_sample())?;
        }
        for gi in 0..g.group {
            let (src, src_stride) = g.source(x0, col, gi, es);
            let a = w.ptr + (gi * g.mg * g.rows * es) as u64;
            let c = y.ptr + ((s0 * g.m + gi * g.mg) * g.ohw * es) as u64;
            batched_gemm(ctx, t, (g.mg, g.ohw, g.rows), false, false, s, [0, src_stride, g.m * g.ohw], [a, src, c])?;
        }
    }
    if let Some(b) = ins.get(2).and_then(|v| v.as_ref()) {
        // Y[s] (m × ohw) += b (m × 1) · 1ᵀ (1 × ohw), for every sample
        let ones = ctx.rt.ones(ctx.stream, es, g.ohw)?;
        let mut gm = Gemm::contiguous(g.n, g.m, g.ohw, 1, false, false, t);
        (gm.stride_a, gm.stride_b, gm.beta) = (0, 0, 1.0);
        ctx.rt.gemm(ctx.stream, &gm, b.ptr, ones, y.ptr)?;
    }
    Ok(())
}

/// ConvGradX(dy, w, x_shape).
fn conv_grad_x(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (dy, w) = (input(node, ins, 0)?, input(node, ins, 1)?);
    let dx = &outs[0];
    let (t, sfx, es, g) = setup(node, dy.dtype, dx.shape, w.shape)?;
    if dx.numel() == 0 {
        return Ok(());
    }
    if dy.numel() == 0 || g.mg == 0 {
        return super::movement::zero(ctx, dx);
    }
    let per = g.chunk(g.col_sample() * es);
    let col = if g.direct { 0 } else { ctx.rt.scratch(per * g.col_sample() * es)? };
    for s0 in (0..g.n).step_by(per) {
        let s = per.min(g.n - s0);
        let dx0 = dx.ptr + (s0 * g.c * g.in_plane * es) as u64;
        for gi in 0..g.group {
            let (dst, dst_stride) = g.source(dx0, col, gi, es);
            let a = w.ptr + (gi * g.mg * g.rows * es) as u64;
            let b = dy.ptr + ((s0 * g.m + gi * g.mg) * g.ohw * es) as u64;
            batched_gemm(ctx, t, (g.rows, g.ohw, g.mg), true, false, s, [0, g.m * g.ohw, dst_stride], [a, b, dst])?;
        }
        if !g.direct {
            rearrange(ctx, &format!("col2im_{sfx}"), col, dx0, g.win, s * g.c * g.in_plane)?;
        }
    }
    Ok(())
}

/// ConvGradW(dy, x, w_shape).
fn conv_grad_w(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (dy, x) = (input(node, ins, 0)?, input(node, ins, 1)?);
    let dw = &outs[0];
    let (t, sfx, es, g) = setup(node, dy.dtype, x.shape, dw.shape)?;
    if dw.numel() == 0 {
        return Ok(());
    }
    if dy.numel() == 0 || g.n == 0 {
        return super::movement::zero(ctx, dw);
    }
    let part_sample = g.m * g.rows;
    let per = g.chunk((g.col_sample() + part_sample) * es);
    let scratch = ctx.rt.scratch(per * (g.col_sample() + part_sample) * es)?;
    let (col, part) = (scratch, scratch + (per * g.col_sample() * es) as u64);
    let ones = ctx.rt.ones(ctx.stream, es, per)?;
    for (chunk, s0) in (0..g.n).step_by(per).enumerate() {
        let s = per.min(g.n - s0);
        let x0 = x.ptr + (s0 * g.c * g.in_plane * es) as u64;
        if !g.direct {
            rearrange(ctx, &format!("im2col_{sfx}"), x0, col, g.win, s * g.col_sample())?;
        }
        for gi in 0..g.group {
            let (src, src_stride) = g.source(x0, col, gi, es);
            let a = dy.ptr + ((s0 * g.m + gi * g.mg) * g.ohw * es) as u64;
            let c = part + (gi * g.mg * g.rows * es) as u64;
            batched_gemm(ctx, t, (g.mg, g.rows, g.ohw), false, true, s, [g.m * g.ohw, src_stride, part_sample], [a, src, c])?;
        }
        // dW (1 × m·rows) (+)= 1ᵀ (1 × s) · P (s × m·rows)
        let mut sum = Gemm::contiguous(1, 1, part_sample, s, false, false, t);
        sum.beta = if chunk == 0 { 0.0 } else { 1.0 };
        ctx.rt.gemm(ctx.stream, &sum, ones, part, dw.ptr)?;
    }
    Ok(())
}

/// ConvGradB(dy): dy summed over every axis but the channel axis 1.
fn conv_grad_b(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let dy = input(node, ins, 0)?;
    let o = &outs[0];
    if o.numel() == 0 {
        return Ok(());
    }
    let reduced: Vec<bool> = (0..dy.shape.len()).map(|d| d != 1).collect();
    if dy.numel() > 0 && !super::reduce::reduces_anything(dy.shape, &reduced) {
        return super::movement::view_copy(node, ins, outs, ctx);
    }
    super::reduce::sum_over(node, ctx, dy, o.ptr, &reduced, 1.0)
}

pub fn register(t: &mut CudaTable) {
    t.add("Conv", conv);
    t.add("ConvGradX", conv_grad_x);
    t.add("ConvGradW", conv_grad_w);
    t.add("ConvGradB", conv_grad_b);
}
