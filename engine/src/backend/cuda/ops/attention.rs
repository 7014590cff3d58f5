//! Attention and AttentionGrad: the fused forward (online softmax, only LSE saved) and the two
//! backward kernels (dQ; dKt and dV), head sizes up to 128. With D = Dv = 64 or 128, bf16 and
//! f16 tensors (16-bit plans) and f32 ones in sessions whose f32 matmuls run at bf16 or f16
//! precision (`F32Mode::Bf16`, `F32Mode::F16`) get the tensor-core kernels
//! (kernels/attention_mma.cu: 64-row tiles, mma.sync with bf16 or f16 operands, f32
//! accumulation); other f32 tensors the SIMT f32 kernels (kernels/attention.cu: 32-row tiles),
//! exact as the CPU's; other 16-bit tensors (other head sizes) those kernels on f32 copies
//! (widen.rs). bf16 and f16 tensors in layout BSHD with no mask or the computed causal one, with
//! heads of 32, 64, 80, 96 or 128, run the FlashAttention-2-style kernels instead
//! (attention_flash.rs).
//! Layout BS3HD (Q, K, V packed in one tensor) is layout BSHD's strides with K and V starting
//! further along each row: every kernel takes it through its addresses (`operands`, `gradients`).
//! Key padding (an attention_mask's flags, ops/attention.rs): the flash kernels take it with the
//! computed causal mask where the mask hides its keys with the padding's own value (Hugging
//! Face's finfo.min, both: GPT-2), and without a mask where the mask hides nothing (BERT);
//! otherwise the mask it makes with the padding is written to the
//! runtime's mask memory and the kernels that read masks run on that.
//! The probabilities' dropout (attribute `dropout`, the stream key an input: ops/attention.rs)
//! rides in the launch shape (`AttnShape::drop_key`): every kernel family regenerates the keep
//! factors of the Dropout it replaced (kernels/attention.cuh `att_drop`; the flash kernels'
//! instances with it are kernels/attention_flash_dropout.cu).

use super::{attention_flash as flash, causal_mask, input, widen, CudaCtx, CudaTable, DView};
use crate::backend::cuda::abi::AttnShape;
use crate::backend::cuda::blas::F32Mode;
use crate::backend::cuda::launch::{Grid, KArg};
use crate::backend::cuda::registry::dtype_suffix;
use crate::error::Result;
use crate::ir::Node;
use crate::ops::attention::{
    attention_layout, dropout_key_input, dropout_ratio, key_padding_input, key_padding_strides, AttnLayout, CUDA_MAX_HEAD_SIZE,
};
use crate::ops::util::broadcast_shapes;
use crate::tensor::DType;

const TILE: usize = 32;
/// Row of a transposed tile, and of the probability tile (kernels/attention.cu ATT_LD, ATT_PLD).
const LD: usize = 33;
const PLD: usize = 36;
const THREADS: u32 = 128;

/// Shared-memory floats of regions laid out one after another, each 16-byte aligned (ATT_A4).
fn floats(regions: &[usize]) -> usize {
    regions.iter().map(|r| r.div_ceil(4) * 4).sum()
}

/// A node's key padding: the flags' address, and the launch shape of the flash kernels, which
/// read the flags through the mask's strides (`m`, `mask_s`; they read no mask).
struct KeyPad {
    ptr: u64,
    shape: AttnShape,
    value: f32,
}

/// Layout, kernel-side shape, the mask's address and the key padding (if any) of a node whose
/// Q, Kt, V, mask start at input `first`.
fn setup(node: &Node, ins: &[Option<DView>], first: usize) -> Result<(AttnLayout, AttnShape, u64, Option<KeyPad>)> {
    let (q, kt, v) = (input(node, ins, first)?, input(node, ins, first + 1)?, input(node, ins, first + 2)?);
    let mask = ins.get(first + 3).and_then(|m| m.as_ref());
    let (drop_key, drop_p, drop_scale) = dropout(node, ins)?;
    if !matches!(q.dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(node.err(format!("the CUDA attention kernels take f32, bf16 or fp16 tensors, got {}", q.dtype.name())));
    }
    let l = attention_layout(node, q.shape, kt.shape, v.shape, mask.map(|m| m.shape))?;
    if l.d > CUDA_MAX_HEAD_SIZE || l.dv > CUDA_MAX_HEAD_SIZE {
        return Err(
            node.err(format!("the CUDA attention kernels take head sizes up to {CUDA_MAX_HEAD_SIZE}, got D = {}, Dv = {}", l.d, l.dv))
        );
    }
    if l.batch.len() > 4 {
        return Err(node.err(format!("the CUDA attention kernels take up to 4 batch dims, got {:?}", l.batch)));
    }
    let pad = 4 - l.batch.len();
    let four = |v: &[usize], fill: i64| {
        let mut a = [fill; 4];
        for (i, &x) in v.iter().enumerate() {
            a[pad + i] = x as i64;
        }
        a
    };
    let (mb, mt, ms) = l.m.clone().unwrap_or((vec![0; l.batch.len()], 0, 0));
    let r = l.rows;
    let shape = AttnShape {
        dims: four(&l.batch, 1),
        q: four(&l.q, 0),
        k: four(&l.k, 0),
        v: four(&l.v, 0),
        m: four(&mb, 0),
        o: four(&l.o, 0),
        gq: four(&l.gq, 0),
        gk: four(&l.gk, 0),
        gv: four(&l.gv, 0),
        t: l.t as i64,
        s: l.s as i64,
        d: l.d as i64,
        dv: l.dv as i64,
        mask_t: mt as i64,
        mask_s: ms as i64,
        q_t: r.q_t as i64,
        k_s: r.k_s as i64,
        k_d: r.k_d as i64,
        v_s: r.v_s as i64,
        o_t: r.o_t as i64,
        drop_key,
        drop_p,
        drop_scale,
    };
    let kp = match key_padding_input(&node.op_type).and_then(|i| ins.get(i)).and_then(|x| x.as_ref()) {
        Some(kp) => {
            let (batch, s) = key_padding_strides(node, &l, kp.shape)?;
            let value = node.attrs.float("padding_value", f32::NEG_INFINITY)?;
            Some(KeyPad { ptr: kp.ptr, shape: AttnShape { m: four(&batch, 0), mask_t: 0, mask_s: s as i64, ..shape }, value })
        }
        None => None,
    };
    Ok((l, shape, mask.map_or(0, |m| m.ptr), kp))
}

/// The kernels' dropout operands of a node (AttnShape `drop_key`, `drop_p`, `drop_scale`): the
/// stream key's address, the ratio and 1 / (1 − ratio) in f32, as kernels/dropout.cu scales a
/// kept f32 element; (0, 0, 1) without dropout.
fn dropout(node: &Node, ins: &[Option<DView>]) -> Result<(u64, f32, f32)> {
    let ratio = dropout_ratio(node)? as f32;
    if ratio == 0.0 {
        return Ok((0, 0.0, 1.0));
    }
    match dropout_key_input(&node.op_type).and_then(|i| ins.get(i)).and_then(|k| k.as_ref()) {
        Some(k) if k.dtype == DType::I64 && k.numel() == 1 && k.ptr != 0 => Ok((k.ptr, ratio, 1.0 / (1.0 - ratio))),
        Some(k) => Err(node.err(format!("the dropout key is {} {:?}, expected one int64 on the GPU", k.dtype.name(), k.shape))),
        None => Err(node.err("attribute dropout needs the stream key input (DropoutKey's output)")),
    }
}

/// Whether the flash kernels take this key padding, and if so whether with the causal mask
/// (Some(true)) or none (Some(false)): the padding's value is a finite one at or below
/// finfo.min's neighbourhood (a query with no visible key then has every score equal: the
/// kernels give it equal weights over all keys, as PyTorch's softmax does), and the mask at
/// input `i` is absent, a constant that hides nothing (BERT's, once its padding is taken
/// apart), or a causal constant of this self-attention hiding its keys with the padding's own
/// value (GPT-2's).
fn flash_padding(ins: &[Option<DView>], i: usize, l: &AttnLayout, kp: &KeyPad) -> Option<bool> {
    if !(kp.value.is_finite() && kp.value <= causal_mask::MASKED_MIN) {
        return None;
    }
    let Some(mask) = ins.get(i).and_then(|m| m.as_ref()) else { return Some(false) };
    let host = mask.host?;
    if causal_mask::hides_nothing(host) {
        return Some(false);
    }
    let hidden = if l.t == l.s { causal_mask::hidden_value(host, l.t) } else { None };
    hidden.is_some_and(|v| v.to_bits() == kp.value.to_bits()).then_some(true)
}

/// The additive mask a node's key padding makes with its mask (input `mask_at`; none: 0),
/// written to the runtime's mask memory: where the flag is false the padding's value, elsewhere
/// the mask's. Returns its element type, shape and address.
fn padded_mask(
    node: &Node,
    ins: &[Option<DView>],
    mask_at: usize,
    kp_at: usize,
    value: f32,
    ctx: &mut CudaCtx,
) -> Result<(DType, Vec<usize>, u64)> {
    let flags = input(node, ins, kp_at)?;
    let mask = ins.get(mask_at).and_then(|m| m.as_ref());
    let dtype = mask.map_or(DType::F32, |m| m.dtype);
    let shape = match mask {
        Some(m) => broadcast_shapes(node, &[m.shape, flags.shape])?,
        None => flags.shape.to_vec(),
    };
    let bytes = shape.iter().product::<usize>() * dtype.size();
    // the mask, then the padding's value and a zero (for no mask) in its type
    let at = bytes.div_ceil(256) * 256;
    let base = ctx.rt.mask_scratch(at + 2 * dtype.size())?;
    let (fill, zero) = (base + at as u64, base + (at + dtype.size()) as u64);
    let (kernel, bits) = match dtype {
        DType::F32 => ("fill_u32", value.to_bits() as u64),
        DType::BF16 => ("fill_u16", half::bf16::from_f32(value).to_bits() as u64),
        DType::F16 => ("fill_u16", half::f16::from_f32(value).to_bits() as u64),
        other => return Err(node.err(format!("a {} attention mask with key padding is not supported (f32, bf16, fp16)", other.name()))),
    };
    let grid = ctx.rt.elementwise_grid(2);
    ctx.rt.launch(ctx.stream, kernel, grid, &[KArg::Ptr(fill), KArg::I64(1), KArg::U64(bits)])?;
    ctx.rt.launch(ctx.stream, kernel, grid, &[KArg::Ptr(zero), KArg::I64(1), KArg::U64(0)])?;
    let scalar = |ptr| DView { dtype, shape: &[], ptr, host: None };
    let out = DView { dtype, shape: &shape, ptr: base, host: None };
    let (zero_view, fill_view) = (scalar(zero), scalar(fill));
    super::elementwise::where_into(node, flags, mask.unwrap_or(&zero_view), &fill_view, &out, ctx)?;
    Ok((dtype, shape, base))
}

/// A grid of batch · ceil(rows / tile) blocks with `bytes` of dynamic shared memory.
fn grid_of(node: &Node, l: &AttnLayout, rows: usize, tile: usize, bytes: usize) -> Result<Grid> {
    let blocks = u32::try_from(l.batch_count() * rows.div_ceil(tile)).map_err(|_| node.err("attention grid too large"))?;
    Ok(Grid { blocks, threads: THREADS, shared: bytes as u32 })
}

/// The SIMT kernels' grid: 32-row tiles, `floats` f32s of dynamic shared memory.
fn grid(node: &Node, l: &AttnLayout, rows: usize, floats: usize) -> Result<Grid> {
    grid_of(node, l, rows, TILE, floats * 4)
}

/// What explain() says of an Attention node's kernels (CudaRuntime::note_attention).
pub mod path {
    pub const FLASH: &str = "flash kernels, no mask";
    pub const FLASH_CAUSAL: &str = "flash kernels, causal mask computed";
    pub const MMA: &str = "tensor-core kernels, no mask";
    pub const MMA_CAUSAL: &str = "tensor-core kernels, causal mask computed";
    /// The mask is read from memory: a mask computed at run time (from an input such as
    /// Hugging Face's attention_mask) or a constant that is not causal.
    pub const MMA_READ: &str = "tensor-core kernels, mask read from memory";
    pub const FLASH_PADDED: &str = "flash kernels, causal mask computed, key padding from the input";
    /// No mask (or one that hides nothing) but key padding: Hugging Face's BERT with an
    /// attention_mask.
    pub const FLASH_KEY_PADDING: &str = "flash kernels, key padding from the input";
    /// Key padding whose mask the flash kernels do not take (one that is not causal, another
    /// masked value, or heads or types they do not take): the mask made from both is read.
    pub const PADDED_READ: &str = "mask made from the key padding and read from memory";
    pub const SIMT: &str = "f32 CUDA-core kernels";
    pub const WIDENED: &str = "f32 CUDA-core kernels on f32 copies of the 16-bit tensors";
}

/// Rows (queries or keys) per block of the tensor-core kernels, and the 16-bit padding of their
/// shared rows (kernels/attention_mma.cu AM_TILE, AM_PAD).
const MMA_TILE: usize = 64;
const MMA_PAD: usize = 8;

/// Which tensor-core kernel instance serves this head size, element type and mask type (f32
/// in every instance) in this session, if any: its name's end ("d64_bf16", "d128_f32f16").
fn mma_variant(l: &AttnLayout, ctx: &CudaCtx, dtype: DType, mask: Option<DType>) -> Option<String> {
    let tensors = match (dtype, ctx.f32_mode) {
        (DType::BF16 | DType::F16, _) => dtype_suffix(dtype),
        (DType::F32, F32Mode::Bf16) => "f32",
        (DType::F32, F32Mode::F16) => "f32f16",
        _ => return None,
    };
    mma_instance(l, tensors, mask)
}

fn mma_instance(l: &AttnLayout, tensors: &str, mask: Option<DType>) -> Option<String> {
    if l.d != l.dv || mask.is_some_and(|m| m != DType::F32) {
        return None;
    }
    match l.d {
        64 | 128 => Some(format!("d{}_{tensors}", l.d)),
        _ => None,
    }
}

/// The mask address the kernels get and, where kernels that can compute the causal mask may
/// run (`computes`: the tensor-core kernels, or the flash kernels' head sizes on 16-bit tensors),
/// whether the mask at input `i` is a constant causal mask (ops/causal_mask.rs) of this
/// self-attention, which they compute instead of reading (then no mask address): their last
/// argument `causal`. An error where a kernel would read a mask constant that was not uploaded
/// ([`computes_mask`] and this disagree: a bug, never a null read).
fn mask_or_causal(node: &Node, ins: &[Option<DView>], i: usize, l: &AttnLayout, computes: bool, mask: u64) -> Result<(u64, Option<bool>)> {
    let host = ins.get(i).and_then(|m| m.as_ref()).and_then(|m| m.host);
    let causal = computes && l.t == l.s && host.is_some_and(|h| causal_mask::is_causal(h, l.t));
    if !causal && mask == 0 && host.is_some() {
        return Err(node.err("the causal mask constant was left on the host as computed, but this attention reads it"));
    }
    Ok((if causal { 0 } else { mask }, computes.then_some(causal)))
}

/// Whether an Attention or AttentionGrad step computes its mask, the constant `mask`, in every
/// session, so that the constant need not be on the GPU (exec/cuda.rs keeps such masks on the
/// host): no key padding, 16-bit Q, K, V (whose tensor-core kernels do not depend on the
/// session's f32 mode), heads the tensor-core kernels take, self-attention, and the constant
/// found causal.
/// `types`: Q, Kt, V and the mask as (element type, shape).
pub fn computes_mask(node: &Node, types: [(DType, &[usize]); 4], mask: &std::sync::Arc<crate::tensor::Tensor>) -> bool {
    // with key padding the mask may be made with it on the GPU (`padded_mask`)
    if key_padding_input(&node.op_type).is_some_and(|i| node.input(i).is_some()) {
        return false;
    }
    let [(dtype, q), (_, kt), (_, v), (mask_type, m)] = types;
    let Ok(l) = attention_layout(node, q, kt, v, Some(m)) else { return false };
    dtype.is_half() && mma_instance(&l, dtype_suffix(dtype), Some(mask_type)).is_some() && l.t == l.s && causal_mask::is_causal(mask, l.t)
}

/// The device address of input `i` (0 where absent).
fn ptr_of(ins: &[Option<DView>], i: usize) -> u64 {
    ins.get(i).and_then(|x| x.as_ref()).map_or(0, |x| x.ptr)
}

/// Device addresses of Q, Kt, V (inputs `first`..`first + 2`): where each starts in its tensor
/// (layout BS3HD: K and V further along the one tensor's rows than Q).
fn operands(ins: &[Option<DView>], first: usize, l: &AttnLayout, dtype: DType) -> [u64; 3] {
    [0, 1, 2].map(|i| ptr_of(ins, first + i) + (l.starts[i] * dtype.size()) as u64)
}

/// Device addresses of dQ, dKt, dV: AttentionGrad's three outputs, or in layout BS3HD its one
/// output at Q's, K's and V's offsets.
fn gradients(node: &Node, outs: &[DView], l: &AttnLayout, dtype: DType) -> Result<[u64; 3]> {
    let packed = l.starts != [0; 3];
    let out = |i: usize| outs.get(if packed { 0 } else { i }).map(|o| o.ptr + (l.starts[i] * dtype.size()) as u64);
    match [out(0), out(1), out(2)] {
        [Some(dq), Some(dk), Some(dv)] => Ok([dq, dk, dv]),
        _ => Err(node.err(format!("AttentionGrad has {} outputs, expected {}", outs.len(), if packed { 1 } else { 3 }))),
    }
}

/// The element type of the mask at input `i`, if there is one.
fn mask_type(ins: &[Option<DView>], i: usize) -> Option<DType> {
    ins.get(i).and_then(|m| m.as_ref()).map(|m| m.dtype)
}

/// Dynamic shared memory of a tensor-core kernel: `rows_tiles` 16-bit tiles of 64 rows of HD
/// (padded) and `cols_tiles` of HD rows of 64 (padded).
fn mma_smem(hd: usize, rows_tiles: usize, cols_tiles: usize) -> usize {
    2 * (rows_tiles * MMA_TILE * (hd + MMA_PAD) + cols_tiles * hd * (MMA_TILE + MMA_PAD))
}

/// Runs `kernel` (attention or attention_grad) on the node's inputs without its key padding at
/// `kp_at`, with the mask at `mask_at` replaced by the one made from the padding
/// ([`padded_mask`]).
#[allow(clippy::too_many_arguments)]
fn with_padded_mask(
    node: &Node,
    ins: &[Option<DView>],
    outs: &[DView],
    ctx: &mut CudaCtx,
    mask_at: usize,
    kp_at: usize,
    value: f32,
    kernel: super::CudaKernel,
) -> Result<()> {
    let (dtype, shape, ptr) = padded_mask(node, ins, mask_at, kp_at, value, ctx)?;
    let mut plain: Vec<Option<DView>> = ins.to_vec();
    plain.resize(plain.len().max(kp_at + 1), None);
    plain[kp_at] = None; // the dropout's key, after it, stays
    plain[mask_at] = Some(DView { dtype, shape: &shape, ptr, host: None });
    kernel(node, &plain, outs, ctx)?;
    if ctx.rt.attention_path(node) == Some(path::MMA_READ) {
        ctx.rt.note_attention(node, path::PADDED_READ);
    }
    Ok(())
}

fn attention(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (l, shape, mask, kp) = setup(node, ins, 0)?;
    let dtype = input(node, ins, 0)?.dtype;
    if let Some(kp) = &kp {
        let [q, k, v] = operands(ins, 0, &l, dtype);
        let flash = flash_padding(ins, 3, &l, kp)
            .and_then(|causal| flash::variant(node, &l, &kp.shape, dtype, causal, causal, &[q, k, v, outs[0].ptr]));
        if let Some(f) = flash {
            ctx.rt.note_attention(node, if f.causal { path::FLASH_PADDED } else { path::FLASH_KEY_PADDING });
            return f.forward(node, [q, k, v], [outs[0].ptr, outs[1].ptr], Some(kp.ptr), ctx);
        }
        return with_padded_mask(node, ins, outs, ctx, 3, 4, kp.value, attention);
    }
    let mma = mma_variant(&l, ctx, dtype, mask_type(ins, 3));
    let flash_heads = dtype.is_half() && flash::takes_heads(&l);
    let (mask, causal) = mask_or_causal(node, ins, 3, &l, mma.is_some() || flash_heads, mask)?;
    if l.batch_count() == 0 || l.t == 0 {
        return Ok(());
    }
    let [q, k, v] = operands(ins, 0, &l, dtype);
    let tensors = [q, k, v, outs[0].ptr];
    let has_mask = mask_type(ins, 3).is_some();
    if let Some(f) = flash::variant(node, &l, &shape, dtype, has_mask, causal == Some(true), &tensors) {
        ctx.rt.note_attention(node, if has_mask { path::FLASH_CAUSAL } else { path::FLASH });
        return f.forward(node, [q, k, v], [outs[0].ptr, outs[1].ptr], None, ctx);
    }
    if dtype.is_half() && mma.is_none() {
        widen::widened(node, ins, outs, ctx, attention)?;
        ctx.rt.note_attention(node, path::WIDENED);
        return Ok(());
    }
    ctx.rt.note_attention(
        node,
        match (&mma, causal == Some(true), has_mask) {
            (None, ..) => path::SIMT,
            (Some(_), true, _) => path::MMA_CAUSAL,
            (Some(_), false, true) => path::MMA_READ,
            (Some(_), false, false) => path::MMA,
        },
    );
    let (d, dv) = (l.d, l.dv);
    let (kernel, g) = match mma {
        Some(v) => (format!("attention_mma_fwd_{v}"), grid_of(node, &l, l.t, MMA_TILE, mma_smem(d, 2, 1))?),
        None => ("attention_fwd_f32".to_string(), grid(node, &l, l.t, floats(&[TILE * d, (d * LD).max(TILE * dv), TILE * PLD]))?),
    };
    let scale = node.attrs.float("scale", 1.0)?;
    let guard = node.attrs.int("nan_guard", 0)? as i32;
    let mut args = vec![
        KArg::Ptr(q),
        KArg::Ptr(k),
        KArg::Ptr(v),
        KArg::Ptr(mask),
        KArg::Ptr(outs[0].ptr),
        KArg::Ptr(outs[1].ptr),
        KArg::AttnShape(shape),
        KArg::F32(scale),
        KArg::I32(guard),
    ];
    args.extend(causal.map(|c| KArg::I32(c as i32)));
    ctx.rt.launch(ctx.stream, &kernel, g, &args)
}

/// AttentionGrad(dO, Q, Kt, V, M?, O, LSE, KP?) -> (dQ, dKt, dV).
fn attention_grad(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (l, shape, mask, kp) = setup(node, ins, 1)?;
    let dtype = input(node, ins, 1)?.dtype;
    if let Some(kp) = &kp {
        // the forward's choice: the flash forward's LSE of a query with no visible key (ln S,
        // for equal weights) is what the flash backward reads, not what the others would
        let [q, k, v] = operands(ins, 1, &l, dtype);
        let [dq, dk, dv] = gradients(node, outs, &l, dtype)?;
        let (dout, o, lse) = (ptr_of(ins, 0), ptr_of(ins, 5), ptr_of(ins, 6));
        let tensors = [dout, q, k, v, o, dq, dk, dv];
        let flash = flash_padding(ins, 4, &l, kp).and_then(|causal| flash::variant(node, &l, &kp.shape, dtype, causal, causal, &tensors));
        if let Some(f) = flash {
            return f.backward(node, [dout, q, k, v, o, lse], [dq, dk, dv], Some(kp.ptr), ctx);
        }
        return with_padded_mask(node, ins, outs, ctx, 4, 7, kp.value, attention_grad);
    }
    let mma = mma_variant(&l, ctx, dtype, mask_type(ins, 4));
    let flash_heads = dtype.is_half() && flash::takes_heads(&l);
    let (mask, causal) = mask_or_causal(node, ins, 4, &l, mma.is_some() || flash_heads, mask)?;
    if l.batch_count() == 0 {
        return Ok(());
    }
    let ptr = |i: usize| ptr_of(ins, i);
    let [q, k, v] = operands(ins, 1, &l, dtype);
    let [dq, dk, dv_] = gradients(node, outs, &l, dtype)?;
    let tensors = [ptr(0), q, k, v, ptr(5), dq, dk, dv_];
    if let Some(f) = flash::variant(node, &l, &shape, dtype, mask_type(ins, 4).is_some(), causal == Some(true), &tensors) {
        return f.backward(node, [ptr(0), q, k, v, ptr(5), ptr(6)], [dq, dk, dv_], None, ctx);
    }
    if dtype.is_half() && mma.is_none() {
        return widen::widened(node, ins, outs, ctx, attention_grad);
    }
    let (d, dv, wide) = (l.d, l.dv, l.d.max(l.dv));
    let p = |i: usize| KArg::Ptr(ptr(i));
    let scale = KArg::F32(node.attrs.float("scale", 1.0)?);
    let common = [p(0), KArg::Ptr(q), KArg::Ptr(k), KArg::Ptr(v), KArg::Ptr(mask), p(5), p(6)];
    if l.t > 0 {
        let (kernel, g) = match &mma {
            Some(v) => (format!("attention_mma_bwd_dq_{v}"), grid_of(node, &l, l.t, MMA_TILE, mma_smem(d, 4, 1))?),
            None => (
                "attention_bwd_dq_f32".to_string(),
                grid(node, &l, l.t, floats(&[TILE * d, TILE * dv, (wide * LD).max(TILE * (d + 1)), TILE * PLD]))?,
            ),
        };
        let mut args = common.to_vec();
        args.extend([KArg::Ptr(dq), KArg::AttnShape(shape), scale]);
        args.extend(causal.map(|c| KArg::I32(c as i32)));
        ctx.rt.launch(ctx.stream, &kernel, g, &args)?;
    }
    if l.s > 0 {
        let (kernel, g) = match &mma {
            Some(v) => (format!("attention_mma_bwd_dkv_{v}"), grid_of(node, &l, l.s, MMA_TILE, mma_smem(d, 4, 2))?),
            None => (
                "attention_bwd_dkv_f32".to_string(),
                grid(node, &l, l.s, floats(&[TILE * d, TILE * dv, (wide * LD).max(TILE * wide), TILE * PLD]))?,
            ),
        };
        let mut args = common.to_vec();
        args.extend([KArg::Ptr(dk), KArg::Ptr(dv_), KArg::AttnShape(shape), scale]);
        args.extend(causal.map(|c| KArg::I32(c as i32)));
        ctx.rt.launch(ctx.stream, &kernel, g, &args)?;
    }
    Ok(())
}

pub fn register(t: &mut CudaTable) {
    t.add("Attention", attention);
    t.add("AttentionGrad", attention_grad);
}
