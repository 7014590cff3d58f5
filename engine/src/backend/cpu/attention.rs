//! CPU kernels of ops/attention.rs. f32 attentions (and the 16-bit ones, which the CPU widens to
//! f32) run attention_f32/'s blocked kernels. The others run the reference here: one score
//! row at a time in f64 (two-pass softmax), parallel over batch matrices; the backward
//! recomputes each row's probabilities from the saved LSE, as the GPU does. The reference runs
//! layout BSHD on copies permuted to BHSD (and back), sharing nothing with the strided reads of
//! the fast kernels and of the GPU's. A row with no real score (every score at
//! or below -1e38: all keys masked with finfo.min) gets its probabilities from its scores, not
//! from its LSE, which f32 cannot hold for it (finfo.min + ln S rounds to finfo.min).

use rayon::prelude::*;

use super::attention_f32::{self, Grads, Operands};
use super::elementwise::FloatElem;
use super::tensor_view::{In, Out};
use super::CpuCtx;
use super::KernelTable;
use crate::error::Result;
use crate::ir::Node;
use crate::ops::attention::{
    attention_layout, dropout_key_input, dropout_ratio, key_padding_input, key_padding_strides, layout_attr, permuted_offsets, AttnLayout,
    Layout,
};
use crate::tensor::Tensor;

/// Whether the node is in layout BSHD (run on BHSD copies); BS3HD has no CPU kernel, and
/// BHSD_K only the f32 one (`reference`: asked by the reference kernel, which reads Kt).
fn via_copies(node: &Node, reference: bool) -> Result<bool> {
    match layout_attr(node)? {
        Layout::Bhsd => Ok(false),
        Layout::BhsdK if !reference => Ok(false),
        Layout::BhsdK => Err(node.err(
            "layout BHSD_K (K not transposed, made by passes/attention_keys.rs) has only the CPU's f32 kernels; \
             this attention's tensors are not f32",
        )),
        Layout::Bshd => Ok(true),
        Layout::Bs3hd(_) => Err(node.err(
            "layout BS3HD (Q, K and V packed in one tensor, made by passes/attention_packed_qkv.rs for CUDA sessions) has no CPU kernel",
        )),
    }
}

fn req<'v, 'a>(node: &Node, inputs: &'v [Option<In<'a>>], i: usize) -> Result<&'v In<'a>> {
    inputs.get(i).and_then(|v| v.as_ref()).ok_or_else(|| node.err(format!("input {i} missing")))
}

/// A row whose LSE is at or below this has no real score (kernels/attention.cuh ATT_SETTLED).
pub(super) const SETTLED: f64 = -1.0e38;

/// The key-padding flags of a node (ops/attention.rs): the bytes, their strides per full batch
/// dim and along S, and the mask value of a padded key.
pub(super) struct KeyPadding<'a> {
    pub flags: &'a [u8],
    pub batch: Vec<usize>,
    pub s: usize,
    pub value: f64,
}

/// The dropout on a node's probabilities (ops/attention.rs): its stream key, the draw below
/// which an element is dropped, and what a kept one is scaled by, 1/(1 − ratio).
#[derive(Clone, Copy)]
pub(super) struct AttnDropout {
    pub key: u64,
    pub threshold: u32,
    pub scale: f64,
}

impl AttnDropout {
    /// Z of query `t` of batch matrix `b` over keys `0..z.len()`: `scale` (the node's, in the
    /// caller's precision) where kept, else 0.
    pub fn factors(&self, l: &AttnLayout, b: usize, t: usize, z: &mut [f32], scale: f32) {
        let start = ((b * l.t + t) * l.s) as u64;
        super::random::keep_factors::call(z, start, self.key, self.threshold, scale);
    }
}

/// What a node's kernels need besides their operands.
pub(super) struct Params<'a> {
    pub l: AttnLayout,
    pub scale: f64,
    /// `nan_guard`: a row of -inf scores gives 0, not NaN.
    pub guard: bool,
    pub kp: Option<KeyPadding<'a>>,
    pub dropout: Option<AttnDropout>,
}

/// The [`Params`] of a node whose Q, Kt, V, mask start at input `first`.
fn setup<'a>(node: &Node, inputs: &[Option<In<'a>>], first: usize) -> Result<Params<'a>> {
    let (q, kt, v) = (req(node, inputs, first)?, req(node, inputs, first + 1)?, req(node, inputs, first + 2)?);
    let mask = inputs.get(first + 3).and_then(|m| m.as_ref()).map(|m| m.shape);
    let l = attention_layout(node, q.shape, kt.shape, v.shape, mask)?;
    let kp = match key_padding_input(&node.op_type).and_then(|i| inputs.get(i)).and_then(|x| x.as_ref()) {
        Some(kp) => {
            let (batch, s) = key_padding_strides(node, &l, kp.shape)?;
            let value = node.attrs.float("padding_value", f32::NEG_INFINITY)? as f64;
            Some(KeyPadding { flags: kp.bytes(), batch, s, value })
        }
        None => None,
    };
    let ratio = dropout_ratio(node)?;
    let dropout = match dropout_key_input(&node.op_type).and_then(|i| inputs.get(i)).and_then(|x| x.as_ref()) {
        Some(key) if ratio > 0.0 => {
            let &[key] = key.slice::<i64>()? else { return Err(node.err("the dropout key must be one int64")) };
            Some(AttnDropout { key: key as u64, threshold: super::random::drop_threshold(ratio), scale: 1.0 / (1.0 - ratio) })
        }
        None if ratio > 0.0 => return Err(node.err("attribute dropout needs the stream key input")),
        _ => None,
    };
    Ok(Params { l, scale: node.attrs.float("scale", 1.0)? as f64, guard: node.attrs.int("nan_guard", 0)? != 0, kp, dropout })
}

/// The scaled, masked scores of row `t` of batch matrix `b` (at offsets `off`).
fn scores<T: FloatElem>(p: &Params, b: usize, off: &[usize; 4], q: &[T], kt: &[T], mask: Option<&[T]>, t: usize) -> Vec<f64> {
    let (l, scale) = (&p.l, p.scale);
    // the key padding: its flags at this batch matrix, and the padded keys' value
    let padding = p.kp.as_ref().map(|kp| (&kp.flags[l.batch_offset(&kp.batch, b)..], kp.s, kp.value));
    (0..l.s)
        .map(|j| {
            let dot: f64 = (0..l.d).map(|k| q[off[0] + t * l.d + k].as_() * kt[off[1] + k * l.s + j].as_()).sum();
            let m = match (mask, &l.m) {
                (Some(mv), Some((_, mt, ms))) => mv[off[3] + t * mt + j * ms].as_(),
                _ => 0.0,
            };
            let m = match padding {
                Some((flags, s, value)) if flags[j * s] == 0 => value,
                _ => m,
            };
            dot * scale + m
        })
        .collect()
}

/// The reference's dropout factors of query `t` of batch matrix `b` (ones without a dropout): the
/// fast kernels' keep decisions, with the scale in f64.
fn keep_factors(p: &Params, b: usize, t: usize) -> Vec<f64> {
    let Some(d) = &p.dropout else { return vec![1.0; p.l.s] };
    let mut kept = vec![0f32; p.l.s];
    d.factors(&p.l, b, t, &mut kept, 1.0);
    kept.into_iter().map(|k| k as f64 * d.scale).collect()
}

/// A row's probabilities from its scores alone (two-pass softmax), zeros where all are -inf.
fn softmax_of(s: &[f64]) -> Vec<f64> {
    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return vec![0.0; s.len()];
    }
    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|x| x / sum).collect()
}

/// `x` [a0, a1, a2, a3] with its axes permuted: axis j of the result is axis `perm[j]` of `x`.
fn permute4(x: &In, perm: [usize; 4]) -> Result<Tensor> {
    let shape: [usize; 4] = x.shape.try_into().map_err(|_| crate::error::Error::other("attention: a BSHD operand is not of rank 4"))?;
    let elem = x.dtype.size();
    let src = x.bytes();
    let mut dst = Vec::with_capacity(src.len());
    for at in permuted_offsets(shape, perm) {
        dst.extend_from_slice(&src[at * elem..(at + 1) * elem]);
    }
    Tensor::from_bytes(x.dtype, perm.map(|a| shape[a]).to_vec(), &dst)
}

/// Runs `kernel` (this file's BHSD kernels) for a BSHD node: input `i` permuted by `ins_perm[i]`
/// (None, or past the list: as it is); output `k`, where `outs[k]` is (its BHSD shape, the
/// permutation back), computed into a BHSD tensor and permuted into `out[k]`, else written in
/// place.
type CpuKernel = fn(&Node, &[Option<In>], &mut [Out], &mut CpuCtx) -> Result<()>;
fn via_bhsd(
    node: &Node,
    inputs: &[Option<In>],
    out: &mut [Out],
    ctx: &mut CpuCtx,
    kernel: CpuKernel,
    ins_perm: &[Option<[usize; 4]>],
    outs: &[Option<([usize; 4], [usize; 4])>],
) -> Result<()> {
    let mut plain = node.clone();
    plain.attrs.0.retain(|(k, _)| k != "layout");
    let permuted: Vec<Option<Tensor>> = inputs
        .iter()
        .zip(ins_perm.iter().chain(std::iter::repeat(&None)))
        .map(|(x, p)| match (x, p) {
            (Some(x), Some(p)) => permute4(x, *p).map(Some),
            _ => Ok(None),
        })
        .collect::<Result<_>>()?;
    let views: Vec<Option<In>> = inputs.iter().zip(&permuted).map(|(x, p)| p.as_ref().map(In::of).or(*x)).collect();
    let specs = || outs.iter().chain(std::iter::repeat(&None));
    let mut temps: Vec<Option<Tensor>> =
        out.iter().zip(specs()).map(|(o, spec)| spec.map(|(bhsd, _)| Tensor::zeros(o.dtype, bhsd.to_vec()))).collect();
    {
        let mut views_out: Vec<Out> = Vec::with_capacity(out.len());
        for (o, t) in out.iter_mut().zip(temps.iter_mut()) {
            views_out.push(match t {
                Some(t) => {
                    let ptr = t.as_bytes_mut().as_mut_ptr();
                    // SAFETY: the tensor holds numel(shape) elements of o's dtype; this view is
                    // the only access to them until the kernel returns.
                    unsafe { Out::from_raw(o.dtype, &t.shape, ptr) }
                }
                None => o.reborrow(),
            });
        }
        kernel(&plain, &views, &mut views_out, ctx)?;
    }
    for ((o, t), spec) in out.iter_mut().zip(&temps).zip(specs()) {
        if let (Some(t), Some((_, back))) = (t, spec) {
            let p = permute4(&In::of(t), *back)?;
            o.bytes().copy_from_slice(p.as_bytes());
        }
    }
    Ok(())
}

/// [B, T, H, X] -> [B, H, T, X] and back; K [B, S, H, D] -> Kt [B, H, D, S]; dKt back to dK.
const TO_BHSD: [usize; 4] = [0, 2, 1, 3];
const K_TO_KT: [usize; 4] = [0, 2, 3, 1];
const KT_TO_K: [usize; 4] = [0, 3, 1, 2];

/// The BHSD shape of a BSHD tensor of shape `x` permuted by `perm`.
fn permuted_shape(x: &[usize], perm: [usize; 4]) -> [usize; 4] {
    perm.map(|a| x.get(a).copied().unwrap_or(0))
}

/// The f32 operands (Q, Kt, V, mask) of a node whose Q is input `first`, if Q is f32.
fn f32_operands<'a>(node: &Node, inputs: &[Option<In<'a>>], first: usize) -> Result<Option<Operands<'a>>> {
    if req(node, inputs, first)?.dtype != crate::tensor::DType::F32 {
        return Ok(None);
    }
    let sl = |i: usize| req(node, inputs, i).and_then(|x| x.slice::<f32>());
    let mask = match inputs.get(first + 3).and_then(|m| m.as_ref()) {
        Some(m) => Some(m.slice::<f32>()?),
        None => None,
    };
    Ok(Some(Operands { q: sl(first)?, kt: sl(first + 1)?, v: sl(first + 2)?, mask }))
}

fn attention(node: &Node, inputs: &[Option<In>], out: &mut [Out], ctx: &mut CpuCtx) -> Result<()> {
    via_copies(node, false)?; // BS3HD has no CPU kernel
    if let Some(x) = f32_operands(node, inputs, 0)? {
        let params = setup(node, inputs, 0)?;
        let [o, lse] = out else { return Err(node.err("Attention has two outputs")) };
        return attention_f32::forward(node, &params, &x, o.slice::<f32>()?, lse.slice::<f32>()?);
    }
    if via_copies(node, true)? {
        let o = permuted_shape(out[0].shape, TO_BHSD);
        let ins = [Some(TO_BHSD), Some(K_TO_KT), Some(TO_BHSD)];
        return via_bhsd(node, inputs, out, ctx, attention, &ins, &[Some((o, TO_BHSD))]);
    }
    let params = setup(node, inputs, 0)?;
    fn go<T: FloatElem>(node: &Node, p: &Params, inputs: &[Option<In>], out: &mut [Out]) -> Result<()> {
        let (l, guard) = (&p.l, p.guard);
        let sl = |i: usize| req(node, inputs, i).and_then(|x| x.slice::<T>());
        let (q, kt, v) = (sl(0)?, sl(1)?, sl(2)?);
        let mask = match inputs.get(3).and_then(|m| m.as_ref()) {
            Some(m) => Some(m.slice::<T>()?),
            None => None,
        };
        let [o_out, lse_out] = out else { return Err(node.err("Attention has two outputs")) };
        let (o, lse) = (o_out.slice::<T>()?, lse_out.slice::<f32>()?);
        if l.t == 0 {
            return Ok(());
        }
        o.par_chunks_mut((l.t * l.dv).max(1)).zip(lse.par_chunks_mut(l.t)).enumerate().for_each(|(b, (ob, lb))| {
            let off = l.offsets(b);
            for t in 0..l.t {
                let s = scores(p, b, &off, q, kt, mask, t);
                let z = keep_factors(p, b, t);
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let orow = &mut ob[t * l.dv..(t + 1) * l.dv];
                if m == f64::NEG_INFINITY {
                    let fill = if guard { 0.0 } else { f64::NAN };
                    orow.iter_mut().for_each(|x| *x = T::from_f64(fill));
                    lb[t] = f32::NEG_INFINITY;
                    continue;
                }
                let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let sum: f64 = p.iter().sum();
                for (c, x) in orow.iter_mut().enumerate() {
                    let acc: f64 = p.iter().enumerate().map(|(j, pj)| pj * z[j] * v[off[2] + j * l.dv + c].as_()).sum();
                    *x = T::from_f64(acc / sum);
                }
                lb[t] = (m + sum.ln()) as f32;
            }
        });
        Ok(())
    }
    let dt = req(node, inputs, 0)?.dtype;
    crate::dispatch_float!(dt, node, go::<T>(node, &params, inputs, out))
}

/// AttentionGrad(dO, Q, Kt, V, M?, O, LSE, KP?) -> (dQ, dKt, dV).
fn attention_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], ctx: &mut CpuCtx) -> Result<()> {
    via_copies(node, false)?; // BS3HD has no CPU kernel
    if let Some(x) = f32_operands(node, inputs, 1)? {
        let params = setup(node, inputs, 1)?;
        let sl = |i: usize| req(node, inputs, i).and_then(|t| t.slice::<f32>());
        let (dout, o, lse) = (sl(0)?, sl(5)?, sl(6)?);
        let [dq, dk, dv] = out else { return Err(node.err("AttentionGrad has three outputs")) };
        let g = Grads { dq: dq.slice::<f32>()?, dk: dk.slice::<f32>()?, dv: dv.slice::<f32>()? };
        return attention_f32::backward(node, &params, &x, dout, o, lse, g);
    }
    if via_copies(node, true)? {
        let outs = [
            Some((permuted_shape(out[0].shape, TO_BHSD), TO_BHSD)),
            Some((permuted_shape(out[1].shape, K_TO_KT), KT_TO_K)),
            Some((permuted_shape(out[2].shape, TO_BHSD), TO_BHSD)),
        ];
        let ins = [Some(TO_BHSD), Some(TO_BHSD), Some(K_TO_KT), Some(TO_BHSD), None, Some(TO_BHSD)];
        return via_bhsd(node, inputs, out, ctx, attention_grad, &ins, &outs);
    }
    let params = setup(node, inputs, 1)?;
    fn go<T: FloatElem>(node: &Node, params: &Params, inputs: &[Option<In>], out: &mut [Out]) -> Result<()> {
        let (l, scale) = (&params.l, params.scale);
        let sl = |i: usize| req(node, inputs, i).and_then(|x| x.slice::<T>());
        let (dout, q, kt, v, o) = (sl(0)?, sl(1)?, sl(2)?, sl(3)?, sl(5)?);
        let mask = match inputs.get(4).and_then(|m| m.as_ref()) {
            Some(m) => Some(m.slice::<T>()?),
            None => None,
        };
        let lse = req(node, inputs, 6)?.slice::<f32>()?;
        let [dq_o, dk_o, dv_o] = out else { return Err(node.err("AttentionGrad has three outputs")) };
        let (dq, dk, dv) = (dq_o.slice::<T>()?, dk_o.slice::<T>()?, dv_o.slice::<T>()?);
        let (nq, nk, nv) = ((l.t * l.d).max(1), (l.d * l.s).max(1), (l.s * l.dv).max(1));
        dq.par_chunks_mut(nq).zip(dk.par_chunks_mut(nk)).zip(dv.par_chunks_mut(nv)).enumerate().for_each(|(b, ((dqb, dkb), dvb))| {
            let off = l.offsets(b);
            let mut gk = vec![0f64; l.d * l.s];
            let mut gv = vec![0f64; l.s * l.dv];
            for t in 0..l.t {
                let row = b * l.t + t;
                let lr = lse[row] as f64;
                let dorow = &dout[row * l.dv..(row + 1) * l.dv];
                let s = scores(params, b, &off, q, kt, mask, t);
                let z = keep_factors(params, b, t);
                let p: Vec<f64> = if lr > SETTLED {
                    s.iter().map(|&x| if x == f64::NEG_INFINITY { 0.0 } else { (x - lr).exp() }).collect()
                } else {
                    softmax_of(&s)
                };
                let delta: f64 = (0..l.dv).map(|c| dorow[c].as_() * o[row * l.dv + c].as_()).sum();
                let mut gq = vec![0f64; l.d];
                for j in 0..l.s {
                    let dp: f64 = z[j] * (0..l.dv).map(|c| dorow[c].as_() * v[off[2] + j * l.dv + c].as_()).sum::<f64>();
                    let ds = p[j] * (dp - delta);
                    for c in 0..l.dv {
                        gv[j * l.dv + c] += p[j] * z[j] * dorow[c].as_();
                    }
                    for k in 0..l.d {
                        gq[k] += ds * kt[off[1] + k * l.s + j].as_();
                        gk[k * l.s + j] += ds * q[off[0] + t * l.d + k].as_();
                    }
                }
                for k in 0..l.d {
                    dqb[t * l.d + k] = T::from_f64(gq[k] * scale);
                }
            }
            dkb.iter_mut().zip(&gk).for_each(|(x, g)| *x = T::from_f64(g * scale));
            dvb.iter_mut().zip(&gv).for_each(|(x, g)| *x = T::from_f64(*g));
        });
        Ok(())
    }
    let dt = req(node, inputs, 1)?.dtype;
    crate::dispatch_float!(dt, node, go::<T>(node, &params, inputs, out))
}

pub fn register(t: &mut KernelTable) {
    t.add("Attention", attention);
    t.add("AttentionGrad", attention_grad);
}

#[cfg(test)]
mod tests {
    use super::super::testutil::run;
    use crate::ir::{Attr, Attrs};
    use crate::tensor::{Data, Tensor};

    /// Batch 2, one head, 4 queries and keys of size 2: Q, Kᵀ, V, dO from a ramp; the causal
    /// finfo.min mask; batch row 0 padded on the left (its queries 0 and 1 see no key), row 1
    /// on the right (its last key).
    fn inputs() -> [Tensor; 6] {
        let ramp = |n: usize, k: f32| (0..n).map(|i| ((i as f32) * k).sin()).collect::<Vec<f32>>();
        let q = Tensor::from_f32(vec![2, 1, 4, 2], ramp(16, 0.7));
        let kt = Tensor::from_f32(vec![2, 1, 2, 4], ramp(16, 1.3));
        let v = Tensor::from_f32(vec![2, 1, 4, 2], ramp(16, 0.4));
        let dout = Tensor::from_f32(vec![2, 1, 4, 2], ramp(16, 2.1));
        let mask = Tensor::from_f32(vec![1, 1, 4, 4], (0..16).map(|i| if i % 4 > i / 4 { f32::MIN } else { 0.0 }).collect());
        let kp = Tensor::new(vec![2, 1, 1, 4], Data::Bool(vec![0, 0, 1, 1, 1, 1, 1, 0])).expect("flags");
        [q, kt, v, dout, mask, kp]
    }

    fn attrs() -> Attrs {
        Attrs::default().with("scale", Attr::Float(0.5)).with("padding_value", Attr::Float(f32::MIN))
    }

    /// The key padding gives what the mask made from it gives (Where(KP, M, finfo.min), as the
    /// unfused graph computes it), and a query without a visible key equal weights over all
    /// keys, in the forward and in the gradients (its probabilities from its scores: the LSE,
    /// finfo.min, cannot hold ln S).
    #[test]
    fn key_padding_is_the_mask_made_from_it_and_keyless_queries_weigh_every_key_equally() {
        let [q, kt, v, dout, mask, kp] = inputs();
        let flags = kp.to_f64_vec();
        let made = Tensor::from_f32(
            vec![2, 1, 4, 4],
            (0..32).map(|i| if flags[(i / 16) * 4 + i % 4] != 0.0 { mask.to_f64_vec()[i % 16] as f32 } else { f32::MIN }).collect(),
        );
        let padded = run("Attention", attrs(), &[&q, &kt, &v, &mask, &kp]);
        let read = run("Attention", attrs(), &[&q, &kt, &v, &made]);
        assert_eq!(padded[0].to_f64_vec(), read[0].to_f64_vec(), "O");
        let o = padded[0].to_f64_vec();
        let vv = v.to_f64_vec();
        for row in 0..2 {
            for c in 0..2 {
                let mean = (0..4).map(|j| vv[j * 2 + c]).sum::<f64>() / 4.0;
                assert!((o[row * 2 + c] - mean).abs() < 1e-6, "query {row} of batch 0: O {} vs the mean of V {mean}", o[row * 2 + c]);
            }
        }
        let grads = |extra: &[&Tensor]| {
            let mut ins: Vec<&Tensor> = vec![&dout, &q, &kt, &v];
            ins.push(extra[0]);
            ins.extend([&padded[0], &padded[1]]);
            ins.extend(&extra[1..]);
            run("AttentionGrad", attrs(), &ins).iter().map(|t| t.to_f64_vec()).collect::<Vec<_>>()
        };
        let (with_kp, with_made) = (grads(&[&mask, &kp]), grads(&[&made]));
        for (i, name) in ["dQ", "dKt", "dV"].iter().enumerate() {
            assert_eq!(with_kp[i], with_made[i], "{name}");
        }
        // batch 0's dV: queries 0 and 1 weigh the 4 keys 1/4 each, query 2 keys 2 (visible) only
        // through its softmax, query 3 keys 2 and 3: key 0 and 1 get dO of queries 0 and 1 / 4
        let d = dout.to_f64_vec();
        for j in 0..2 {
            for c in 0..2 {
                let want = (d[c] + d[2 + c]) / 4.0;
                assert!((with_kp[2][j * 2 + c] - want).abs() < 1e-6, "dV[{j}][{c}] {} vs {want}", with_kp[2][j * 2 + c]);
            }
        }
    }
}
