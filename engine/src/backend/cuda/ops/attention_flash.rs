//! Which fused attentions run the FlashAttention-2-style kernels (kernels/attention_flash.cuh),
//! and their launches: bf16 or f16 tensors with heads of 32, 64, 80, 96 or 128, no mask or the computed
//! causal one (with or without key padding: attention.rs says when; with or without the
//! probabilities' dropout: kernels/attention_flash_dropout.cu), keys with d contiguous
//! (layout BSHD), every row 16-byte aligned. Everything else
//! keeps the kernels of attention.rs. `ORTRAIN_FLASH_ATTENTION=0` turns them off (read at each call; a
//! plan replayed from a CUDA graph keeps what it was recorded with): for timing the two kernel
//! families against each other on a GPU. Heads of 64 run in blocks of 128 query rows (forward,
//! dQ) or keys (dK/dV), 32 a warp, so that each fragment read from shared memory serves two row
//! tiles; `ORTRAIN_FLASH_ROWS=64` gives them blocks of 64 (16 a warp), for timing one against
//! the other. Heads of 32 always run in blocks of 128, heads of 80, 96 and 128 in blocks of 64.

use super::CudaCtx;
use crate::backend::cuda::abi::AttnShape;
use crate::backend::cuda::launch::{Grid, KArg};
use crate::backend::cuda::registry::dtype_suffix;
use crate::error::Result;
use crate::ir::Node;
use crate::ops::attention::AttnLayout;
use crate::tensor::DType;

pub const ENV_FLASH: &str = "ORTRAIN_FLASH_ATTENTION";
pub const ENV_FLASH_ROWS: &str = "ORTRAIN_FLASH_ROWS";

/// Rows per block and the 16-bit padding of a shared row (kernels/attention_mma_stage.cuh AM_TILE,
/// AM_PAD).
const TILE: usize = 64;
const PAD: usize = 8;

fn enabled() -> bool {
    std::env::var(ENV_FLASH).map_or(true, |v| v.trim() != "0")
}

/// Query rows per forward and dQ block, keys per dK/dV block: 128 for heads of 64 unless
/// `ORTRAIN_FLASH_ROWS` says 64; 128 for heads of 32 (their only instance); 64 for heads of 80
/// and more (two row tiles a warp would not fit the registers).
fn block_rows(hd: usize) -> std::result::Result<usize, String> {
    let rows = rows_setting(std::env::var(ENV_FLASH_ROWS).ok().as_deref())?;
    Ok(match hd {
        32 => 2 * TILE,
        64 => rows,
        _ => TILE,
    })
}

/// The value of `ORTRAIN_FLASH_ROWS` (None: unset) as block rows.
fn rows_setting(value: Option<&str>) -> std::result::Result<usize, String> {
    match value.map(str::trim) {
        None | Some("") | Some("128") => Ok(128),
        Some("64") => Ok(64),
        Some(other) => Err(format!("{ENV_FLASH_ROWS}={other:?}: allowed values are 64 and 128")),
    }
}

/// An attention the flash kernels take: their instance ("d32" .. "d128") and the launch's shape.
pub struct Flash<'a> {
    hd: &'static str,
    dtype: &'static str,
    l: &'a AttnLayout,
    a: AttnShape,
    pub causal: bool,
}

/// The flash kernels' instance for this attention's head size, if they have one.
fn instance(l: &AttnLayout) -> Option<&'static str> {
    match (l.d, l.dv) {
        (32, 32) => Some("d32"),
        (64, 64) => Some("d64"),
        (80, 80) => Some("d80"),
        (96, 96) => Some("d96"),
        (128, 128) => Some("d128"),
        _ => None,
    }
}

/// Whether the flash kernels have an instance for this attention's head size (whether they
/// take it depends on the rest: [`variant`]).
pub fn takes_heads(l: &AttnLayout) -> bool {
    instance(l).is_some()
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
    let hd = instance(l)?;
    let row_strides = [a.q_t, a.k_s, a.v_s, a.o_t];
    let batch_strides = [a.q, a.k, a.v, a.o, a.gq, a.gk, a.gv];
    let strides_of_8 = row_strides.iter().chain(batch_strides.iter().flatten()).all(|s| s % 8 == 0);
    let aligned = ptrs.iter().all(|p| p % 16 == 0) && strides_of_8;
    let positive_scale = node.attrs.float("scale", 1.0).is_ok_and(|s| s > 0.0 && s.is_finite());
    let lengths = l.t > 0 && l.s > 0 && l.t < (1 << 30) && l.s < (1 << 30); // the kernels index rows with i32
    let half = matches!(dtype, DType::BF16 | DType::F16);
    let ok = half && a.k_d == 1 && (!mask || causal) && lengths && aligned && positive_scale && enabled();
    ok.then_some(Flash { hd, dtype: dtype_suffix(dtype), l, a: *a, causal })
}

/// Dynamic shared memory: `tiles` 16-bit tiles of 64 padded rows, and `floats` f32s after them.
fn smem(hd: usize, tiles: usize, floats: usize) -> u32 {
    (2 * tiles * TILE * (hd + PAD) + 4 * floats) as u32
}

impl Flash<'_> {
    fn grid(&self, node: &Node, rows: usize, block_rows: usize, shared: u32) -> Result<Grid> {
        let blocks = u32::try_from(self.l.batch_count() * rows.div_ceil(block_rows)).map_err(|_| node.err("attention grid too large"))?;
        Ok(Grid { blocks, threads: 128, shared })
    }

    /// A kernel's name (`kind` "fwd", "bwd_dq" or "bwd_dkv"; `padded`: the key-padding
    /// instance, kernels/attention_flash_padded.cu; with the launch shape's dropout, the
    /// instances of kernels/attention_flash_dropout.cu), its block rows (or keys) and the number
    /// of 64-row tiles each of its whole-block operands takes in shared memory.
    fn row_kernel(&self, node: &Node, kind: &str, padded: bool) -> Result<(String, usize, usize)> {
        let rows = block_rows(self.l.d).map_err(|e| node.err(e))?;
        let suffix = if rows == TILE { "" } else { "r128" };
        let kp = if padded { "_kp" } else { "" };
        let dp = if self.a.drop_key != 0 { "_dp" } else { "" };
        Ok((format!("attention_flash_{kind}_{}{suffix}{kp}{dp}_{}", self.hd, self.dtype), rows, rows / TILE))
    }

    /// Attention(Q, K, V) -> (O, LSE); `kp`: the key-padding flags, read through the launch
    /// shape's mask strides (the kernels read no mask).
    pub fn forward(&self, node: &Node, ins: [u64; 3], outs: [u64; 2], kp: Option<u64>, ctx: &mut CudaCtx) -> Result<()> {
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
            KArg::Ptr(kp.unwrap_or(0)),
        ];
        let (name, rows, q_tiles) = self.row_kernel(node, "fwd", kp.is_some())?;
        let g = self.grid(node, self.l.t, rows, smem(self.l.d, q_tiles + 4, 0))?; // Q, K and V twice
        ctx.rt.launch(ctx.stream, &name, g, &args)
    }

    /// AttentionGrad(dO, Q, K, V, -, O, LSE) -> (dQ, dK, dV): the dQ kernel (which writes
    /// Δ = Σ dO·O per row into the runtime's scratch), then the dK/dV kernel that reads it, on
    /// one stream. `ins`: dO, Q, K, V, O, LSE; `outs`: dQ, dK, dV.
    pub fn backward(&self, node: &Node, ins: [u64; 6], outs: [u64; 3], kp: Option<u64>, ctx: &mut CudaCtx) -> Result<()> {
        let l = self.l;
        let scale = KArg::F32(node.attrs.float("scale", 1.0)?);
        let delta = ctx.rt.scratch(4 * l.batch_count() * l.t)?;
        let [dout, q, k, v, o, lse] = ins.map(KArg::Ptr);
        let (c, shape, p) = (KArg::I32(self.causal as i32), KArg::AttnShape(self.a), KArg::Ptr);
        let padded = kp.is_some();
        let kp = p(kp.unwrap_or(0));
        let dq = [dout, q, k, v, o, lse, p(delta), p(outs[0]), shape, scale, c, kp];
        let (name, rows, q_tiles) = self.row_kernel(node, "bwd_dq", padded)?;
        let g = self.grid(node, l.t, rows, smem(l.d, 2 * q_tiles + 4, 0))?; // Q, dO, K and V twice
        ctx.rt.launch(ctx.stream, &name, g, &dq)?;
        let dkv = [dout, q, k, v, lse, p(delta), p(outs[1]), p(outs[2]), shape, scale, c, kp];
        let (name, keys, k_tiles) = self.row_kernel(node, "bwd_dkv", padded)?;
        let g = self.grid(node, l.s, keys, smem(l.d, 2 * k_tiles + 4, 4 * TILE))?; // K, V, Q and dO twice, LSE and Δ twice
        ctx.rt.launch(ctx.stream, &name, g, &dkv)
    }
}

#[cfg(test)]
mod tests {
    use super::rows_setting;

    #[test]
    fn flash_rows_setting_is_64_or_128_and_names_itself_otherwise() {
        assert_eq!(rows_setting(None), Ok(128));
        assert_eq!(rows_setting(Some(" 64 ")), Ok(64));
        assert_eq!(rows_setting(Some("128")), Ok(128));
        let err = rows_setting(Some("96")).unwrap_err();
        assert!(err.contains("ORTRAIN_FLASH_ROWS=\"96\"") && err.contains("64 and 128"), "{err}");
    }
}
