//! CPU kernels of ops/norm.rs: LayerNormalization forward (f64 accumulation of the row
//! statistics) and its fused backward, parallel over rows.

use rayon::prelude::*;

use super::elementwise::{first, FloatElem};
use super::tensor_view::{In, Out};
use super::{CpuCtx, KernelTable};
use crate::error::Result;
use crate::ir::Node;
use crate::ops::layer_norm_layout_of;

/// Independent f64 partial sums per row reduction: one running sum is a chain of dependent
/// additions (4 cycles each), which held the tutorial's LayerNorm (rows of 200) at ~1.4 ns an
/// element forward and ~2.3 backward.
const LANES: usize = 8;

/// Σ f(v, j) over the row in f64, for N sums at once, each in `LANES` partial sums.
#[inline(always)]
pub(super) fn row_sums<T: FloatElem, const N: usize>(row: &[T], f: impl Fn(f64, usize) -> [f64; N]) -> [f64; N] {
    let mut acc = [[0f64; N]; LANES];
    let whole = row.len() - row.len() % LANES;
    for (c, chunk) in row[..whole].chunks_exact(LANES).enumerate() {
        for (l, (a, &v)) in acc.iter_mut().zip(chunk).enumerate() {
            a.iter_mut().zip(f(v.as_(), c * LANES + l)).for_each(|(a, t)| *a += t);
        }
    }
    std::array::from_fn(|s| {
        let tail: f64 = row[whole..].iter().enumerate().map(|(l, &v)| f(v.as_(), whole + l)[s]).sum();
        acc.iter().map(|a| a[s]).sum::<f64>() + tail
    })
}

fn stats<T: FloatElem>(row: &[T], eps: f64) -> (f64, f64) {
    let n = row.len() as f64;
    let [mean] = row_sums(row, |v, _| [v]).map(|s| s / n);
    let [var] = row_sums(row, |v, _| [(v - mean).powi(2)]).map(|s| s / n);
    (mean, 1.0 / (var + eps).sqrt())
}

fn layer_norm(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let scale = inputs.get(1).and_then(|v| v.as_ref()).ok_or_else(|| node.err("scale missing"))?;
    let bias = inputs.get(2).and_then(|v| v.as_ref());
    let eps = node.attrs.float("epsilon", 1e-5)? as f64;
    let (_, n) = layer_norm_layout_of(node, x.shape)?;
    fn go<T: FloatElem>(x: &In, scale: &In, bias: Option<&In>, out: &mut [Out], n: usize, eps: f64) -> Result<()> {
        let (xv, sv) = (x.slice::<T>()?, scale.slice::<T>()?);
        let bv = match bias {
            Some(b) => Some(b.slice::<T>()?),
            None => None,
        };
        let (y, rest) = out.split_first_mut().expect("one output at least");
        let yv = y.slice::<T>()?;
        if n == 0 {
            return Ok(());
        }
        let stats_v: Vec<(f64, f64)> = xv
            .par_chunks(n)
            .zip(yv.par_chunks_mut(n))
            .map(|(xr, yr)| {
                let (mean, rstd) = stats(xr, eps);
                for j in 0..n {
                    let h = T::from_f64((xr[j].as_() - mean) * rstd);
                    yr[j] = h * sv[j] + bv.map_or(T::zero(), |b| b[j]);
                }
                (mean, rstd)
            })
            .collect();
        // optional Mean and InvStdDev outputs (float32, or float64 for double inputs)
        for (k, o) in rest.iter_mut().enumerate() {
            let pick = |s: &(f64, f64)| if k == 0 { s.0 } else { s.1 };
            match o.dtype {
                crate::tensor::DType::F64 => o.slice::<f64>()?.iter_mut().zip(&stats_v).for_each(|(v, s)| *v = pick(s)),
                _ => o.slice::<f32>()?.iter_mut().zip(&stats_v).for_each(|(v, s)| *v = pick(s) as f32),
            }
        }
        Ok(())
    }
    crate::dispatch_float!(x.dtype, node, go::<T>(x, scale, bias, out, n, eps))
}

fn layer_norm_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    let x = inputs.get(1).and_then(|v| v.as_ref()).ok_or_else(|| node.err("x missing"))?;
    let scale = inputs.get(2).and_then(|v| v.as_ref()).ok_or_else(|| node.err("scale missing"))?;
    let eps = node.attrs.float("epsilon", 1e-5)? as f64;
    let dres = inputs.get(5).and_then(|v| v.as_ref());
    let (_, n) = layer_norm_layout_of(node, x.shape)?;
    let (half, col_sum) = crate::ops::layer_norm_grad_extras_of(node)?;
    let want = crate::ops::layer_norm_grad_output_count_of((half, col_sum));
    if out.len() < want {
        return Err(node.err(format!("{} outputs given, {want} asked for by its attributes", out.len())));
    }
    #[allow(clippy::too_many_arguments)]
    fn go<T: FloatElem>(
        dy: &In,
        x: &In,
        scale: &In,
        dres: Option<&In>,
        out: &mut [Out],
        n: usize,
        eps: f64,
        extras: (Option<usize>, Option<usize>),
    ) -> Result<()> {
        let (dv, xv, sv) = (dy.slice::<T>()?, x.slice::<T>()?, scale.slice::<T>()?);
        let (dx, rest) = out.split_first_mut().expect("three outputs");
        let dxv = dx.slice::<T>()?;
        if n == 0 {
            return Ok(());
        }
        // per-row dx, and per-row partial sums for dscale/dbias reduced afterwards
        let partial: Vec<(Vec<f64>, Vec<f64>)> = dv
            .par_chunks(n * 16)
            .zip(xv.par_chunks(n * 16))
            .zip(dxv.par_chunks_mut(n * 16))
            .map(|((db, xb), ob)| {
                let mut ds = vec![0f64; n];
                let mut dbias = vec![0f64; n];
                for ((dr, xr), or) in db.chunks(n).zip(xb.chunks(n)).zip(ob.chunks_mut(n)) {
                    let (mean, rstd) = stats(xr, eps);
                    for j in 0..n {
                        let h = (xr[j].as_() - mean) * rstd;
                        let d = dr[j].as_();
                        ds[j] += d * h;
                        dbias[j] += d;
                    }
                    let [a, b] = row_sums(dr, |d, j| {
                        let dg = d * sv[j].as_();
                        [dg, dg * ((xr[j].as_() - mean) * rstd)]
                    })
                    .map(|s| s / n as f64);
                    for j in 0..n {
                        let h = (xr[j].as_() - mean) * rstd;
                        let dg = dr[j].as_() * sv[j].as_();
                        or[j] = T::from_f64(rstd * (dg - a - h * b));
                    }
                }
                (ds, dbias)
            })
            .collect();
        // the residual stream's gradient, summed as the Add it replaces does: rounded dx + dres
        if let Some(dres) = dres {
            dxv.iter_mut().zip(dres.slice::<T>()?).for_each(|(d, r)| *d = *d + *r);
        }
        // rest is outputs 1.. (output k at k - 1)
        for (j, d) in rest[0].slice::<T>()?.iter_mut().enumerate() {
            *d = T::from_f64(partial.iter().map(|p| p.0[j]).sum());
        }
        for (j, d) in rest[1].slice::<T>()?.iter_mut().enumerate() {
            *d = T::from_f64(partial.iter().map(|p| p.1[j]).sum());
        }
        // dx_half_type's copy (widen.rs rounds it to 16 bits)
        if let Some(k) = extras.0 {
            rest[k - 1].slice::<T>()?.copy_from_slice(dxv);
        }
        // dx_col_sum: the SumRows kernel's column sums of dx viewed as [rows, n]
        if let Some(k) = extras.1 {
            let rows = [dxv.len() / n, n];
            super::linear::column_sums::<T>(&dx.reshaped(&rows).as_input(), &mut rest[k - 1])?;
        }
        Ok(())
    }
    crate::dispatch_float!(dy.dtype, node, go::<T>(dy, x, scale, dres, out, n, eps, (half, col_sum)))
}

pub fn register(t: &mut KernelTable) {
    t.add("LayerNormalization", layer_norm);
    t.add("LayerNormGrad", layer_norm_grad);
}
