//! CPU kernels of ops/loss.rs. Scores are [N, C, d...]: sample (n, d) reads C values at stride
//! `inner` = prod(d...). LinearCrossEntropy's kernel is in linear_cross_entropy.rs.

use rayon::prelude::*;

use super::elementwise::{first, FloatElem};
use super::tensor_view::{In, Out};
use super::vmath;
use super::{CpuCtx, KernelTable};
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::DType;

pub(super) struct Layout {
    pub(super) n: usize,
    pub(super) c: usize,
    pub(super) inner: usize,
    pub(super) ignore: Option<i64>,
    pub(super) reduction: String,
    pub(super) softmax: bool,
}

fn layout(node: &Node, scores: &In) -> Result<Layout> {
    Ok(Layout {
        n: scores.shape[0],
        c: scores.shape[1],
        inner: scores.shape[2..].iter().product(),
        ignore: node.attrs.get("ignore_index").map(|_| node.attrs.int("ignore_index", 0)).transpose()?,
        reduction: node.attrs.string("reduction", "mean")?,
        softmax: node.op_type.starts_with("SoftmaxCrossEntropy"),
    })
}

/// Per-sample (label, weight) with the label validated; weight 0 for ignored samples.
pub(super) fn targets(node: &Node, l: &Layout, labels: &In, weights: Option<&In>) -> Result<Vec<(usize, f64)>> {
    let raw = labels.to_tensor().to_i64_vec().ok_or_else(|| node.err("labels must be integers"))?;
    let w = weights.map(|w| w.to_tensor().to_f64_vec());
    raw.iter()
        .map(|&y| {
            if l.ignore == Some(y) {
                return Ok((0, 0.0));
            }
            if y < 0 || y as usize >= l.c {
                return Err(node.err(format!("label {y} is out of range for {} classes", l.c)));
            }
            Ok((y as usize, w.as_ref().map_or(1.0, |w| w[y as usize])))
        })
        .collect()
}

/// log-softmax of sample s at class k, given the sample's max and log-sum-exp.
fn row_stats<T: FloatElem>(x: &[T], base: usize, c: usize, inner: usize) -> (f64, f64) {
    let mut m = f64::NEG_INFINITY;
    for k in 0..c {
        m = m.max(x[base + k * inner].as_());
    }
    let s: f64 = (0..c).map(|k| (x[base + k * inner].as_() - m).exp()).sum();
    (m, s.ln())
}

/// The scores as f32 rows when the vectorised path applies: softmax, [N, C] f32.
fn fast_rows<'a>(x: &In<'a>, l: &Layout) -> Result<Option<&'a [f32]>> {
    Ok(if l.softmax && l.inner == 1 && x.dtype == DType::F32 { Some(x.slice::<f32>()?) } else { None })
}

fn sample_base(s: usize, l: &Layout) -> usize {
    (s / l.inner) * l.c * l.inner + s % l.inner
}

fn loss(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let labels = inputs.get(1).and_then(|v| v.as_ref()).ok_or_else(|| node.err("labels missing"))?;
    let l = layout(node, x)?;
    let t = targets(node, &l, labels, inputs.get(2).and_then(|v| v.as_ref()))?;
    fn go<T: FloatElem>(x: &In, out: &mut [Out], l: &Layout, t: &[(usize, f64)]) -> Result<()> {
        let xv = x.slice::<T>()?;
        let per: Vec<f64> = if let Some(xf) = fast_rows(x, l)? {
            xf.par_chunks(l.c.max(1))
                .zip(t.par_iter())
                .map(|(row, &(y, w))| if w == 0.0 { 0.0 } else { -w * (row[y] as f64 - vmath::row_lse(row) as f64) })
                .collect()
        } else {
            (0..l.n * l.inner)
                .into_par_iter()
                .map(|s| {
                    let (y, w) = t[s];
                    if w == 0.0 {
                        return 0.0;
                    }
                    let base = sample_base(s, l);
                    let logp = if l.softmax {
                        let (m, lse) = row_stats(xv, base, l.c, l.inner);
                        xv[base + y * l.inner].as_() - m - lse
                    } else {
                        xv[base + y * l.inner].as_()
                    };
                    -w * logp
                })
                .collect()
        };
        let (lo, rest) = out.split_first_mut().expect("loss output");
        let lv = lo.slice::<T>()?;
        match l.reduction.as_str() {
            "none" => lv.iter_mut().zip(&per).for_each(|(o, &v)| *o = T::from_f64(v)),
            "sum" => lv[0] = T::from_f64(per.iter().sum()),
            _ => {
                let wsum: f64 = t.iter().map(|p| p.1).sum();
                lv[0] = T::from_f64(if wsum == 0.0 { f64::NAN } else { per.iter().sum::<f64>() / wsum });
            }
        }
        if let Some(lp) = rest.first_mut() {
            let lpv = lp.slice::<T>()?;
            for s in 0..l.n * l.inner {
                let base = sample_base(s, l);
                let (m, lse) = row_stats(xv, base, l.c, l.inner);
                for k in 0..l.c {
                    lpv[base + k * l.inner] = T::from_f64(xv[base + k * l.inner].as_() - m - lse);
                }
            }
        }
        Ok(())
    }
    crate::dispatch_float!(x.dtype, node, go::<T>(x, out, &l, &t))
}

fn loss_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    let x = inputs.get(1).and_then(|v| v.as_ref()).ok_or_else(|| node.err("scores missing"))?;
    let labels = inputs.get(2).and_then(|v| v.as_ref()).ok_or_else(|| node.err("labels missing"))?;
    let l = layout(node, x)?;
    let t = targets(node, &l, labels, inputs.get(3).and_then(|v| v.as_ref()))?;
    fn go<T: FloatElem>(dy: &In, x: &In, o: &mut Out, l: &Layout, t: &[(usize, f64)]) -> Result<()> {
        let (dv, xv) = (dy.slice::<T>()?.iter().map(|v| v.as_()).collect::<Vec<f64>>(), x.slice::<T>()?);
        let wsum: f64 = t.iter().map(|p| p.1).sum();
        let scale = |s: usize| -> f64 {
            match l.reduction.as_str() {
                "none" => dv[s],
                "sum" => dv[0],
                _ => {
                    if wsum == 0.0 {
                        0.0
                    } else {
                        dv[0] / wsum
                    }
                }
            }
        };
        if let (Some(xf), DType::F32) = (fast_rows(x, l)?, o.dtype) {
            let of = o.slice::<f32>()?;
            of.par_chunks_mut(l.c.max(1)).zip(xf.par_chunks(l.c.max(1))).enumerate().for_each(|(s, (orow, row))| {
                let (y, w) = t[s];
                let g = (w * scale(s)) as f32;
                vmath::row_scaled_softmax::call(orow, row, vmath::row_lse(row), g);
                if w != 0.0 {
                    orow[y] -= g;
                }
            });
            return Ok(());
        }
        let ov = o.slice::<T>()?;
        let block = l.c * l.inner;
        ov.par_chunks_mut(block.max(1)).enumerate().for_each(|(i, ob)| {
            for j in 0..l.inner {
                let s = i * l.inner + j;
                let (y, w) = t[s];
                let base = sample_base(s, l) - i * block;
                let g = w * scale(s);
                if l.softmax {
                    let (m, lse) = row_stats(xv, i * block + j, l.c, l.inner);
                    for k in 0..l.c {
                        let p = (xv[i * block + j + k * l.inner].as_() - m - lse).exp();
                        let oh = if k == y && w != 0.0 { 1.0 } else { 0.0 };
                        ob[base + k * l.inner] = T::from_f64(g * (p - oh));
                    }
                } else {
                    for k in 0..l.c {
                        ob[base + k * l.inner] = T::from_f64(if k == y && w != 0.0 { -g } else { 0.0 });
                    }
                }
            }
        });
        Ok(())
    }
    crate::dispatch_float!(x.dtype, node, go::<T>(dy, x, &mut out[0], &l, &t))
}

pub fn register(t: &mut KernelTable) {
    t.add("SoftmaxCrossEntropyLoss", loss);
    t.add("NegativeLogLikelihoodLoss", loss);
    t.add("SoftmaxCrossEntropyLossGrad", loss_grad);
    t.add("NLLLossGrad", loss_grad);
}
