//! CPU kernels of ops/batchnorm.rs: statistics per channel (f64 accumulation, parallel over
//! channels), then the element-wise pass parallel over (n, c) planes.

use rayon::prelude::*;

use super::elementwise::{first, FloatElem};
use super::tensor_view::{In, Out};
use super::{CpuCtx, KernelTable, PAR_MIN};
use crate::error::Result;
use crate::ir::Node;

fn nth<'a, 'b>(node: &Node, inputs: &'b [Option<In<'a>>], i: usize) -> Result<&'b In<'a>> {
    inputs.get(i).and_then(|x| x.as_ref()).ok_or_else(|| node.err(format!("input {i} missing")))
}

/// (mean, biased variance) per channel of x [N, C, plane...].
fn channel_stats<T: FloatElem>(xv: &[T], n: usize, c: usize, plane: usize) -> Vec<(f64, f64)> {
    let count = (n * plane).max(1) as f64;
    let stat = |ch: usize| {
        let mut s = 0f64;
        for i in 0..n {
            s += xv[(i * c + ch) * plane..][..plane].iter().map(|v| v.as_()).sum::<f64>();
        }
        let mean = s / count;
        let mut q = 0f64;
        for i in 0..n {
            q += xv[(i * c + ch) * plane..][..plane].iter().map(|v| (v.as_() - mean).powi(2)).sum::<f64>();
        }
        (mean, q / count)
    };
    if xv.len() >= PAR_MIN {
        (0..c).into_par_iter().map(stat).collect()
    } else {
        (0..c).map(stat).collect()
    }
}

/// Applies `f(channel, plane_in_index, out_plane)` to every (n, c) plane of `out`.
fn planes<T: Send>(out: &mut [T], c: usize, plane: usize, f: impl Fn(usize, usize, &mut [T]) + Sync + Send) {
    if plane == 0 {
        return;
    }
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(plane).enumerate().for_each(|(p, o)| f(p % c, p, o));
    } else {
        out.chunks_mut(plane).enumerate().for_each(|(p, o)| f(p % c, p, o));
    }
}

fn layout(node: &Node, x: &In) -> Result<(usize, usize, usize)> {
    if x.shape.len() < 2 {
        return Err(node.err(format!("input {:?} must be [N, C, ...]", x.shape)));
    }
    Ok((x.shape[0], x.shape[1], x.shape[2..].iter().product()))
}

fn batch_norm(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let (scale, bias, mean, var) = (nth(node, inputs, 1)?, nth(node, inputs, 2)?, nth(node, inputs, 3)?, nth(node, inputs, 4)?);
    let eps = node.attrs.float("epsilon", 1e-5).map_err(|e| node.err(e.to_string()))? as f64;
    let momentum = node.attrs.float("momentum", 0.9).map_err(|e| node.err(e.to_string()))? as f64;
    let training = node.attrs.int("training_mode", 0).map_err(|e| node.err(e.to_string()))? != 0;
    let unbiased = node.attrs.int("unbiased_running_var", 0).map_err(|e| node.err(e.to_string()))? != 0;
    let (n, c, plane) = layout(node, x)?;
    #[allow(clippy::too_many_arguments)]
    fn go<T: FloatElem>(
        x: &In,
        p: [&In; 4],
        out: &mut [Out],
        (n, c, plane): (usize, usize, usize),
        eps: f64,
        momentum: f64,
        training: bool,
        unbiased: bool,
    ) -> Result<()> {
        let xv = x.slice::<T>()?;
        let [sv, bv, mv, vv] = [p[0].slice::<T>()?, p[1].slice::<T>()?, p[2].slice::<T>()?, p[3].slice::<T>()?];
        let stats: Vec<(f64, f64)> =
            if training { channel_stats(xv, n, c, plane) } else { (0..c).map(|k| (mv[k].as_(), vv[k].as_())).collect() };
        // y = x·a + b per channel
        let coef: Vec<(f64, f64)> = (0..c)
            .map(|k| {
                let a = sv[k].as_() / (stats[k].1 + eps).sqrt();
                (a, bv[k].as_() - stats[k].0 * a)
            })
            .collect();
        let (y, rest) = out.split_first_mut().expect("one output at least");
        let yv = y.slice::<T>()?;
        planes(yv, c, plane, |k, p, o| {
            let (a, b) = coef[k];
            for (yo, &xi) in o.iter_mut().zip(&xv[p * plane..(p + 1) * plane]) {
                *yo = T::from_f64(xi.as_() * a + b);
            }
        });
        let count = n * plane;
        for (j, o) in rest.iter_mut().enumerate() {
            let ov = o.slice::<T>()?;
            for k in 0..c {
                ov[k] = T::from_f64(if j == 0 {
                    mv[k].as_() * momentum + stats[k].0 * (1.0 - momentum)
                } else {
                    let v = if unbiased && count > 1 { stats[k].1 * count as f64 / (count - 1) as f64 } else { stats[k].1 };
                    vv[k].as_() * momentum + v * (1.0 - momentum)
                });
            }
        }
        Ok(())
    }
    crate::dispatch_float!(x.dtype, node, go::<T>(x, [scale, bias, mean, var], out, (n, c, plane), eps, momentum, training, unbiased))
}

/// BatchNormGrad(dy, x, scale, input_mean, input_var) -> (dx, dscale, dbias).
fn batch_norm_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    let (x, scale, mean, var) = (nth(node, inputs, 1)?, nth(node, inputs, 2)?, nth(node, inputs, 3)?, nth(node, inputs, 4)?);
    let eps = node.attrs.float("epsilon", 1e-5).map_err(|e| node.err(e.to_string()))? as f64;
    let training = node.attrs.int("training_mode", 0).map_err(|e| node.err(e.to_string()))? != 0;
    let dims = layout(node, x)?;
    fn go<T: FloatElem>(
        dy: &In,
        x: &In,
        p: [&In; 3],
        out: &mut [Out],
        (n, c, plane): (usize, usize, usize),
        eps: f64,
        training: bool,
    ) -> Result<()> {
        let (dyv, xv) = (dy.slice::<T>()?, x.slice::<T>()?);
        let [sv, mv, vv] = [p[0].slice::<T>()?, p[1].slice::<T>()?, p[2].slice::<T>()?];
        let stats: Vec<(f64, f64)> =
            if training { channel_stats(xv, n, c, plane) } else { (0..c).map(|k| (mv[k].as_(), vv[k].as_())).collect() };
        // per channel: Σdy and Σdy·x̂
        let sums = |k: usize| {
            let (mean, rstd) = (stats[k].0, 1.0 / (stats[k].1 + eps).sqrt());
            let (mut sd, mut sdh) = (0f64, 0f64);
            for i in 0..n {
                let at = (i * c + k) * plane;
                for (d, xi) in dyv[at..at + plane].iter().zip(&xv[at..at + plane]) {
                    let d = d.as_();
                    sd += d;
                    sdh += d * (xi.as_() - mean) * rstd;
                }
            }
            (sd, sdh)
        };
        let sums: Vec<(f64, f64)> =
            if xv.len() >= PAR_MIN { (0..c).into_par_iter().map(sums).collect() } else { (0..c).map(sums).collect() };
        let count = (n * plane).max(1) as f64;
        let (dx, rest) = out.split_first_mut().expect("three outputs");
        let dxv = dx.slice::<T>()?;
        planes(dxv, c, plane, |k, p, o| {
            let (mean, rstd) = (stats[k].0, 1.0 / (stats[k].1 + eps).sqrt());
            let g = sv[k].as_() * rstd;
            let at = p * plane;
            for ((dxo, d), xi) in o.iter_mut().zip(&dyv[at..at + plane]).zip(&xv[at..at + plane]) {
                *dxo = T::from_f64(if training {
                    let h = (xi.as_() - mean) * rstd;
                    g * (d.as_() - sums[k].0 / count - h * sums[k].1 / count)
                } else {
                    g * d.as_()
                });
            }
        });
        let (ds, db) = rest.split_at_mut(1);
        let (dsv, dbv) = (ds[0].slice::<T>()?, db[0].slice::<T>()?);
        for k in 0..c {
            dsv[k] = T::from_f64(sums[k].1);
            dbv[k] = T::from_f64(sums[k].0);
        }
        Ok(())
    }
    crate::dispatch_float!(dy.dtype, node, go::<T>(dy, x, [scale, mean, var], out, dims, eps, training))
}

pub fn register(t: &mut KernelTable) {
    t.add("BatchNormalization", batch_norm);
    t.add("BatchNormGrad", batch_norm_grad);
}

#[cfg(test)]
mod tests {
    use super::super::testutil::run;
    use crate::ir::{Attr, Attrs};
    use crate::tensor::{Data, Tensor};

    fn f64s(shape: Vec<usize>, v: Vec<f64>) -> Tensor {
        Tensor::new(shape, Data::F64(v)).unwrap()
    }

    #[test]
    fn training_mode_stats_and_running_update() {
        // 2 channels, N=2, plane 1: channel 0 = {1, 3} (mean 2, var 1), channel 1 = {2, 2}
        let x = f64s(vec![2, 2], vec![1., 2., 3., 2.]);
        let (s, b) = (f64s(vec![2], vec![2., 1.]), f64s(vec![2], vec![0.5, 0.]));
        let (m, v) = (f64s(vec![2], vec![0., 10.]), f64s(vec![2], vec![1., 1.]));
        let a = Attrs::default().with("training_mode", Attr::Int(1)).with("epsilon", Attr::Float(0.0)).with("momentum", Attr::Float(0.5));
        let r = run("BatchNormalization", a.clone(), &[&x, &s, &b, &m, &v]);
        // y0 = ±1·2 + 0.5; channel 1 has var 0 with eps 0 -> inf·0: skip, check channel 0 only
        let y = r[0].to_f64_vec();
        assert_eq!((y[0], y[2]), (-1.5, 2.5));
        assert_eq!(r[1].to_f64_vec(), vec![1.0, 6.0]);
        assert_eq!(r[2].to_f64_vec(), vec![1.0, 0.5]);
        let r = run("BatchNormalization", a.with("unbiased_running_var", Attr::Int(1)), &[&x, &s, &b, &m, &v]);
        assert_eq!(r[2].to_f64_vec(), vec![1.5, 0.5]);
    }

    #[test]
    fn training_grad_by_hand() {
        // one channel {1, 3}: x̂ = {-1, 1}; dy = {1, 0}: Σdy = 1, Σdy·x̂ = -1
        // dx = s·rstd·(dy − 1/2 − x̂·(−1)/2) = 2·(1 − .5 − .5, 0 − .5 + .5) = (0, 0)
        let x = f64s(vec![2, 1], vec![1., 3.]);
        let dy = f64s(vec![2, 1], vec![1., 0.]);
        let (s, m, v) = (f64s(vec![1], vec![2.]), f64s(vec![1], vec![0.]), f64s(vec![1], vec![1.]));
        let a = Attrs::default().with("training_mode", Attr::Int(1)).with("epsilon", Attr::Float(0.0));
        let r = run("BatchNormGrad", a, &[&dy, &x, &s, &m, &v]);
        assert_eq!((r[0].to_f64_vec(), r[1].to_f64_vec(), r[2].to_f64_vec()), (vec![0., 0.], vec![-1.], vec![1.]));
        // dy = {1, 2}: Σdy = 3, Σdy·x̂ = 1 -> dx = 2·(1 − 1.5 + .5, 2 − 1.5 − .5) = (0, 0)... use {2, 0}
        let dy = f64s(vec![2, 1], vec![3., 1.]);
        let a = Attrs::default().with("training_mode", Attr::Int(0)).with("epsilon", Attr::Float(0.0));
        let r = run("BatchNormGrad", a, &[&dy, &x, &s, &m, &v]);
        // inference: dx = dy·s/√var = 2·dy; dscale = Σdy·(x − 0)/1 = 3 + 3 = 6
        assert_eq!((r[0].to_f64_vec(), r[1].to_f64_vec(), r[2].to_f64_vec()), (vec![6., 2.], vec![6.], vec![4.]));
    }
}
