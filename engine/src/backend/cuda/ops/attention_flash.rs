//! Which fused attentions run the FlashAttention-2-style kernels (kernels/attention_flash.cu),
//! and their launches: bf16 tensors with heads of 64 or 128, no mask or the computed causal one,
//! keys with d contiguous (layout BSHD), every row 16-byte aligned. Everything else keeps the
//! kernels of attention.rs. `ORTRAIN_FLASH_ATTENTION=0` turns them off (read at each call; a
//! plan replayed from a CUDA graph keeps what it was recorded with): for timing the two kernel
//! families against each other on a GPU.

use super::CudaCtx;
use crate::backend::cuda::abi::AttnShape;
use crate::backend::cuda::launch::{Grid, KArg};
use crate::error::Result;
use crate::ir::Node;
use crate::ops::attention::AttnLayout;
use crate::tensor::DType;

pub const ENV_FLASH: &str = "ORTRAIN_FLASH_ATTENTION";

/// Rows per block and the bf16 padding of a shared row (kernels/attention_mma_stage.cuh AM_TILE,
/// AM_PAD).
const TILE: usize = 64;
const PAD: usize = 8;

fn enabled() -> bool {
    std::env::var(ENV_FLASH).map_or(true, |v| v.trim() != "0")
}

/// An attention the flash kernels take: their instance ("d64", "d128") and the launch's shape.
pub struct Flash<'a> {
    hd: &'static str,
    l: &'a AttnLayout,
    a: AttnShape,
    causal: bool,
}

/// The flash kernels' launch for this attention, if they take it: `mask` says whether it has a
/// mask input, `causal` that the mask is the computed causal one, `ptrs` are every tensor the
/// kernels read or write through 16-byte accesses (Q, K, V, O or dO, and the gradients). The
/// scale must be positive: the kernels take the row maximum of the unscaled scores.
pub fn variant<'a>(
    node: &Node,
    l: &'a AttnLayout,
    a: &AttnShape,
    dtype: DType,
    mask: bool,
    causal: bool,
    ptrs: &[u64],
) -> Option<Flash<'a>> {
    let hd = match (l.d, l.dv) {
        (64, 64) => "d64",
        (128, 128) => "d128",
        _ => return None,
    };
    let row_strides = [a.q_t, a.k_s, a.v_s, a.o_t];
    let batch_strides = [a.q, a.k, a.v, a.o, a.gq, a.gk, a.gv];
    let strides_of_8 = row_strides.iter().chain(batch_strides.iter().flatten()).all(|s| s % 8 == 0);
    let aligned = ptrs.iter().all(|p| p % 16 == 0) && strides_of_8;
    let positive_scale = node.attrs.float("scale", 1.0).is_ok_and(|s| s > 0.0 && s.is_finite());
    let lengths = l.t > 0 && l.s > 0 && l.t < (1 << 30) && l.s < (1 << 30); // the kernels index rows with i32
    let ok = dtype == DType::BF16 && a.k_d == 1 && (!mask || causal) && lengths && aligned && positive_scale && enabled();
    ok.then_some(Flash { hd, l, a: *a, causal })
}

/// Dynamic shared memory: `tiles` bf16 tiles of 64 padded rows, and `floats` f32s after them.
fn smem(hd: usize, tiles: usize, floats: usize) -> u32 {
    (2 * tiles * TILE * (hd + PAD) + 4 * floats) as u32
}

impl Flash<'_> {
    fn grid(&self, node: &Node, rows: usize, shared: u32) -> Result<Grid> {
        let blocks = u32::try_from(self.l.batch_count() * rows.div_ceil(TILE)).map_err(|_| node.err("attention grid too large"))?;
        Ok(Grid { blocks, threads: 128, shared })
    }

    /// Attention(Q, K, V) -> (O, LSE).
    pub fn forward(&self, node: &Node, ins: [u64; 3], outs: [u64; 2], ctx: &mut CudaCtx) -> Result<()> {
        let scale = node.attrs.float("scale", 1.0)?;
        let p = KArg::Ptr;
        let args = [
            p(ins[0]),
            p(ins[1]),
            p(ins[2]),
            p(outs[0]),
            p(outs[1]),
            KArg::AttnShape(self.a),
            KArg::F32(scale),
            KArg::I32(self.causal as i32),
        ];
        let g = self.grid(node, self.l.t, smem(self.l.d, 5, 0))?;
        ctx.rt.launch(ctx.stream, &format!("attention_flash_fwd_{}_bf16", self.hd), g, &args)
    }

    /// AttentionGrad(dO, Q, K, V, -, O, LSE) -> (dQ, dK, dV): the dQ kernel (which writes
    /// Δ = Σ dO·O per row into the runtime's scratch), then the dK/dV kernel that reads it, on
    /// one stream. `ins`: dO, Q, K, V, O, LSE; `outs`: dQ, dK, dV.
    pub fn backward(&self, node: &Node, ins: [u64; 6], outs: [u64; 3], ctx: &mut CudaCtx) -> Result<()> {
        let (l, hd) = (self.l, self.hd);
        let scale = KArg::F32(node.attrs.float("scale", 1.0)?);
        let delta = ctx.rt.scratch(4 * l.batch_count() * l.t)?;
        let [dout, q, k, v, o, lse] = ins.map(KArg::Ptr);
        let (c, shape, p) = (KArg::I32(self.causal as i32), KArg::AttnShape(self.a), KArg::Ptr);
        let dq = [dout, q, k, v, o, lse, p(delta), p(outs[0]), shape, scale, c];
        ctx.rt.launch(ctx.stream, &format!("attention_flash_bwd_dq_{hd}_bf16"), self.grid(node, l.t, smem(l.d, 6, 0))?, &dq)?;
        let dkv = [dout, q, k, v, lse, p(delta), p(outs[1]), p(outs[2]), shape, scale, c];
        ctx.rt.launch(ctx.stream, &format!("attention_flash_bwd_dkv_{hd}_bf16"), self.grid(node, l.s, smem(l.d, 6, 4 * TILE))?, &dkv)
    }
}
