//! Attention (internal, made by passes/fuse_attention.rs): O = softmax(scale · Q·Kt + M) · V over
//! the last two dims, with Q [.., T, D], Kt [.., D, S] (K transposed, as the exporters write
//! Q·Kᵀ), V [.., S, Dv] and an optional additive mask M broadcast to [.., T, S]; batch dims
//! broadcast. Outputs O [batch.., T, Dv] and LSE [batch.., T] (f32: log Σ exp of each score row,
//! what the gradient recomputes the probabilities from, so the [T, S] scores are never kept).
//! `nan_guard` = 1: a row whose scores are all -inf gives 0 (the exporters'
//! `Where(IsNaN(p), 0, p)` after the softmax), else NaN as a plain softmax does.
//!
//! AttentionGrad(dO, Q, Kt, V, M?, O, LSE) -> (dQ, dKt, dV) in the full batch; the gradient rule
//! sums them over broadcast batch dims. The mask gets no gradient (the pass fuses only masks
//! that depend on no weight).
//!
//! `layout = "BSHD"` (passes/attention_layout.rs; default "BHSD", the above): Q [B, T, H, D],
//! K [B, S, H, D] (not transposed), V [B, S, H, Dv] and O [B, T, H, Dv] with the heads inside
//! each row, as the projections write them: the head at (b, h) is Q[b, :, h, :] and so on; the
//! batch is [B, H], the mask broadcasts to [B, H, T, S] and LSE is [B, H, T] as before. dQ, dK, dV
//! come in the layouts of Q, K, V. No batch broadcasting (B and H are the same in all three).
//!
//! `layout = "BHSD_K"` (passes/attention_keys.rs): BHSD with K [.., S, D] itself where BHSD
//! takes Kᵀ [.., D, S] (the graph's transpose of K not made); dK comes as K, [batch.., S, D].
//! Batch dims broadcast as in BHSD.
//!
//! Key padding (passes/attention_key_padding.rs): Attention(Q, Kt, V, M, KP) and
//! AttentionGrad(dO, Q, Kt, V, M, O, LSE, KP) with KP a bool tensor broadcast to [batch.., 1, S]
//! (one flag per key, the same for every query: Hugging Face's attention_mask) and the attribute
//! `padding_value`: the additive mask is M where KP is true and `padding_value` where it is
//! false (M absent: 0). What `Where(And(C, KP), z, f)` is as `Where(KP, Where(C, z, f), f)`: the
//! key-independent part M stays a constant the planner folds (and the CUDA kernels find causal),
//! the padding a [B, S] vector instead of a [B, 1, T, S] mask computed each step.
//!
//! Dropout on the probabilities (passes/fuse_attention.rs): attribute `dropout` =
//! the ratio r in (0, 1) and input 5 of Attention (8 of AttentionGrad) the stream key, an int64
//! [1] from DropoutKey (ops/random.rs). O = (P ∘ Z) · V with Z = 1/(1 − r) where element
//! (b, t, j) of the full batch's [batch.., T, S] probabilities is kept, else 0: kept when the
//! counter-based stream's bits for element index (b·T + t)·S + j are at or above r·2³²
//! (backend/cpu/random.rs; on CUDA the Philox draw of that element, kernels/attention.cuh: in
//! both, what the backend's Dropout of those probabilities keeps). LSE is the softmax's, before the dropout; the gradient regenerates Z
//! from the key instead of storing a [T, S] mask. The key is an input, not drawn by the node, so
//! the node stays a function of its inputs (recomputed bit for bit where checkpointing asks).
//!
//! `layout = "BS3HD"` with `heads = H` (passes/attention_packed_qkv.rs, CUDA sessions): Q, K and
//! V are one tensor [B, T, 3·H·D], the projection's output that the graph split in three: the
//! head at (b, h) is Q[b, :, h·D..(h+1)·D], K the same H·D further along each row, V 2·H·D
//! further (self-attention: S = T). O is [B, T, H, D] as in BSHD; AttentionGrad has one output,
//! dQ, dK and dV packed the same way (what the split's gradient would concatenate).

use super::util::{broadcast_shapes, input};
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::DType;

/// The largest head size (D, Dv) the CUDA attention kernels take: passes/fuse_attention.rs leaves
/// a larger attention of a CUDA session unfused.
pub const CUDA_MAX_HEAD_SIZE: usize = 128;

/// The sizes of one Attention node and each input's batch strides in the full batch.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnLayout {
    /// The broadcast batch dims.
    pub batch: Vec<usize>,
    pub t: usize,
    pub s: usize,
    pub d: usize,
    pub dv: usize,
    /// Element strides of Q, Kt, V per full batch dim (0 where broadcast).
    pub q: Vec<usize>,
    pub k: Vec<usize>,
    pub v: Vec<usize>,
    /// The mask's strides per full batch dim, then along T and S.
    pub m: Option<(Vec<usize>, usize, usize)>,
    /// Element strides per full batch dim of O (and dO), dQ, dKt (dK), dV.
    pub o: Vec<usize>,
    pub gq: Vec<usize>,
    pub gk: Vec<usize>,
    pub gv: Vec<usize>,
    /// Element strides inside each matrix (the columns of Q, V, O are contiguous).
    pub rows: RowStrides,
    /// Element offsets where Q, Kt, V (and dQ, dKt, dV) start in their tensors: [0, H·D, 2·H·D]
    /// in layout BS3HD, where one tensor holds all three; zeros otherwise.
    pub starts: [usize; 3],
}

/// Strides inside the matrices: Q and dQ along T; Kt and dKt along S and along D; V and dV along
/// S; O and dO along T.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowStrides {
    pub q_t: usize,
    pub k_s: usize,
    pub k_d: usize,
    pub v_s: usize,
    pub o_t: usize,
}

/// An attention node's `layout` (this module's doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    Bhsd,
    /// BHSD with K [.., S, D] in place of Kᵀ.
    BhsdK,
    Bshd,
    /// Q, K and V packed in one [B, T, 3·H·D] tensor, with this many heads.
    Bs3hd(usize),
}

/// The input index of Q in a fused attention node: 0 in Attention, 1 in AttentionGrad (after
/// dO); Kt, V and the optional mask follow it.
pub fn q_input(op_type: &str) -> Option<usize> {
    match op_type {
        "Attention" => Some(0),
        "AttentionGrad" => Some(1),
        _ => None,
    }
}

/// The input index of the key-padding flags (this module's doc): 4 in Attention, 7 in
/// AttentionGrad (after LSE).
pub fn key_padding_input(op_type: &str) -> Option<usize> {
    match op_type {
        "Attention" => Some(4),
        "AttentionGrad" => Some(7),
        _ => None,
    }
}

/// The input index of the dropout's stream key (this module's doc): 5 in Attention, 8 in
/// AttentionGrad (after the key padding, which may be absent).
pub fn dropout_key_input(op_type: &str) -> Option<usize> {
    match op_type {
        "Attention" => Some(5),
        "AttentionGrad" => Some(8),
        _ => None,
    }
}

/// The node's dropout ratio (attribute `dropout`, 0 without one): in [0, 1).
pub fn dropout_ratio(node: &Node) -> Result<f64> {
    let r = node.attrs.float("dropout", 0.0)? as f64;
    if (0.0..1.0).contains(&r) {
        Ok(r)
    } else {
        Err(node.err(format!("attribute dropout {r}: the ratio must be in [0, 1)")))
    }
}

/// The key-padding flags' strides in the full batch and along S, for KP of shape `kp`: it must
/// broadcast to [batch.., 1, S] (one flag per key of each batch matrix, whatever the query).
pub fn key_padding_strides(node: &Node, l: &AttnLayout, kp: &[usize]) -> Result<(Vec<usize>, usize)> {
    match mask_strides(node, &l.batch, 1, l.s, Some(kp)) {
        Ok(Some((batch, _, s))) => Ok((batch, s)),
        _ => Err(node.err(format!(
            "the key padding {kp:?} does not broadcast to one flag per key, [{}1, {}]",
            l.batch.iter().map(|b| format!("{b}, ")).collect::<String>(),
            l.s
        ))),
    }
}

/// The attention node's `layout` attribute.
pub fn layout_attr(node: &Node) -> Result<Layout> {
    match node.attrs.string("layout", "BHSD")?.as_str() {
        "BHSD" => Ok(Layout::Bhsd),
        "BHSD_K" => Ok(Layout::BhsdK),
        "BSHD" => Ok(Layout::Bshd),
        "BS3HD" => match node.attrs.int("heads", 0)? {
            h if h > 0 => Ok(Layout::Bs3hd(h as usize)),
            h => Err(node.err(format!("layout BS3HD needs a positive `heads` attribute, got {h}"))),
        },
        other => Err(node.err(format!("layout '{other}': expected BHSD (the default), BHSD_K, BSHD or BS3HD"))),
    }
}

/// Whether Q, K, V and O have the heads inside each row (layouts BSHD and BS3HD).
pub fn heads_inside(node: &Node) -> Result<bool> {
    Ok(matches!(layout_attr(node)?, Layout::Bshd | Layout::Bs3hd(_)))
}

impl AttnLayout {
    pub fn batch_count(&self) -> usize {
        self.batch.iter().product()
    }
    /// Element offsets of (Q, Kt, V, mask) for flat full-batch index `b`.
    pub fn offsets(&self, b: usize) -> [usize; 4] {
        let m = self.m.as_ref().map_or(0, |m| self.batch_offset(&m.0, b));
        [self.batch_offset(&self.q, b), self.batch_offset(&self.k, b), self.batch_offset(&self.v, b), m]
    }
    /// The element offset, for flat full-batch index `b`, of a tensor with these strides per
    /// full batch dim.
    pub fn batch_offset(&self, strides: &[usize], mut b: usize) -> usize {
        let mut at = 0;
        for i in (0..self.batch.len()).rev() {
            at += (b % self.batch[i]) * strides[i];
            b /= self.batch[i];
        }
        at
    }
}

/// Contiguous strides of `shape` aligned to the trailing dims of `full`, 0 where `shape` has 1
/// (or lacks the dim).
fn broadcast_strides(shape: &[usize], full: &[usize]) -> Vec<usize> {
    let mut strides = vec![0usize; full.len()];
    let mut step = 1usize;
    for (i, &d) in shape.iter().enumerate().rev() {
        let at = full.len() - (shape.len() - i);
        strides[at] = if d == 1 { 0 } else { step };
        step *= d;
    }
    strides
}

/// The strides of the full-batch mask broadcast to [batch.., T, S].
fn mask_strides(node: &Node, batch: &[usize], t: usize, s: usize, mask: Option<&[usize]>) -> Result<Option<(Vec<usize>, usize, usize)>> {
    let Some(ms) = mask else { return Ok(None) };
    let mut want = batch.to_vec();
    want.extend([t, s]);
    if broadcast_shapes(node, &[ms, &want])? != want {
        return Err(node.err(format!("the mask {ms:?} does not broadcast to the scores {want:?}")));
    }
    let st = broadcast_strides(ms, &want);
    let n = st.len();
    Ok(Some((st[..n - 2].to_vec(), st[n - 2], st[n - 1])))
}

/// Checks the shapes of an Attention node's inputs (Q, Kt or K, V, the mask) and lays them out.
pub fn attention_layout(node: &Node, q: &[usize], kt: &[usize], v: &[usize], mask: Option<&[usize]>) -> Result<AttnLayout> {
    let keys = match layout_attr(node)? {
        Layout::Bshd => return heads_inside_layout(node, q, kt, v, mask),
        Layout::Bs3hd(h) => return packed_layout(node, q, kt, v, mask, h),
        Layout::Bhsd => false,
        Layout::BhsdK => true,
    };
    if q.len() < 2 || kt.len() < 2 || v.len() < 2 {
        return Err(node.err(format!("Q, Kt and V must have rank >= 2, got {q:?}, {kt:?}, {v:?}")));
    }
    let split = |x: &[usize]| (x[..x.len() - 2].to_vec(), x[x.len() - 2], x[x.len() - 1]);
    let ((bq, t, d), (bk, k0, k1), (bv, sv, dv)) = (split(q), split(kt), split(v));
    // K [.., S, D] (BHSD_K) or Kt [.., D, S]
    let (dk, s) = if keys { (k1, k0) } else { (k0, k1) };
    if dk != d || sv != s {
        let (name, want) = if keys { ("K", "[.., S, D]") } else { ("Kt", "[.., D, S]") };
        return Err(
            node.err(format!("Q {q:?}, {name} {kt:?} and V {v:?} do not chain: Q·Kᵀ·V needs [.., T, D], {name} {want}, [.., S, Dv]"))
        );
    }
    let batch = broadcast_shapes(node, &[&bq, &bk, &bv])?;
    let full = |b: &[usize], rows: usize, cols: usize| {
        let mut s = broadcast_strides(b, &batch);
        s.iter_mut().for_each(|x| *x *= rows * cols);
        s
    };
    let m = mask_strides(node, &batch, t, s, mask)?;
    // outputs and gradients: contiguous in the full batch
    let out = |rows: usize, cols: usize| full(&batch, rows, cols);
    let rows = if keys {
        RowStrides { q_t: d, k_s: d, k_d: 1, v_s: dv, o_t: dv }
    } else {
        RowStrides { q_t: d, k_s: 1, k_d: s, v_s: dv, o_t: dv }
    };
    let (o, gq, gk, gv) = (out(t, dv), out(t, d), out(d, s), out(s, dv));
    Ok(AttnLayout {
        q: full(&bq, t, d),
        k: full(&bk, d, s),
        v: full(&bv, s, dv),
        batch,
        t,
        s,
        d,
        dv,
        m,
        o,
        gq,
        gk,
        gv,
        rows,
        starts: [0; 3],
    })
}

/// The "BSHD" layout: Q [B, T, H, D], K [B, S, H, D], V [B, S, H, Dv]; O [B, T, H, Dv].
fn heads_inside_layout(node: &Node, q: &[usize], k: &[usize], v: &[usize], mask: Option<&[usize]>) -> Result<AttnLayout> {
    let (Some([b, t, h, d]), Some([bk, s, hk, dk]), Some([bv, sv, hv, dv])) = (rank4(q), rank4(k), rank4(v)) else {
        return Err(node.err(format!("layout BSHD takes Q, K, V of rank 4 ([B, T, H, D]), got {q:?}, {k:?}, {v:?}")));
    };
    if (bk, hk, dk) != (b, h, d) || (bv, hv, sv) != (b, h, s) {
        return Err(
            node.err(format!("Q {q:?}, K {k:?} and V {v:?} do not match: layout BSHD needs [B, T, H, D], [B, S, H, D], [B, S, H, Dv]"))
        );
    }
    let batch = vec![b, h];
    let m = mask_strides(node, &batch, t, s, mask)?;
    let (q_b, k_b, v_b, o_b) = (vec![t * h * d, d], vec![s * h * d, d], vec![s * h * dv, dv], vec![t * h * dv, dv]);
    let rows = RowStrides { q_t: h * d, k_s: h * d, k_d: 1, v_s: h * dv, o_t: h * dv };
    Ok(AttnLayout {
        q: q_b.clone(),
        k: k_b.clone(),
        v: v_b.clone(),
        batch,
        t,
        s,
        d,
        dv,
        m,
        o: o_b,
        gq: q_b,
        gk: k_b,
        gv: v_b,
        rows,
        starts: [0; 3],
    })
}

/// The "BS3HD" layout: Q, K and V one tensor [B, T, 3·H·D] (each row: Q's heads, K's, V's); O
/// [B, T, H, D].
fn packed_layout(node: &Node, q: &[usize], k: &[usize], v: &[usize], mask: Option<&[usize]>, h: usize) -> Result<AttnLayout> {
    let (&[b, t, width], true) = (q, q == k && q == v) else {
        return Err(node.err(format!("layout BS3HD takes Q, K and V as one tensor [B, T, 3·H·D], got {q:?}, {k:?}, {v:?}")));
    };
    if width == 0 || width % (3 * h) != 0 {
        return Err(node.err(format!("layout BS3HD: rows of {width} do not hold Q, K and V of {h} heads")));
    }
    let d = width / (3 * h);
    let batch = vec![b, h];
    let m = mask_strides(node, &batch, t, t, mask)?;
    let qkv = vec![t * width, d];
    let rows = RowStrides { q_t: width, k_s: width, k_d: 1, v_s: width, o_t: h * d };
    let (q, k, v, gq, gk, gv) = (qkv.clone(), qkv.clone(), qkv.clone(), qkv.clone(), qkv.clone(), qkv);
    Ok(AttnLayout { q, k, v, batch, t, s: t, d, dv: d, m, o: vec![t * h * d, d], gq, gk, gv, rows, starts: [0, h * d, 2 * h * d] })
}

/// The element offsets, in `x`, of the elements of `x` (shape `shape`) with its axes permuted
/// (axis j of the result is axis `perm[j]` of `x`), in the result's order: the BSHD ↔ BHSD
/// copies of the CPU kernel and of the tests.
pub fn permuted_offsets(shape: [usize; 4], perm: [usize; 4]) -> Vec<usize> {
    let mut strides = [0usize; 4];
    let mut step = 1;
    for a in (0..4).rev() {
        strides[a] = step;
        step *= shape[a];
    }
    let (n, st) = (perm.map(|a| shape[a]), perm.map(|a| strides[a]));
    let mut out = Vec::with_capacity(step);
    for i in 0..n[0] {
        for j in 0..n[1] {
            for k in 0..n[2] {
                out.extend((0..n[3]).map(|l| i * st[0] + j * st[1] + k * st[2] + l * st[3]));
            }
        }
    }
    out
}

fn rank4(x: &[usize]) -> Option<[usize; 4]> {
    x.try_into().ok()
}

fn layout_of(node: &Node, inputs: &[Option<InferIn>], first: usize) -> Result<(AttnLayout, DType)> {
    let (q, kt, v) = (input(node, inputs, first)?, input(node, inputs, first + 1)?, input(node, inputs, first + 2)?);
    let mask = inputs.get(first + 3).and_then(|m| m.as_ref());
    for (what, x) in [("Kt", kt), ("V", v)].into_iter().chain(mask.map(|m| ("the mask", m))) {
        // a 16-bit attention keeps an f32 mask (large negative values would round to -inf)
        let f32_mask = what == "the mask" && q.dtype.is_half() && x.dtype == DType::F32;
        if x.dtype != q.dtype && !f32_mask {
            return Err(node.err(format!("{what} is {}, Q is {}", x.dtype.name(), q.dtype.name())));
        }
    }
    // AttentionGrad(dO, Q, Kt, V, M, O, LSE): dO and O have Q's type too
    let grad_operands: &[usize] = if first > 0 { &[0, 5] } else { &[] };
    for &i in grad_operands {
        if let Some(x) = inputs.get(i).and_then(|x| x.as_ref()) {
            if x.dtype != q.dtype {
                return Err(node.err(format!("input {i} is {}, Q is {}", x.dtype.name(), q.dtype.name())));
            }
        }
    }
    if !q.dtype.is_float() {
        return Err(node.err(format!("attention takes float tensors (f32, f64, bf16, fp16), got {}", q.dtype.name())));
    }
    let l = attention_layout(node, q.shape, kt.shape, v.shape, mask.map(|m| m.shape))?;
    let kp = key_padding_input(&node.op_type).and_then(|i| inputs.get(i)).and_then(|x| x.as_ref());
    if let Some(kp) = kp {
        if kp.dtype != DType::Bool {
            return Err(node.err(format!("the key padding is {}, expected bool", kp.dtype.name())));
        }
        key_padding_strides(node, &l, kp.shape)?;
    }
    let key = dropout_key_input(&node.op_type).and_then(|i| inputs.get(i)).and_then(|x| x.as_ref());
    match (dropout_ratio(node)? > 0.0, key) {
        (true, Some(k)) if k.dtype == DType::I64 && k.shape.iter().product::<usize>() == 1 => {}
        (true, Some(k)) => return Err(node.err(format!("the dropout key is {} {:?}, expected one int64", k.dtype.name(), k.shape))),
        (true, None) => return Err(node.err("attribute dropout needs the stream key input (DropoutKey's output)")),
        (false, _) => {}
    }
    Ok((l, q.dtype))
}

struct Attention;
impl OpDef for Attention {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let (l, dt) = layout_of(node, inputs, 0)?;
        let o = if heads_inside(node)? {
            vec![l.batch[0], l.t, l.batch[1], l.dv]
        } else {
            let mut o = l.batch.clone();
            o.extend([l.t, l.dv]);
            o
        };
        let mut lse = l.batch.clone();
        lse.push(l.t);
        Ok(vec![TypeOut::new(dt, o), TypeOut::new(DType::F32, lse)])
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[3, 4, 5]
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let Some(dout) = g.dy(0) else { return Ok(()) };
            if g.wants(3) || g.wants(4) {
                return Err(node.err("the fused attention has no gradient for its mask (the mask depends on a weight)"));
            }
            let (q, kt, v) = (g.x(0)?, g.x(1)?, g.x(2)?);
            let mut ins = vec![Some(dout), Some(q), Some(kt), Some(v), g.x_opt(3), Some(g.y(0)), Some(g.y(1))];
            let (kp, key) = (g.x_opt(4), g.x_opt(5));
            if kp.is_some() || key.is_some() {
                ins.push(kp);
            }
            if key.is_some() {
                ins.push(key);
            }
            if let Layout::Bs3hd(_) = layout_attr(node)? {
                // one value read three times: its one gradient holds dQ, dK and dV
                if q != kt || q != v {
                    return Err(node.err("layout BS3HD needs Q, K and V to be one value"));
                }
                let dqkv = g.op_n("AttentionGrad", ins, g.attrs().clone(), 1)[0];
                if g.wants(0) {
                    g.set(0, dqkv);
                }
                return Ok(());
            }
            let outs = g.op_n("AttentionGrad", ins, g.attrs().clone(), 3);
            for (i, (d, x)) in outs.into_iter().zip([q, kt, v]).enumerate() {
                if g.wants(i) {
                    let summed = g.sum_to(d, x);
                    g.set(i, summed);
                }
            }
            Ok(())
        })
    }
}

struct AttentionGrad;
impl OpDef for AttentionGrad {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let (l, dt) = layout_of(node, inputs, 1)?;
        let like = |i: usize| input(node, inputs, i).map(|x| TypeOut::new(dt, x.shape.to_vec()));
        match layout_attr(node)? {
            // the inputs' own layouts (no batch broadcasting)
            Layout::Bshd => return Ok(vec![like(1)?, like(2)?, like(3)?]),
            Layout::Bs3hd(_) => return Ok(vec![like(1)?]),
            Layout::Bhsd | Layout::BhsdK => {}
        }
        let with = |rows: usize, cols: usize| {
            let mut s = l.batch.clone();
            s.extend([rows, cols]);
            TypeOut::new(dt, s)
        };
        let dk = if layout_attr(node)? == Layout::BhsdK { with(l.s, l.d) } else { with(l.d, l.s) };
        Ok(vec![with(l.t, l.d), dk, with(l.s, l.dv)])
    }
}

pub fn register(r: &mut Registry) {
    r.internal("Attention", Attention);
    r.internal("AttentionGrad", AttentionGrad);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_broadcasts_batches_and_the_mask() {
        let node = Node { name: "a".into(), op_type: "Attention".into(), inputs: vec![], outputs: vec![], attrs: Default::default() };
        // K and V shared by 3 heads, a padding mask [B, 1, 1, S]
        let l = attention_layout(&node, &[2, 3, 5, 4], &[2, 1, 4, 7], &[2, 1, 7, 6], Some(&[2, 1, 1, 7])).expect("layout");
        assert_eq!((l.batch.clone(), l.t, l.s, l.d, l.dv), (vec![2, 3], 5, 7, 4, 6));
        assert_eq!((l.q.clone(), l.k.clone(), l.v.clone()), (vec![60, 20], vec![28, 0], vec![42, 0]));
        assert_eq!(l.m, Some((vec![7, 0], 0, 1)));
        assert_eq!(l.offsets(4), [80, 28, 42, 7]);
        let bad = attention_layout(&node, &[2, 5, 4], &[2, 3, 7], &[2, 7, 6], None);
        assert!(bad.unwrap_err().to_string().contains("do not chain"));
    }
}
