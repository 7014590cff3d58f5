//! CPU kernels of ops/rms_norm.rs, parallel over blocks of rows. f32 rows run vectorised
//! kernels (f32 lanes of partial sums, added in f64; the CPU's SIMD level picked at run time);
//! other types the reference, row sums in f64 (norm.rs's `row_sums`), as LayerNormalization's.

use rayon::prelude::*;

use super::elementwise::{first, FloatElem};
use super::norm::row_sums;
use super::softmax::lane_sum;
use super::tensor_view::{In, Out};
use super::{CpuCtx, KernelTable};
use crate::error::Result;
use crate::ir::Node;
use crate::ops::rms_norm_layout_of;
use crate::simd::multiversion;
use crate::tensor::DType;

/// Rows per parallel task.
const ROWS_PER_TASK: usize = 16;

fn opt<'v, 'a>(inputs: &'v [Option<In<'a>>], i: usize) -> Option<&'v In<'a>> {
    inputs.get(i).and_then(|v| v.as_ref())
}

/// Writes one statistic per row into `o` (f32, or f64 for f64 inputs).
fn write_stats(o: &mut Out, stats: &[f64]) -> Result<()> {
    match o.dtype {
        DType::F64 => o.slice::<f64>()?.iter_mut().zip(stats).for_each(|(v, s)| *v = *s),
        _ => o.slice::<f32>()?.iter_mut().zip(stats).for_each(|(v, s)| *v = *s as f32),
    }
    Ok(())
}

/// Reads the per-row statistics of `r` as f64.
fn read_stats(r: &In) -> Result<Vec<f64>> {
    Ok(match r.dtype {
        DType::F64 => r.slice::<f64>()?.to_vec(),
        _ => r.slice::<f32>()?.iter().map(|&v| v as f64).collect(),
    })
}

/// One f32 row of RmsNorm: y = x · r [∘ w] (w empty: no scale); returns r.
#[inline(always)]
fn forward_row_body<const FMA: bool>(y: &mut [f32], x: &[f32], w: &[f32], eps: f64) -> f64 {
    let ss = lane_sum(x, x, |a, b| a * b) as f64;
    let r = 1.0 / (ss / x.len() as f64 + eps).sqrt();
    let rf = r as f32;
    if w.is_empty() {
        y.iter_mut().zip(x).for_each(|(y, &v)| *y = v * rf);
    } else {
        y.iter_mut().zip(x).zip(w).for_each(|((y, &v), &w)| *y = v * rf * w);
    }
    r
}

/// One f32 row of RmsNormGrad: dx = r · g − x · r³ Σ(g ∘ x) / n with g = dy [∘ w] (w empty: no
/// scale), and ds += dy ∘ x · r (ds empty: no scale gradient).
#[inline(always)]
fn grad_row_body<const FMA: bool>(dx: &mut [f32], dy: &[f32], x: &[f32], w: &[f32], r: f64, ds: &mut [f32]) {
    if w.is_empty() {
        dx.copy_from_slice(dy);
    } else {
        dx.iter_mut().zip(dy).zip(w).for_each(|((g, &d), &w)| *g = d * w);
    }
    let s = lane_sum(dx, x, |g, v| g * v) as f64;
    let (rf, c) = (r as f32, (r * r * r * s / x.len() as f64) as f32);
    dx.iter_mut().zip(x).for_each(|(g, &v)| *g = rf * *g - v * c);
    ds.iter_mut().zip(dy).zip(x).for_each(|((a, &d), &v)| *a += d * v * rf);
}

multiversion!(forward_row, forward_row_body, (y: &mut [f32], x: &[f32], w: &[f32], eps: f64) -> f64);
multiversion!(grad_row, grad_row_body, (dx: &mut [f32], dy: &[f32], x: &[f32], w: &[f32], r: f64, ds: &mut [f32]) -> ());

/// RmsNorm of f32 rows of `n`.
fn rms_norm_f32(x: &In, scale: Option<&In>, out: &mut [Out], n: usize, eps: f64) -> Result<()> {
    let (xv, w) = (x.slice::<f32>()?, scale.map_or(Ok(&[][..]), |s| s.slice::<f32>())?);
    let [y, r] = out else { return Err(crate::error::Error::other("RmsNorm has two outputs")) };
    let inv: Vec<f64> =
        xv.par_chunks(n).zip(y.slice::<f32>()?.par_chunks_mut(n)).map(|(xr, yr)| forward_row::call(yr, xr, w, eps)).collect();
    write_stats(r, &inv)
}

/// RmsNormGrad's rows in parallel tasks of [`ROWS_PER_TASK`]: `row(dx, dy, x, r, ds)` per row of
/// `n`, with the task's partial column sums `ds` of dscale (n zeros to start, none without
/// `scale_grad`); returns every task's sums.
#[allow(clippy::too_many_arguments)]
fn grad_tasks<T: Sync + Send, A: Copy + Default + Send>(
    dv: &[T],
    xv: &[T],
    dx: &mut [T],
    inv: &[f64],
    n: usize,
    scale_grad: bool,
    row: impl Fn(&mut [T], &[T], &[T], f64, &mut [A]) + Sync,
) -> Vec<Vec<A>> {
    let task = n * ROWS_PER_TASK;
    dv.par_chunks(task)
        .zip(xv.par_chunks(task))
        .zip(dx.par_chunks_mut(task))
        .zip(inv.par_chunks(ROWS_PER_TASK))
        .map(|(((db, xb), ob), rb)| {
            let mut ds = vec![A::default(); if scale_grad { n } else { 0 }];
            for (((dr, xr), or), &r) in db.chunks(n).zip(xb.chunks(n)).zip(ob.chunks_mut(n)).zip(rb) {
                row(or, dr, xr, r, &mut ds);
            }
            ds
        })
        .collect()
}

/// RmsNormGrad of f32 rows of `n`: dx per row; dscale (`scale_grad`) from per-task f32 column
/// sums added in f64.
fn rms_norm_grad_f32(dy: &In, x: &In, scale: Option<&In>, inv: &[f64], out: &mut [Out], n: usize, scale_grad: bool) -> Result<()> {
    let (dv, xv, w) = (dy.slice::<f32>()?, x.slice::<f32>()?, scale.map_or(Ok(&[][..]), |s| s.slice::<f32>())?);
    let (dx, rest) = out.split_first_mut().ok_or_else(|| crate::error::Error::other("RmsNormGrad: no output"))?;
    let partial =
        grad_tasks::<f32, f32>(dv, xv, dx.slice::<f32>()?, inv, n, scale_grad, |or, dr, xr, r, ds| grad_row::call(or, dr, xr, w, r, ds));
    if let Some(dscale) = rest.first_mut() {
        for (j, d) in dscale.slice::<f32>()?.iter_mut().enumerate() {
            *d = partial.iter().map(|p| p[j] as f64).sum::<f64>() as f32;
        }
    }
    Ok(())
}

fn rms_norm(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let scale = opt(inputs, 1);
    let eps = node.attrs.float("epsilon", 1e-6)? as f64;
    let (_, n) = rms_norm_layout_of(node, x.shape, scale.map(|s| s.shape))?;
    if x.dtype == DType::F32 && n > 0 {
        return rms_norm_f32(x, scale, out, n, eps);
    }
    fn go<T: FloatElem>(x: &In, scale: Option<&In>, out: &mut [Out], n: usize, eps: f64) -> Result<()> {
        let xv = x.slice::<T>()?;
        let sv = match scale {
            Some(s) => Some(s.slice::<T>()?),
            None => None,
        };
        let [y, r] = out else { return Err(crate::error::Error::other("RmsNorm has two outputs")) };
        if n == 0 {
            return Ok(());
        }
        let inv: Vec<f64> = xv
            .par_chunks(n)
            .zip(y.slice::<T>()?.par_chunks_mut(n))
            .map(|(xr, yr)| {
                let [ss] = row_sums(xr, |v, _| [v * v]);
                let r = 1.0 / (ss / n as f64 + eps).sqrt();
                for (j, (o, &v)) in yr.iter_mut().zip(xr).enumerate() {
                    let h = v.as_() * r;
                    *o = T::from_f64(sv.map_or(h, |s| h * s[j].as_()));
                }
                r
            })
            .collect();
        write_stats(r, &inv)
    }
    crate::dispatch_float!(x.dtype, node, go::<T>(x, scale, out, n, eps))
}

/// RmsNormGrad(dY, X, scale?, InvRms) -> (dX, dscale?).
fn rms_norm_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    let x = opt(inputs, 1).ok_or_else(|| node.err("X missing"))?;
    let scale = opt(inputs, 2);
    let inv = read_stats(opt(inputs, 3).ok_or_else(|| node.err("InvRms missing"))?)?;
    let (rows, n) = rms_norm_layout_of(node, x.shape, scale.map(|s| s.shape))?;
    if inv.len() != rows || out.len() > 1 + scale.is_some() as usize {
        return Err(node.err(format!("{} statistics for {rows} rows, {} outputs", inv.len(), out.len())));
    }
    let scale_grad = out.len() == 2;
    if dy.dtype == DType::F32 && n > 0 {
        return rms_norm_grad_f32(dy, x, scale, &inv, out, n, scale_grad);
    }
    fn go<T: FloatElem>(dy: &In, x: &In, scale: Option<&In>, inv: &[f64], out: &mut [Out], n: usize, scale_grad: bool) -> Result<()> {
        let (dv, xv) = (dy.slice::<T>()?, x.slice::<T>()?);
        let sv = match scale {
            Some(s) => Some(s.slice::<T>()?),
            None => None,
        };
        let (dx, rest) = out.split_first_mut().ok_or_else(|| crate::error::Error::other("RmsNormGrad: no output"))?;
        if n == 0 {
            return Ok(());
        }
        let w = |j: usize| sv.map_or(1.0, |s| s[j].as_());
        // dX per row; per task, the partial sums of dscale's columns
        let partial = grad_tasks::<T, f64>(dv, xv, dx.slice::<T>()?, inv, n, scale_grad, |or, dr, xr, r, ds| {
            let [s] = row_sums(dr, |d, j| [d * w(j) * xr[j].as_()]);
            let c = r * r * r * s / n as f64;
            for j in 0..n {
                let (d, v) = (dr[j].as_(), xr[j].as_());
                or[j] = T::from_f64(r * w(j) * d - v * c);
            }
            for (j, acc) in ds.iter_mut().enumerate() {
                *acc += dr[j].as_() * xr[j].as_() * r;
            }
        });
        if let Some(dscale) = rest.first_mut() {
            for (j, d) in dscale.slice::<T>()?.iter_mut().enumerate() {
                *d = T::from_f64(partial.iter().map(|p| p[j]).sum());
            }
        }
        Ok(())
    }
    crate::dispatch_float!(dy.dtype, node, go::<T>(dy, x, scale, &inv, out, n, scale_grad))
}

pub fn register(t: &mut KernelTable) {
    t.add("RmsNorm", rms_norm);
    t.add("RmsNormGrad", rms_norm_grad);
}

#[cfg(test)]
mod tests {
    use super::super::testutil::try_run_opt;
    use super::super::CpuCtx;
    use crate::ir::{Attr, Attrs};
    use crate::tensor::{Data, Tensor};

    /// The f32 kernels against the f64 reference on the same values (rows of 37 and 515: lane
    /// tails; 40 rows: a partial task), with and without a scale, and the scale's gradient.
    #[test]
    fn f32_rows_match_the_f64_reference() {
        let data = super::super::testutil::data;
        for n in [37, 515] {
            let rows = 40;
            let (x, dy, w) = (data(rows * n, 1), data(rows * n, 2), data(n, 3).iter().map(|v| 1.0 + v / 2.0).collect::<Vec<f32>>());
            let f32s = |shape: Vec<usize>, v: &[f32]| Tensor::from_f32(shape, v.to_vec());
            let f64s = |shape: Vec<usize>, v: &[f32]| Tensor::new(shape, Data::F64(v.iter().map(|&a| a as f64).collect())).expect("f64");
            let attrs = Attrs::default().with("epsilon", Attr::Float(1e-5));
            for scaled in [true, false] {
                let run = |t: &dyn Fn(Vec<usize>, &[f32]) -> Tensor| {
                    let (xt, dyt, wt) = (t(vec![rows, n], &x), t(vec![rows, n], &dy), t(vec![n], &w));
                    let scale = scaled.then_some(&wt);
                    let fwd = try_run_opt("RmsNorm", attrs.clone(), &[Some(&xt), scale], &mut CpuCtx::new(0)).expect("RmsNorm");
                    let ins = [Some(&dyt), Some(&xt), scale, Some(&fwd[1])];
                    let grads = try_run_opt("RmsNormGrad", attrs.clone(), &ins, &mut CpuCtx::new(0)).expect("RmsNormGrad");
                    fwd.iter().chain(&grads).map(|t| t.to_f64_vec()).collect::<Vec<_>>()
                };
                let (fast, reference) = (run(&f32s), run(&f64s));
                assert_eq!(fast.len(), 3 + scaled as usize);
                for (k, what) in ["y", "1/rms", "dx", "dscale"].iter().enumerate().take(fast.len()) {
                    let top = reference[k].iter().fold(0f64, |m, v| m.max(v.abs()));
                    for (i, (a, b)) in fast[k].iter().zip(&reference[k]).enumerate() {
                        assert!((a - b).abs() <= 2e-6 * top, "n {n}, scaled {scaled}: {what}[{i}] {a} vs the reference's {b}");
                    }
                }
            }
        }
    }

    /// Forward and gradients against the formulas in f64, with and without a scale, on rows
    /// of 37 (a partial block of rows, a partial lane block of columns).
    #[test]
    fn rms_norm_and_its_gradient_follow_the_formulas() {
        let (rows, n) = (35, 37);
        let val = |i: usize, k: f64| ((i as f64) * k).sin() * 2.0;
        let x: Vec<f64> = (0..rows * n).map(|i| val(i, 0.37)).collect();
        let dy: Vec<f64> = (0..rows * n).map(|i| val(i, 1.13)).collect();
        let w: Vec<f64> = (0..n).map(|j| 0.5 + val(j, 0.7)).collect();
        let eps = 1e-5f64;
        let t = |shape: Vec<usize>, v: &[f64]| Tensor::new(shape, Data::F64(v.to_vec())).expect("tensor");
        let (xt, dyt, wt) = (t(vec![5, 7, n], &x), t(vec![5, 7, n], &dy), t(vec![n], &w));
        let attrs = Attrs::default().with("epsilon", Attr::Float(eps as f32));
        let eps = eps as f32 as f64;
        for scaled in [true, false] {
            let wj = |j: usize| if scaled { w[j] } else { 1.0 };
            let scale = scaled.then_some(&wt);
            let fwd = try_run_opt("RmsNorm", attrs.clone(), &[Some(&xt), scale], &mut CpuCtx::new(0)).expect("RmsNorm");
            let (y, r) = (fwd[0].to_f64_vec(), fwd[1].to_f64_vec());
            assert_eq!(fwd[1].shape, vec![5, 7, 1]);
            let mut dw = vec![0f64; n];
            let rt = Tensor::new(vec![5, 7, 1], Data::F64(r.clone())).expect("r");
            let grads = try_run_opt("RmsNormGrad", attrs.clone(), &[Some(&dyt), Some(&xt), scale, Some(&rt)], &mut CpuCtx::new(0))
                .expect("RmsNormGrad");
            assert_eq!(grads.len(), 1 + scaled as usize);
            let dx = grads[0].to_f64_vec();
            for i in 0..rows {
                let row = &x[i * n..(i + 1) * n];
                let want_r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / n as f64 + eps).sqrt();
                assert!((r[i] - want_r).abs() < 1e-12 * want_r, "row {i}: r {} vs {want_r}", r[i]);
                let s: f64 = (0..n).map(|j| dy[i * n + j] * wj(j) * row[j]).sum();
                for j in 0..n {
                    let k = i * n + j;
                    let want_y = row[j] * want_r * wj(j);
                    assert!((y[k] - want_y).abs() < 1e-12, "y[{k}] {} vs {want_y}", y[k]);
                    let want_dx = want_r * wj(j) * dy[k] - row[j] * want_r.powi(3) * s / n as f64;
                    assert!((dx[k] - want_dx).abs() < 1e-11, "dx[{k}] {} vs {want_dx}", dx[k]);
                    dw[j] += dy[k] * row[j] * want_r;
                }
            }
            if scaled {
                let got = grads[1].to_f64_vec();
                for j in 0..n {
                    assert!((got[j] - dw[j]).abs() < 1e-10, "dscale[{j}] {} vs {}", got[j], dw[j]);
                }
            }
        }
    }
}
