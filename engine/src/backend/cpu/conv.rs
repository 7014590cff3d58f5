//! CPU kernels of ops/conv.rs: im2col + gemm per sample and group (1-D windows run as 2-D with
//! a height of 1). Samples run in parallel when there are enough of them; otherwise the gemm
//! itself runs multi-threaded. A 1×1, stride-1, unpadded convolution skips im2col.

use gemm::Parallelism;
use rayon::prelude::*;

use super::elementwise::{first, FloatElem};
use super::tensor_view::{In, Out};
use super::{CpuCtx, KernelTable};
use crate::error::Result;
use crate::ir::Node;
use crate::ops::window::Window;

/// dst[m×n] (row stride `dst_rs`) = (accumulate ? dst : 0) + a[m×k] · b[k×n], with a and b given
/// by (row stride, column stride).
///
/// # Safety
/// Every pointer must cover its matrix under the given strides; dst must not overlap a or b.
#[allow(clippy::too_many_arguments)]
unsafe fn mm<T: FloatElem>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    dst_rs: usize,
    a: (*const T, isize, isize),
    b: (*const T, isize, isize),
    accumulate: bool,
    par: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                // SAFETY: row i of dst is inside the caller's m×n view.
                unsafe { std::slice::from_raw_parts_mut(dst.add(i * dst_rs), n) }.iter_mut().for_each(|v| *v = T::zero());
            }
        }
        return;
    }
    let parallelism = if par && m * n * k >= 1 << 16 { Parallelism::Rayon(0) } else { Parallelism::None };
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            a.0,
            a.2,
            a.1,
            b.0,
            b.2,
            b.1,
            T::one(),
            T::one(),
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// Per-sample geometry in 2-D: (channels per group, out channels per group, kernel rows·cols,
/// input plane size, output plane size).
struct Geo {
    group: usize,
    cg: usize,
    mg: usize,
    kk: usize,
    in_plane: usize,
    out_plane: usize,
    w: Window,
    /// 1×1 kernel, stride 1, no padding: the input planes are the im2col matrix.
    direct: bool,
}

fn geo(node: &Node, x: &[usize], w: &[usize]) -> Result<Geo> {
    let (group, win) = crate::ops::conv_geometry_of(node, x, w)?;
    let w2 = win.as_2d();
    let direct = w2.kernel == [1, 1] && w2.strides == [1, 1] && w2.pad_begin == [0, 0] && w2.pad_end == [0, 0];
    Ok(Geo {
        group,
        cg: x[1] / group,
        mg: w[0] / group,
        kk: w2.kernel_size(),
        in_plane: w2.in_size(),
        out_plane: w2.out_size(),
        w: w2,
        direct,
    })
}

/// col[(c·kh + ki)·kw + kj][oi·ow + oj] = x[c][oi·sh + ki·dh − ph][oj·sw + kj·dw − pw] (0 outside).
fn im2col<T: FloatElem>(x: &[T], channels: usize, w: &Window, col: &mut [T]) {
    let (h, wd) = (w.input[0] as isize, w.input[1] as isize);
    let (oh, ow) = (w.output[0], w.output[1]);
    let (kh, kw) = (w.kernel[0], w.kernel[1]);
    let ohw = oh * ow;
    for c in 0..channels {
        let plane = &x[c * w.input[0] * w.input[1]..(c + 1) * w.input[0] * w.input[1]];
        for ki in 0..kh {
            for kj in 0..kw {
                let row = &mut col[((c * kh + ki) * kw + kj) * ohw..][..ohw];
                for oi in 0..oh {
                    let ih = (oi * w.strides[0] + ki * w.dilations[0]) as isize - w.pad_begin[0] as isize;
                    let dst = &mut row[oi * ow..(oi + 1) * ow];
                    if ih < 0 || ih >= h {
                        dst.iter_mut().for_each(|v| *v = T::zero());
                        continue;
                    }
                    let src = &plane[ih as usize * w.input[1]..];
                    for (oj, v) in dst.iter_mut().enumerate() {
                        let iw = (oj * w.strides[1] + kj * w.dilations[1]) as isize - w.pad_begin[1] as isize;
                        *v = if iw < 0 || iw >= wd { T::zero() } else { src[iw as usize] };
                    }
                }
            }
        }
    }
}

/// The adjoint of im2col: dx[c][ih][iw] += col[...] (dx must be zeroed by the caller).
fn col2im<T: FloatElem>(col: &[T], channels: usize, w: &Window, dx: &mut [T]) {
    let (h, wd) = (w.input[0] as isize, w.input[1] as isize);
    let (oh, ow) = (w.output[0], w.output[1]);
    let (kh, kw) = (w.kernel[0], w.kernel[1]);
    let ohw = oh * ow;
    for c in 0..channels {
        let plane = &mut dx[c * w.input[0] * w.input[1]..(c + 1) * w.input[0] * w.input[1]];
        for ki in 0..kh {
            for kj in 0..kw {
                let row = &col[((c * kh + ki) * kw + kj) * ohw..][..ohw];
                for oi in 0..oh {
                    let ih = (oi * w.strides[0] + ki * w.dilations[0]) as isize - w.pad_begin[0] as isize;
                    if ih < 0 || ih >= h {
                        continue;
                    }
                    let dst = &mut plane[ih as usize * w.input[1]..];
                    for (oj, &v) in row[oi * ow..(oi + 1) * ow].iter().enumerate() {
                        let iw = (oj * w.strides[1] + kj * w.dilations[1]) as isize - w.pad_begin[1] as isize;
                        if iw >= 0 && iw < wd {
                            dst[iw as usize] = dst[iw as usize] + v;
                        }
                    }
                }
            }
        }
    }
}

/// Runs `f(sample, out_chunk)` over samples: in parallel (single-threaded gemms inside) when
/// there are at least as many samples as threads, else one after another with parallel gemms.
fn per_sample<T: Send>(out: &mut [T], chunk: usize, f: impl Fn(usize, &mut [T], bool) + Sync + Send) {
    if chunk == 0 {
        return;
    }
    let n = out.len() / chunk;
    if n >= rayon::current_num_threads() && n > 1 {
        out.par_chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i, c, false));
    } else {
        out.chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i, c, true));
    }
}

fn conv(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let w = inputs.get(1).and_then(|v| v.as_ref()).ok_or_else(|| node.err("input 1 (W) missing"))?;
    let b = inputs.get(2).and_then(|v| v.as_ref());
    let g = geo(node, x.shape, w.shape)?;
    fn go<T: FloatElem>(x: &In, w: &In, b: Option<&In>, y: &mut Out, g: &Geo) -> Result<()> {
        let (xv, wv) = (x.slice::<T>()?, w.slice::<T>()?);
        let bv = match b {
            Some(b) => Some(b.slice::<T>()?),
            None => None,
        };
        let yv = y.slice::<T>()?;
        let (rows, ohw) = (g.cg * g.kk, g.out_plane);
        let x_sample = g.cg * g.group * g.in_plane;
        per_sample(yv, g.group * g.mg * ohw, |n, ys, par| {
            let mut col = if g.direct { Vec::new() } else { vec![T::zero(); rows * ohw] };
            for gi in 0..g.group {
                let xg = &xv[n * x_sample + gi * g.cg * g.in_plane..][..g.cg * g.in_plane];
                let src: &[T] = if g.direct {
                    xg
                } else {
                    im2col(xg, g.cg, &g.w, &mut col);
                    &col
                };
                let wg = &wv[gi * g.mg * rows..][..g.mg * rows];
                let yg = &mut ys[gi * g.mg * ohw..][..g.mg * ohw];
                // SAFETY: wg is mg×rows, src is rows×ohw, yg is mg×ohw, all row-major and disjoint.
                unsafe {
                    mm(
                        (g.mg, ohw, rows),
                        yg.as_mut_ptr(),
                        ohw,
                        (wg.as_ptr(), rows as isize, 1),
                        (src.as_ptr(), ohw as isize, 1),
                        false,
                        par,
                    )
                };
            }
            if let Some(bv) = bv {
                for (m, row) in ys.chunks_mut(ohw).enumerate() {
                    row.iter_mut().for_each(|v| *v = *v + bv[m]);
                }
            }
        });
        Ok(())
    }
    crate::dispatch_float!(x.dtype, node, go::<T>(x, w, b, &mut out[0], &g))
}

fn conv_grad_x(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    let w = inputs.get(1).and_then(|v| v.as_ref()).ok_or_else(|| node.err("input 1 (W) missing"))?;
    let xshape = out[0].shape.to_vec();
    let g = geo(node, &xshape, w.shape)?;
    fn go<T: FloatElem>(dy: &In, w: &In, dx: &mut Out, g: &Geo) -> Result<()> {
        let (dyv, wv) = (dy.slice::<T>()?, w.slice::<T>()?);
        let dxv = dx.slice::<T>()?;
        let (rows, ohw) = (g.cg * g.kk, g.out_plane);
        let dy_sample = g.group * g.mg * ohw;
        per_sample(dxv, g.group * g.cg * g.in_plane, |n, dxs, par| {
            let mut col = vec![T::zero(); rows * ohw];
            if !g.direct {
                dxs.iter_mut().for_each(|v| *v = T::zero());
            }
            for gi in 0..g.group {
                let wg = &wv[gi * g.mg * rows..][..g.mg * rows];
                let dyg = &dyv[n * dy_sample + gi * g.mg * ohw..][..g.mg * ohw];
                let dxg = &mut dxs[gi * g.cg * g.in_plane..][..g.cg * g.in_plane];
                let dst = if g.direct { dxg.as_mut_ptr() } else { col.as_mut_ptr() };
                // SAFETY: wgᵀ is rows×mg (strides 1, rows), dyg is mg×ohw, dst is rows×ohw.
                unsafe { mm((rows, ohw, g.mg), dst, ohw, (wg.as_ptr(), 1, rows as isize), (dyg.as_ptr(), ohw as isize, 1), false, par) };
                if !g.direct {
                    col2im(&col, g.cg, &g.w, dxg);
                }
            }
        });
        Ok(())
    }
    crate::dispatch_float!(dy.dtype, node, go::<T>(dy, w, &mut out[0], &g))
}

fn conv_grad_w(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    let x = inputs.get(1).and_then(|v| v.as_ref()).ok_or_else(|| node.err("input 1 (X) missing"))?;
    let wshape = out[0].shape.to_vec();
    let g = geo(node, x.shape, &wshape)?;
    fn go<T: FloatElem>(dy: &In, x: &In, dw: &mut Out, g: &Geo) -> Result<()> {
        let (dyv, xv) = (dy.slice::<T>()?, x.slice::<T>()?);
        let dwv = dw.slice::<T>()?;
        let n = x.shape[0];
        let (rows, ohw) = (g.cg * g.kk, g.out_plane);
        let (x_sample, dy_sample) = (g.group * g.cg * g.in_plane, g.group * g.mg * ohw);
        // dW_g += dy_g[n] · col_nᵀ, into one partial per rayon task, summed at the end
        let accumulate_sample = |n: usize, acc: &mut [T], col: &mut Vec<T>, par: bool| {
            for gi in 0..g.group {
                let xg = &xv[n * x_sample + gi * g.cg * g.in_plane..][..g.cg * g.in_plane];
                let src: &[T] = if g.direct {
                    xg
                } else {
                    im2col(xg, g.cg, &g.w, col);
                    col
                };
                let dyg = &dyv[n * dy_sample + gi * g.mg * ohw..][..g.mg * ohw];
                let dwg = &mut acc[gi * g.mg * rows..][..g.mg * rows];
                // SAFETY: dyg is mg×ohw, srcᵀ is ohw×rows (strides 1, ohw), dwg is mg×rows.
                unsafe {
                    mm(
                        (g.mg, rows, ohw),
                        dwg.as_mut_ptr(),
                        rows,
                        (dyg.as_ptr(), ohw as isize, 1),
                        (src.as_ptr(), 1, ohw as isize),
                        true,
                        par,
                    )
                };
            }
        };
        dwv.iter_mut().for_each(|v| *v = T::zero());
        let len = dwv.len();
        if n >= rayon::current_num_threads() && n > 1 {
            let partial = (0..n)
                .into_par_iter()
                .fold(
                    || (vec![T::zero(); len], vec![T::zero(); if g.direct { 0 } else { rows * ohw }]),
                    |(mut acc, mut col), i| {
                        accumulate_sample(i, &mut acc, &mut col, false);
                        (acc, col)
                    },
                )
                .map(|(acc, _)| acc)
                .reduce(
                    || vec![T::zero(); len],
                    |mut a, b| {
                        a.iter_mut().zip(&b).for_each(|(x, y)| *x = *x + *y);
                        a
                    },
                );
            dwv.copy_from_slice(&partial);
        } else {
            let mut col = vec![T::zero(); if g.direct { 0 } else { rows * ohw }];
            for i in 0..n {
                accumulate_sample(i, dwv, &mut col, true);
            }
        }
        Ok(())
    }
    crate::dispatch_float!(dy.dtype, node, go::<T>(dy, x, &mut out[0], &g))
}

fn conv_grad_b(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    fn go<T: FloatElem>(dy: &In, db: &mut Out) -> Result<()> {
        let (n, c) = (dy.shape[0], dy.shape[1]);
        let plane: usize = dy.shape[2..].iter().product();
        let dyv = dy.slice::<T>()?;
        let dbv = db.slice::<T>()?;
        dbv.par_iter_mut().enumerate().for_each(|(ch, o)| {
            let mut s = 0f64;
            for i in 0..n {
                s += dyv[(i * c + ch) * plane..][..plane].iter().map(|v| v.as_()).sum::<f64>();
            }
            *o = T::from_f64(s);
        });
        Ok(())
    }
    crate::dispatch_float!(dy.dtype, node, go::<T>(dy, &mut out[0]))
}

pub fn register(t: &mut KernelTable) {
    t.add("Conv", conv);
    t.add("ConvGradX", conv_grad_x);
    t.add("ConvGradW", conv_grad_w);
    t.add("ConvGradB", conv_grad_b);
}

#[cfg(test)]
mod tests {
    use super::super::testutil::run;
    use crate::ir::{Attr, Attrs};
    use crate::tensor::Tensor;

    #[test]
    fn conv_3x3_pad1_by_hand() {
        // 1×1×3×3 input 1..9, all-ones 3×3 kernel, pad 1: each output sums its 3×3 neighbourhood
        let x = Tensor::from_f32(vec![1, 1, 3, 3], (1..=9).map(|v| v as f32).collect());
        let w = Tensor::from_f32(vec![1, 1, 3, 3], vec![1.0; 9]);
        let b = Tensor::from_f32(vec![1], vec![0.5]);
        let a = Attrs::default().with("pads", Attr::Ints(vec![1, 1, 1, 1]));
        let y = run("Conv", a, &[&x, &w, &b]);
        let want = [12.0, 21.0, 16.0, 27.0, 45.0, 33.0, 24.0, 39.0, 28.0].map(|v: f32| v + 0.5);
        assert_eq!(y[0].to_f64_vec(), want.iter().map(|&v| v as f64).collect::<Vec<_>>());
    }

    #[test]
    fn conv_strided_grouped_and_grads() {
        // 2 groups, stride 2, 1×4 input rows: f64 so the numbers are exact
        let x = Tensor::new(vec![1, 2, 1, 4], crate::tensor::Data::F64(vec![1., 2., 3., 4., 10., 20., 30., 40.])).unwrap();
        let w = Tensor::new(vec![2, 1, 1, 2], crate::tensor::Data::F64(vec![1., -1., 2., 1.])).unwrap();
        let a = Attrs::default().with("group", Attr::Int(2)).with("strides", Attr::Ints(vec![1, 2]));
        let y = run("Conv", a.clone(), &[&x, &w]);
        assert_eq!(y[0].shape, vec![1, 2, 1, 2]);
        assert_eq!(y[0].to_f64_vec(), vec![-1., -1., 40., 100.]);
        let dy = Tensor::new(vec![1, 2, 1, 2], crate::tensor::Data::F64(vec![1., 2., 3., 4.])).unwrap();
        let xs = Tensor::from_i64(vec![4], vec![1, 2, 1, 4]);
        let dx = run("ConvGradX", a.clone(), &[&dy, &w, &xs]);
        assert_eq!(dx[0].to_f64_vec(), vec![1., -1., 2., -2., 6., 3., 8., 4.]);
        let ws = Tensor::from_i64(vec![4], vec![2, 1, 1, 2]);
        let dw = run("ConvGradW", a, &[&dy, &x, &ws]);
        assert_eq!(dw[0].to_f64_vec(), vec![1. + 6., 2. + 8., 30. + 120., 60. + 160.]);
        let db = run("ConvGradB", Attrs::default(), &[&dy]);
        assert_eq!(db[0].to_f64_vec(), vec![3., 7.]);
    }

    #[test]
    fn conv_1d_same_upper_dilated() {
        // x = 1..5, w = [1, 0, -1], dilation 2: extent 5, SAME_UPPER pads (2, 2)
        let x = Tensor::from_f32(vec![1, 1, 5], vec![1., 2., 3., 4., 5.]);
        let w = Tensor::from_f32(vec![1, 1, 3], vec![1., 0., -1.]);
        let a = Attrs::default().with("dilations", Attr::Ints(vec![2])).with("auto_pad", Attr::String("SAME_UPPER".into()));
        let y = run("Conv", a.clone(), &[&x, &w]);
        assert_eq!(y[0].to_f64_vec(), vec![-3., -4., -4., 2., 3.]);
        // y0 = -x2, so dy = e0 gives dx = -e2
        let dy = Tensor::from_f32(vec![1, 1, 5], vec![1., 0., 0., 0., 0.]);
        let dx = run("ConvGradX", a, &[&dy, &w, &Tensor::from_i64(vec![3], vec![1, 1, 5])]);
        assert_eq!(dx[0].to_f64_vec(), vec![0., 0., -1., 0., 0.]);
    }
}
