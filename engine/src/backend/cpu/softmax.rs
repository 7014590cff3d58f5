//! CPU kernels of ops/softmax.rs, parallel over rows. f32 rows along the last axis (attention's
//! scores) take vectorised row kernels: `exp_poly` (vmath.rs) for libm's scalar exp, and 16-lane
//! maxima and sums (a sequential f32 sum does not vectorise); the rest the generic loops.

use rayon::prelude::*;

use super::elementwise::{first, FloatElem};
use super::tensor_view::{In, Out};
use super::vmath::{exp_poly, LANES};
use super::{CpuCtx, KernelTable};
use crate::error::Result;
use crate::ir::Node;
use crate::ops::softmax_layout_of;
use crate::simd::multiversion;
use crate::tensor::DType;

/// Runs `f(group_in..., group_out)` over each (outer index) block of n·inner elements.
fn softmax_rows<T: FloatElem>(x: &[T], y: &mut [T], n: usize, inner: usize, log: bool) {
    let block = n * inner;
    if block == 0 {
        return;
    }
    let run = |(xb, yb): (&[T], &mut [T])| {
        for j in 0..inner {
            let mut m = T::neg_infinity();
            for k in 0..n {
                m = m.max(xb[k * inner + j]);
            }
            let mut s = T::zero();
            for k in 0..n {
                let e = (xb[k * inner + j] - m).exp();
                yb[k * inner + j] = e;
                s = s + e;
            }
            if log {
                let ls = s.ln() + m;
                for k in 0..n {
                    yb[k * inner + j] = xb[k * inner + j] - ls;
                }
            } else {
                let inv = T::one() / s;
                for k in 0..n {
                    yb[k * inner + j] = yb[k * inner + j] * inv;
                }
            }
        }
    };
    if x.len() >= 1 << 14 {
        x.par_chunks(block).zip(y.par_chunks_mut(block)).for_each(run);
    } else {
        x.chunks(block).zip(y.chunks_mut(block)).for_each(run);
    }
}

/// e^d, and 0 where d < −87 (there e^d is a denormal or 0: `exp_poly` clamps at −87), so that
/// masked scores (−∞ or finfo.min) get probability 0 as in PyTorch; NaN stays NaN.
#[inline(always)]
pub(super) fn exp_or_zero<const FMA: bool>(d: f32) -> f32 {
    let e = exp_poly::<FMA>(d);
    if d < -87.0 {
        0.0
    } else {
        e
    }
}

/// The largest element (−∞ for none; a NaN never wins: its exp is NaN, and so is the row).
#[inline(always)]
pub(super) fn row_max(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = if v > *l { v } else { *l };
        }
    }
    lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// Σ f(a[k], b[k]) in LANES partial sums.
#[inline(always)]
pub(super) fn lane_sum(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let (ac, bc) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(&x, &y)| f(x, y)).sum();
    for (xs, ys) in ac.zip(bc) {
        for ((s, &x), &y) in acc.iter_mut().zip(xs).zip(ys) {
            *s += f(x, y);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// y = softmax(x) (or log-softmax) of one f32 row.
#[inline(always)]
fn softmax_row_body<const FMA: bool>(y: &mut [f32], x: &[f32], log: bool) {
    let n = x.len().min(y.len());
    let (x, y) = (&x[..n], &mut y[..n]);
    let m = row_max(x);
    // the shifted exps into y, summed in LANES partial sums
    let mut acc = [0f32; LANES];
    let (mut yc, mut xc) = (y.chunks_exact_mut(LANES), x.chunks_exact(LANES));
    for (ys, xs) in (&mut yc).zip(&mut xc) {
        for ((o, &v), s) in ys.iter_mut().zip(xs).zip(acc.iter_mut()) {
            *o = exp_or_zero::<FMA>(v - m);
            *s += *o;
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for (o, &v) in yc.into_remainder().iter_mut().zip(xc.remainder()) {
        *o = exp_or_zero::<FMA>(v - m);
        sum += *o;
    }
    if log {
        let ls = m + sum.ln();
        y.iter_mut().zip(x).for_each(|(o, &v)| *o = v - ls);
    } else {
        let inv = 1.0 / sum;
        y.iter_mut().for_each(|o| *o *= inv);
    }
}

/// The gradient of one f32 row: softmax's y·(dy − Σ dy·y), log-softmax's dy − e^y·Σ dy.
#[inline(always)]
fn softmax_grad_row_body<const FMA: bool>(o: &mut [f32], dy: &[f32], y: &[f32], log: bool) {
    let n = o.len().min(dy.len()).min(y.len());
    let (o, dy, y) = (&mut o[..n], &dy[..n], &y[..n]);
    if log {
        let s = lane_sum(dy, dy, |d, _| d);
        o.iter_mut().zip(dy.iter().zip(y)).for_each(|(o, (&d, &v))| *o = d - exp_or_zero::<FMA>(v) * s);
    } else {
        let s = lane_sum(dy, y, |d, v| d * v);
        o.iter_mut().zip(dy.iter().zip(y)).for_each(|(o, (&d, &v))| *o = v * (d - s));
    }
}

multiversion!(softmax_row, softmax_row_body, (y: &mut [f32], x: &[f32], log: bool) -> ());
multiversion!(softmax_grad_row, softmax_grad_row_body, (o: &mut [f32], dy: &[f32], y: &[f32], log: bool) -> ());

/// Rows per parallel task of the f32 row kernels: about 16 K elements each.
fn rows_per_task(n: usize) -> usize {
    ((1 << 14) / n.max(1)).max(1)
}

/// The f32 row kernels over rows of n (the last axis).
fn f32_rows(x: &[f32], y: &mut [f32], n: usize, log: bool) {
    let task = rows_per_task(n) * n;
    x.par_chunks(task).zip(y.par_chunks_mut(task)).for_each(|(xs, ys)| {
        xs.chunks_exact(n).zip(ys.chunks_exact_mut(n)).for_each(|(xr, yr)| softmax_row::call(yr, xr, log));
    });
}

/// As `f32_rows`, for the gradient.
fn f32_grad_rows(dy: &[f32], y: &[f32], o: &mut [f32], n: usize, log: bool) {
    let task = rows_per_task(n) * n;
    o.par_chunks_mut(task).zip(dy.par_chunks(task).zip(y.par_chunks(task))).for_each(|(os, (ds, ys))| {
        os.chunks_exact_mut(n).zip(ds.chunks_exact(n).zip(ys.chunks_exact(n))).for_each(|(o, (d, v))| softmax_grad_row::call(o, d, v, log));
    });
}

fn softmax(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let (_, n, inner) = softmax_layout_of(node, x.shape)?;
    let log = node.op_type == "LogSoftmax";
    if x.dtype == DType::F32 && inner == 1 && n > 0 {
        f32_rows(x.slice::<f32>()?, out[0].slice::<f32>()?, n, log);
        return Ok(());
    }
    fn go<T: FloatElem>(x: &In, o: &mut Out, n: usize, inner: usize, log: bool) -> Result<()> {
        softmax_rows(x.slice::<T>()?, o.slice::<T>()?, n, inner, log);
        Ok(())
    }
    crate::dispatch_float!(x.dtype, node, go::<T>(x, &mut out[0], n, inner, log))
}

fn softmax_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    let y = inputs.get(1).and_then(|v| v.as_ref()).ok_or_else(|| node.err("input 1 missing"))?;
    let (_, n, inner) = softmax_layout_of(node, dy.shape)?;
    let log = node.op_type == "LogSoftmaxGrad";
    if dy.dtype == DType::F32 && y.dtype == DType::F32 && inner == 1 && n > 0 {
        f32_grad_rows(dy.slice::<f32>()?, y.slice::<f32>()?, out[0].slice::<f32>()?, n, log);
        return Ok(());
    }
    fn go<T: FloatElem>(dy: &In, y: &In, o: &mut Out, n: usize, inner: usize, log: bool) -> Result<()> {
        let (dv, yv, ov) = (dy.slice::<T>()?, y.slice::<T>()?, o.slice::<T>()?);
        let block = n * inner;
        if block == 0 {
            return Ok(());
        }
        let run = |((db, yb), ob): ((&[T], &[T]), &mut [T])| {
            for j in 0..inner {
                let mut s = T::zero();
                for k in 0..n {
                    let i = k * inner + j;
                    s = s + if log { db[i] } else { db[i] * yb[i] };
                }
                for k in 0..n {
                    let i = k * inner + j;
                    ob[i] = if log { db[i] - yb[i].exp() * s } else { yb[i] * (db[i] - s) };
                }
            }
        };
        if dv.len() >= 1 << 14 {
            dv.par_chunks(block).zip(yv.par_chunks(block)).zip(ov.par_chunks_mut(block)).for_each(run);
        } else {
            dv.chunks(block).zip(yv.chunks(block)).zip(ov.chunks_mut(block)).for_each(run);
        }
        Ok(())
    }
    crate::dispatch_float!(dy.dtype, node, go::<T>(dy, y, &mut out[0], n, inner, log))
}

pub fn register(t: &mut KernelTable) {
    t.add("Softmax", softmax);
    t.add("LogSoftmax", softmax);
    t.add("SoftmaxGrad", softmax_grad);
    t.add("LogSoftmaxGrad", softmax_grad);
}

#[cfg(test)]
mod tests {
    use super::{f32_grad_rows, f32_rows, softmax_rows};

    fn row(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|k| (((k + seed) * 7919) % 1000) as f32 / 61.0 - 8.0).collect()
    }

    /// f32 rows of several lengths (tails of the 16 lanes), masked scores (−∞, finfo.min): the
    /// vectorised rows within a few ULP of f64 softmax and log-softmax, masked entries exactly 0
    /// (softmax) and their gradients 0, as the generic loop gives them.
    #[test]
    fn f32_rows_match_f64_softmax_and_its_gradient() {
        for n in [1usize, 7, 16, 35, 256, 1000] {
            let mut x: Vec<f32> = (0..3).flat_map(|r| row(n, r)).collect();
            if n > 4 {
                x[3] = f32::NEG_INFINITY;
                x[n + 1] = f32::MIN;
            }
            let dy: Vec<f32> = (0..3).flat_map(|r| row(n, r + 11)).map(|v| v / 8.0).collect();
            for log in [false, true] {
                let mut y = vec![0f32; 3 * n];
                f32_rows(&x, &mut y, n, log);
                let mut g = vec![0f32; 3 * n];
                f32_grad_rows(&dy, &y, &mut g, n, log);
                for r in 0..3 {
                    let xr: Vec<f64> = x[r * n..(r + 1) * n].iter().map(|&v| v as f64).collect();
                    let m = xr.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let s: f64 = xr.iter().map(|v| (v - m).exp()).sum();
                    let p: Vec<f64> = xr.iter().map(|v| (v - m).exp() / s).collect();
                    let d: Vec<f64> = dy[r * n..(r + 1) * n].iter().map(|&v| v as f64).collect();
                    let (sum_d, sum_dp) = (d.iter().sum::<f64>(), d.iter().zip(&p).map(|(a, b)| a * b).sum::<f64>());
                    for k in 0..n {
                        let (got, grad) = (y[r * n + k] as f64, g[r * n + k] as f64);
                        if log {
                            let want = xr[k] - m - s.ln();
                            if want.is_finite() && want > -1e30 {
                                // x − (m + ln Σ): f32 roundings at the magnitude of x and of the log-sum-exp
                                let scale = xr[k].abs() + (m + s.ln()).abs() + 1.0;
                                assert!((got - want).abs() <= 2.5e-7 * scale, "n {n} log row {r}[{k}]: {got} vs {want}");
                            }
                            let want_g = d[k] - p[k] * sum_d;
                            assert!((grad - want_g).abs() <= 1e-5 * sum_d.abs().max(1.0), "n {n} log grad {r}[{k}]: {grad} vs {want_g}");
                        } else {
                            // e^(x − m) of an f32 difference: its rounding scales with |x − m|
                            let rel = 1e-6 + 1.2e-7 * (xr[k] - m).abs().min(100.0);
                            assert!((got - p[k]).abs() <= rel * p[k] + 1e-37, "n {n} row {r}[{k}]: {got} vs {}", p[k]);
                            let want_g = p[k] * (d[k] - sum_dp);
                            assert!((grad - want_g).abs() <= 1e-5 * p[k].max(1e-30), "n {n} grad {r}[{k}]: {grad} vs {want_g}");
                            if xr[k] < -1e30 {
                                assert!(got == 0.0 && grad == 0.0, "a masked score's probability and gradient are 0");
                            }
                        }
                    }
                }
            }
        }
    }

    /// A row holding a NaN, and a row of only −∞: NaN throughout, as the generic loop gives.
    #[test]
    fn nan_and_fully_masked_rows_are_nan_as_before() {
        let n = 20;
        let mut x = row(2 * n, 3);
        x[5] = f32::NAN;
        x[n..].fill(f32::NEG_INFINITY);
        for log in [false, true] {
            let (mut fast, mut slow) = (vec![0f32; 2 * n], vec![0f32; 2 * n]);
            f32_rows(&x, &mut fast, n, log);
            softmax_rows(&x, &mut slow, n, 1, log);
            assert!(fast.iter().all(|v| v.is_nan()), "log {log}: {fast:?}");
            assert!(slow.iter().all(|v| v.is_nan()), "log {log}: {slow:?}");
        }
    }
}
