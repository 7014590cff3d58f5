//! CPU kernels of ops/attention.rs: the reference the CUDA attention kernels are checked
//! against. One score row at a time in f64 (two-pass softmax), parallel over batch matrices;
//! the backward recomputes each row's probabilities from the saved LSE, as the GPU does.

use rayon::prelude::*;

use super::elementwise::FloatElem;
use super::tensor_view::{In, Out};
use super::CpuCtx;
use super::KernelTable;
use crate::error::Result;
use crate::ir::Node;
use crate::ops::attention::{attention_layout, AttnLayout};

fn req<'v, 'a>(node: &Node, inputs: &'v [Option<In<'a>>], i: usize) -> Result<&'v In<'a>> {
    inputs.get(i).and_then(|v| v.as_ref()).ok_or_else(|| node.err(format!("input {i} missing")))
}

/// (layout, scale, nan_guard) of a node whose Q, Kt, V, mask start at input `first`.
fn setup(node: &Node, inputs: &[Option<In>], first: usize) -> Result<(AttnLayout, f64, bool)> {
    let (q, kt, v) = (req(node, inputs, first)?, req(node, inputs, first + 1)?, req(node, inputs, first + 2)?);
    let mask = inputs.get(first + 3).and_then(|m| m.as_ref()).map(|m| m.shape);
    let l = attention_layout(node, q.shape, kt.shape, v.shape, mask)?;
    Ok((l, node.attrs.float("scale", 1.0)? as f64, node.attrs.int("nan_guard", 0)? != 0))
}

/// The scaled, masked scores of row `t` of batch matrix `b`.
fn scores<T: FloatElem>(l: &AttnLayout, off: &[usize; 4], q: &[T], kt: &[T], mask: Option<&[T]>, scale: f64, t: usize) -> Vec<f64> {
    (0..l.s)
        .map(|j| {
            let dot: f64 = (0..l.d).map(|k| q[off[0] + t * l.d + k].as_() * kt[off[1] + k * l.s + j].as_()).sum();
            let m = match (mask, &l.m) {
                (Some(mv), Some((_, mt, ms))) => mv[off[3] + t * mt + j * ms].as_(),
                _ => 0.0,
            };
            dot * scale + m
        })
        .collect()
}

fn attention(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let (l, scale, guard) = setup(node, inputs, 0)?;
    fn go<T: FloatElem>(node: &Node, l: &AttnLayout, inputs: &[Option<In>], out: &mut [Out], scale: f64, guard: bool) -> Result<()> {
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
                let s = scores(l, &off, q, kt, mask, scale, t);
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
                    let acc: f64 = p.iter().enumerate().map(|(j, pj)| pj * v[off[2] + j * l.dv + c].as_()).sum();
                    *x = T::from_f64(acc / sum);
                }
                lb[t] = (m + sum.ln()) as f32;
            }
        });
        Ok(())
    }
    let dt = req(node, inputs, 0)?.dtype;
    crate::dispatch_float!(dt, node, go::<T>(node, &l, inputs, out, scale, guard))
}

/// AttentionGrad(dO, Q, Kt, V, M?, O, LSE) -> (dQ, dKt, dV).
fn attention_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let (l, scale, _) = setup(node, inputs, 1)?;
    fn go<T: FloatElem>(node: &Node, l: &AttnLayout, inputs: &[Option<In>], out: &mut [Out], scale: f64) -> Result<()> {
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
                let s = scores(l, &off, q, kt, mask, scale, t);
                let p: Vec<f64> =
                    s.iter().map(|&x| if lr == f64::NEG_INFINITY || x == f64::NEG_INFINITY { 0.0 } else { (x - lr).exp() }).collect();
                let delta: f64 = (0..l.dv).map(|c| dorow[c].as_() * o[row * l.dv + c].as_()).sum();
                let mut gq = vec![0f64; l.d];
                for j in 0..l.s {
                    let dp: f64 = (0..l.dv).map(|c| dorow[c].as_() * v[off[2] + j * l.dv + c].as_()).sum();
                    let ds = p[j] * (dp - delta);
                    for c in 0..l.dv {
                        gv[j * l.dv + c] += p[j] * dorow[c].as_();
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
    crate::dispatch_float!(dt, node, go::<T>(node, &l, inputs, out, scale))
}

pub fn register(t: &mut KernelTable) {
    t.add("Attention", attention);
    t.add("AttentionGrad", attention_grad);
}
