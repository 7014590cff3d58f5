//! CPU kernels of ops/pool.rs, parallel over (n, c) planes. 1-D windows run as 2-D with a
//! height of 1. MaxPool keeps the first maximum of a window (NaN wins), as PyTorch does.

use rayon::prelude::*;

use super::elementwise::{first, FloatElem};
use super::tensor_view::{In, Out};
use super::{CpuCtx, KernelTable, PAR_MIN};
use crate::error::Result;
use crate::ir::Node;
use crate::ops::window::Window;

fn window_2d(node: &Node, x: &[usize]) -> Result<Window> {
    Ok(crate::ops::pool_geometry_of(node, x)?.as_2d())
}

/// Visits the valid input positions (ih, iw) of output position (oi, oj).
#[inline]
fn each_tap(w: &Window, oi: usize, oj: usize, mut f: impl FnMut(usize, usize)) {
    let h0 = (oi * w.strides[0]) as isize - w.pad_begin[0] as isize;
    let w0 = (oj * w.strides[1]) as isize - w.pad_begin[1] as isize;
    for ki in 0..w.kernel[0] {
        let ih = h0 + (ki * w.dilations[0]) as isize;
        if ih < 0 || ih >= w.input[0] as isize {
            continue;
        }
        for kj in 0..w.kernel[1] {
            let iw = w0 + (kj * w.dilations[1]) as isize;
            if iw >= 0 && iw < w.input[1] as isize {
                f(ih as usize, iw as usize);
            }
        }
    }
}

/// Runs `f(plane, chunk_a, chunk_b)` over planes of two outputs, in parallel for large work.
fn planes2<A: Send, B: Send>(
    a: &mut [A],
    ca: usize,
    b: &mut [B],
    cb: usize,
    work: usize,
    f: impl Fn(usize, &mut [A], &mut [B]) + Sync + Send,
) {
    if ca == 0 {
        return;
    }
    if work >= PAR_MIN {
        a.par_chunks_mut(ca).zip(b.par_chunks_mut(cb)).enumerate().for_each(|(p, (x, y))| f(p, x, y));
    } else {
        a.chunks_mut(ca).zip(b.chunks_mut(cb)).enumerate().for_each(|(p, (x, y))| f(p, x, y));
    }
}

/// Runs `f(plane, chunk)` over the planes of one output, in parallel for large work.
fn planes1<A: Send>(a: &mut [A], ca: usize, work: usize, f: impl Fn(usize, &mut [A]) + Sync + Send) {
    if ca == 0 {
        return;
    }
    if work >= PAR_MIN {
        a.par_chunks_mut(ca).enumerate().for_each(|(p, x)| f(p, x));
    } else {
        a.chunks_mut(ca).enumerate().for_each(|(p, x)| f(p, x));
    }
}

fn max_pool(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let w = window_2d(node, x.shape)?;
    fn go<T: FloatElem>(x: &In, out: &mut [Out], w: &Window) -> Result<()> {
        let xv = x.slice::<T>()?;
        let (y, rest) = out.split_first_mut().expect("one output at least");
        let yv = y.slice::<T>()?;
        let mut scratch: Vec<i64>;
        let iv: &mut [i64] = match rest.first_mut() {
            Some(o) => o.slice::<i64>()?,
            None => {
                scratch = vec![0i64; yv.len()];
                &mut scratch
            }
        };
        let (ip, op) = (w.in_size(), w.out_size());
        let ow = w.output[1];
        planes2(yv, op, iv, op, yv.len() * w.kernel_size(), |p, ys, is| {
            let plane = &xv[p * ip..(p + 1) * ip];
            for (o, (yo, io)) in ys.iter_mut().zip(is.iter_mut()).enumerate() {
                let (mut best, mut at) = (T::neg_infinity(), -1i64);
                each_tap(w, o / ow, o % ow, |ih, iw| {
                    let v = plane[ih * w.input[1] + iw];
                    if at < 0 || v > best || (v.is_nan() && !best.is_nan()) {
                        best = v;
                        at = (p * ip + ih * w.input[1] + iw) as i64;
                    }
                });
                *yo = best;
                *io = at;
            }
        });
        Ok(())
    }
    crate::dispatch_float!(x.dtype, node, go::<T>(x, out, &w))
}

fn max_pool_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    let idx = inputs.get(1).and_then(|v| v.as_ref()).ok_or_else(|| node.err("input 1 (indices) missing"))?;
    fn go<T: FloatElem>(node: &Node, dy: &In, idx: &In, dx: &mut Out) -> Result<()> {
        let (dyv, iv) = (dy.slice::<T>()?, idx.slice::<i64>()?);
        let ip: usize = dx.shape[2..].iter().product();
        let op: usize = dy.shape[2..].iter().product();
        let dxv = dx.slice::<T>()?;
        let bad = std::sync::atomic::AtomicI64::new(-1);
        let body = |p: usize, plane: &mut [T]| {
            plane.iter_mut().for_each(|v| *v = T::zero());
            let base = (p * ip) as i64;
            for (&d, &i) in dyv[p * op..(p + 1) * op].iter().zip(&iv[p * op..(p + 1) * op]) {
                if i < 0 {
                    continue; // a window entirely in the padding selected nothing
                }
                let j = i - base;
                if j < 0 || j >= ip as i64 {
                    bad.store(i, std::sync::atomic::Ordering::Relaxed);
                    continue;
                }
                plane[j as usize] = plane[j as usize] + d;
            }
        };
        if ip == 0 {
            return Ok(());
        }
        if dxv.len() >= PAR_MIN {
            dxv.par_chunks_mut(ip).enumerate().for_each(|(p, c)| body(p, c));
        } else {
            dxv.chunks_mut(ip).enumerate().for_each(|(p, c)| body(p, c));
        }
        match bad.load(std::sync::atomic::Ordering::Relaxed) {
            -1 => Ok(()),
            i => Err(node.err(format!("index {i} lies outside its (n, c) plane"))),
        }
    }
    crate::dispatch_float!(dy.dtype, node, go::<T>(node, dy, idx, &mut out[0]))
}

/// The divisor of each output position of an AveragePool.
fn avg_divisors(node: &Node, w: &Window) -> Result<Vec<f64>> {
    let include_pad = node.attrs.int("count_include_pad", 0).map_err(|e| node.err(e.to_string()))? != 0;
    let ow = w.output[1];
    Ok((0..w.out_size())
        .map(|o| {
            let (oi, oj) = (o / ow, o % ow);
            let count = |a: usize, oa: usize| -> usize {
                let start = (oa * w.strides[a]) as isize - w.pad_begin[a] as isize;
                let (lo, hi) =
                    if include_pad { (-(w.pad_begin[a] as isize), (w.input[a] + w.pad_end[a]) as isize) } else { (0, w.input[a] as isize) };
                (0..w.kernel[a]).filter(|&k| (lo..hi).contains(&(start + (k * w.dilations[a]) as isize))).count()
            };
            (count(0, oi) * count(1, oj)).max(1) as f64
        })
        .collect())
}

fn average_pool(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let w = window_2d(node, x.shape)?;
    let div = avg_divisors(node, &w)?;
    fn go<T: FloatElem>(x: &In, y: &mut Out, w: &Window, div: &[f64]) -> Result<()> {
        let xv = x.slice::<T>()?;
        let yv = y.slice::<T>()?;
        let (ip, op, ow) = (w.in_size(), w.out_size(), w.output[1]);
        let work = yv.len() * w.kernel_size();
        planes1(yv, op, work, |p, ys| {
            let plane = &xv[p * ip..(p + 1) * ip];
            for (o, yo) in ys.iter_mut().enumerate() {
                let mut s = 0f64;
                each_tap(w, o / ow, o % ow, |ih, iw| s += plane[ih * w.input[1] + iw].as_());
                *yo = T::from_f64(s / div[o]);
            }
        });
        Ok(())
    }
    crate::dispatch_float!(x.dtype, node, go::<T>(x, &mut out[0], &w, &div))
}

fn average_pool_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    let xshape = out[0].shape.to_vec();
    let w = window_2d(node, &xshape)?;
    let div = avg_divisors(node, &w)?;
    fn go<T: FloatElem>(dy: &In, dx: &mut Out, w: &Window, div: &[f64]) -> Result<()> {
        let dyv = dy.slice::<T>()?;
        let dxv = dx.slice::<T>()?;
        let (ip, op, ow) = (w.in_size(), w.out_size(), w.output[1]);
        let work = dxv.len() * w.kernel_size();
        planes1(dxv, ip, work, |p, plane| {
            plane.iter_mut().for_each(|v| *v = T::zero());
            for (o, &d) in dyv[p * op..(p + 1) * op].iter().enumerate() {
                let share = T::from_f64(d.as_() / div[o]);
                each_tap(w, o / ow, o % ow, |ih, iw| {
                    let v = &mut plane[ih * w.input[1] + iw];
                    *v = *v + share;
                });
            }
        });
        Ok(())
    }
    crate::dispatch_float!(dy.dtype, node, go::<T>(dy, &mut out[0], &w, &div))
}

fn global_average_pool(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    fn go<T: FloatElem>(x: &In, y: &mut Out) -> Result<()> {
        let ip: usize = x.shape[2..].iter().product();
        let xv = x.slice::<T>()?;
        let yv = y.slice::<T>()?;
        let mean = |p: usize| T::from_f64(xv[p * ip..(p + 1) * ip].iter().map(|v| v.as_()).sum::<f64>() / ip.max(1) as f64);
        if xv.len() >= PAR_MIN {
            yv.par_iter_mut().enumerate().for_each(|(p, v)| *v = mean(p));
        } else {
            yv.iter_mut().enumerate().for_each(|(p, v)| *v = mean(p));
        }
        Ok(())
    }
    crate::dispatch_float!(x.dtype, node, go::<T>(x, &mut out[0]))
}

fn global_average_pool_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    fn go<T: FloatElem>(dy: &In, dx: &mut Out) -> Result<()> {
        let ip: usize = dx.shape[2..].iter().product();
        let dyv = dy.slice::<T>()?;
        let dxv = dx.slice::<T>()?;
        if ip == 0 {
            return Ok(());
        }
        let scale = 1.0 / ip as f64;
        let body = |p: usize, plane: &mut [T]| {
            let v = T::from_f64(dyv[p].as_() * scale);
            plane.iter_mut().for_each(|o| *o = v);
        };
        if dxv.len() >= PAR_MIN {
            dxv.par_chunks_mut(ip).enumerate().for_each(|(p, c)| body(p, c));
        } else {
            dxv.chunks_mut(ip).enumerate().for_each(|(p, c)| body(p, c));
        }
        Ok(())
    }
    crate::dispatch_float!(dy.dtype, node, go::<T>(dy, &mut out[0]))
}

pub fn register(t: &mut KernelTable) {
    t.add("MaxPool", max_pool);
    t.add("MaxPoolGrad", max_pool_grad);
    t.add("AveragePool", average_pool);
    t.add("AveragePoolGrad", average_pool_grad);
    t.add("GlobalAveragePool", global_average_pool);
    t.add("GlobalAveragePoolGrad", global_average_pool_grad);
}

#[cfg(test)]
mod tests {
    use super::super::testutil::run;
    use crate::ir::{Attr, Attrs};
    use crate::tensor::Tensor;

    fn x44() -> Tensor {
        Tensor::from_f32(vec![1, 1, 4, 4], vec![1., 5., 2., 0., 3., 4., 8., 8., 0., 0., 1., 1., 9., 0., 1., 2.])
    }

    #[test]
    fn max_pool_2x2_with_indices_and_grad() {
        let a = Attrs::default().with("kernel_shape", Attr::Ints(vec![2, 2])).with("strides", Attr::Ints(vec![2, 2]));
        let r = run("MaxPool", a, &[&x44()]);
        assert_eq!(r[0].to_f64_vec(), vec![5., 8., 9., 2.]);
        // ties keep the first: the 8 at (1, 2) = 6, not (1, 3); the 2 at (3, 3) = 15
        assert_eq!(r[1].to_i64_vec().unwrap(), vec![1, 6, 12, 15]);
        let dy = Tensor::from_f32(vec![1, 1, 2, 2], vec![1., 2., 3., 4.]);
        let s = Tensor::from_i64(vec![4], vec![1, 1, 4, 4]);
        let dx = run("MaxPoolGrad", Attrs::default(), &[&dy, &r[1], &s]);
        let mut want = vec![0.0; 16];
        want[1] = 1.;
        want[6] = 2.;
        want[12] = 3.;
        want[15] = 4.;
        assert_eq!(dx[0].to_f64_vec(), want);
    }

    #[test]
    fn max_pool_ceil_and_pads() {
        // 1-D: [1, 3, 2, 5, 4], k 2, s 2, ceil: windows [1,3] [2,5] [4] -> 3 5 4
        let x = Tensor::from_f32(vec![1, 1, 5], vec![1., 3., 2., 5., 4.]);
        let a =
            Attrs::default().with("kernel_shape", Attr::Ints(vec![2])).with("strides", Attr::Ints(vec![2])).with("ceil_mode", Attr::Int(1));
        let r = run("MaxPool", a, &[&x]);
        assert_eq!((r[0].to_f64_vec(), r[1].to_i64_vec().unwrap()), (vec![3., 5., 4.], vec![1, 3, 4]));
        // pads never win, even against negatives
        let x = Tensor::from_f32(vec![1, 1, 2], vec![-1., -2.]);
        let a = Attrs::default().with("kernel_shape", Attr::Ints(vec![2])).with("pads", Attr::Ints(vec![1, 1]));
        assert_eq!(run("MaxPool", a, &[&x])[0].to_f64_vec(), vec![-1., -1., -2.]);
    }

    #[test]
    fn average_pools_and_grads() {
        let x = Tensor::from_f32(vec![1, 1, 3], vec![3., 6., 9.]);
        // k 2, pad 1 each side: windows [pad,3] [6,9]... with stride 2: [p,3] [6,9] ; divisor 1 vs 2
        let a = Attrs::default()
            .with("kernel_shape", Attr::Ints(vec![2]))
            .with("strides", Attr::Ints(vec![2]))
            .with("pads", Attr::Ints(vec![1, 1]));
        assert_eq!(run("AveragePool", a.clone(), &[&x])[0].to_f64_vec(), vec![3., 7.5]);
        let inc = a.clone().with("count_include_pad", Attr::Int(1));
        assert_eq!(run("AveragePool", inc, &[&x])[0].to_f64_vec(), vec![1.5, 7.5]);
        let dy = Tensor::from_f32(vec![1, 1, 2], vec![1., 2.]);
        let s = Tensor::from_i64(vec![3], vec![1, 1, 3]);
        assert_eq!(run("AveragePoolGrad", a, &[&dy, &s])[0].to_f64_vec(), vec![1., 1., 1.]);
        let g = run("GlobalAveragePool", Attrs::default(), &[&x44()]);
        assert_eq!((g[0].shape.clone(), g[0].to_f64_vec()), (vec![1, 1, 1, 1], vec![2.8125]));
        let dy = Tensor::from_f32(vec![1, 1, 1, 1], vec![8.]);
        let s = Tensor::from_i64(vec![4], vec![1, 1, 4, 4]);
        assert_eq!(run("GlobalAveragePoolGrad", Attrs::default(), &[&dy, &s])[0].to_f64_vec(), vec![0.5; 16]);
    }
}
