//! conv.cu, pool.cu, batchnorm.cu and scan.cu against the CPU kernels (backend/cpu/conv.rs,
//! pool.rs, batchnorm.rs, cumsum.rs), every dtype, in f64 on the rounded inputs:
//! - im2col: the column matrix times the weight (on the host, f64) is the CPU Conv; col2im of
//!   Wᵀ·dy is the CPU ConvGradX (2-D strided and padded, 1-D dilated SAME_UPPER);
//! - max_pool (values and indices exactly), max_pool_grad, avg_pool and avg_pool_grad with and
//!   without count_include_pad;
//! - the batch-norm kernels chained as the dispatcher chains them, training and inference;
//! - cumsum in all four modes, integers exactly.
//!
//! Without a GPU the argument lists are checked against the registry.

use super::support::*;
use crate::backend::cpu::testutil::run as cpu;
use crate::backend::cuda::abi::Win2d;
use crate::backend::cuda::launch::{Grid, KArg};
use crate::backend::cuda::registry::types::{ARITH, FLOATS, FLOATS_F32_F64};
use crate::ir::{Attr, Attrs, Node};
use crate::tensor::Tensor;

fn node(op: &str, attrs: &Attrs) -> Node {
    Node { name: "t".into(), op_type: op.into(), inputs: vec![], outputs: vec![], attrs: attrs.clone() }
}

/// `im2col_T` / `col2im_T(src, dst, Win2d, n)`
fn win_args(src: u64, dst: u64, w: Win2d, n: usize) -> Vec<KArg> {
    vec![KArg::Ptr(src), KArg::Ptr(dst), KArg::Win2d(w), KArg::I64(n as i64)]
}
/// `max_pool_T(x, y, idx, Win2d, n)`
fn max_pool_args(x: u64, y: u64, idx: u64, w: Win2d, n: usize) -> Vec<KArg> {
    vec![KArg::Ptr(x), KArg::Ptr(y), KArg::Ptr(idx), KArg::Win2d(w), KArg::I64(n as i64)]
}
/// `max_pool_grad_T(dy, idx, dx, n, out_plane, in_plane, err)`
fn max_pool_grad_args(dy: u64, idx: u64, dx: u64, n: usize, out_plane: usize, in_plane: usize, err: u64) -> Vec<KArg> {
    let i = |v: usize| KArg::I64(v as i64);
    vec![KArg::Ptr(dy), KArg::Ptr(idx), KArg::Ptr(dx), i(n), i(out_plane), i(in_plane), KArg::Ptr(err)]
}
/// `avg_pool_T` / `avg_pool_grad_T(src, dst, Win2d, n, count_include_pad)`
fn avg_args(src: u64, dst: u64, w: Win2d, n: usize, include_pad: bool) -> Vec<KArg> {
    vec![KArg::Ptr(src), KArg::Ptr(dst), KArg::Win2d(w), KArg::I64(n as i64), KArg::I32(include_pad as i32)]
}
/// `batch_norm_stats_T(x, mean, var, stats, n, c, plane, training)`
fn bn_stats_args(p: [u64; 4], (n, c, plane): (usize, usize, usize), training: bool) -> Vec<KArg> {
    let i = |v: usize| KArg::I64(v as i64);
    let mut a: Vec<KArg> = p.iter().map(|&v| KArg::Ptr(v)).collect();
    a.extend([i(n), i(c), i(plane), KArg::I32(training as i32)]);
    a
}
/// `batch_norm_apply_T(x, scale, bias, mean, var, stats, y, mean_out, var_out, total, c, plane, eps, momentum, var_factor)`
fn bn_apply_args(p: [u64; 9], (total, c, plane): (usize, usize, usize), eps: f64, momentum: f64, var_factor: f64) -> Vec<KArg> {
    let i = |v: usize| KArg::I64(v as i64);
    let mut a: Vec<KArg> = p.iter().map(|&v| KArg::Ptr(v)).collect();
    a.extend([i(total), i(c), i(plane), KArg::F64(eps), KArg::F64(momentum), KArg::F64(var_factor)]);
    a
}
/// `batch_norm_grad_sums_T(dy, x, stats, sums, n, c, plane, eps)`
fn bn_sums_args(p: [u64; 4], (n, c, plane): (usize, usize, usize), eps: f64) -> Vec<KArg> {
    let i = |v: usize| KArg::I64(v as i64);
    let mut a: Vec<KArg> = p.iter().map(|&v| KArg::Ptr(v)).collect();
    a.extend([i(n), i(c), i(plane), KArg::F64(eps)]);
    a
}
/// `batch_norm_grad_T(dy, x, scale, stats, sums, dx, dscale, dbias, total, c, plane, eps, training)`
fn bn_grad_args(p: [u64; 8], (total, c, plane): (usize, usize, usize), eps: f64, training: bool) -> Vec<KArg> {
    let i = |v: usize| KArg::I64(v as i64);
    let mut a: Vec<KArg> = p.iter().map(|&v| KArg::Ptr(v)).collect();
    a.extend([i(total), i(c), i(plane), KArg::F64(eps), KArg::I32(training as i32)]);
    a
}
/// `cumsum_T(x, y, outer, len, inner, exclusive, reverse)`
fn cumsum_args(x: u64, y: u64, (outer, len, inner): (usize, usize, usize), exclusive: bool, reverse: bool) -> Vec<KArg> {
    let i = |v: usize| KArg::I64(v as i64);
    vec![KArg::Ptr(x), KArg::Ptr(y), i(outer), i(len), i(inner), KArg::I32(exclusive as i32), KArg::I32(reverse as i32)]
}

#[test]
fn spatial_argument_lists_match_the_registry() {
    let w = Win2d::default();
    let mut conv = Vec::new();
    let mut pool = Vec::new();
    let mut bn = Vec::new();
    for t in FLOATS {
        for op in ["im2col", "col2im"] {
            check(&format!("{op}_{t}"), &win_args(1, 2, w, 3));
            conv.push(format!("{op}_{t}"));
        }
        check(&format!("max_pool_{t}"), &max_pool_args(1, 2, 0, w, 3));
        for op in ["avg_pool", "avg_pool_grad"] {
            check(&format!("{op}_{t}"), &avg_args(1, 2, w, 3, true));
            pool.push(format!("{op}_{t}"));
        }
        pool.push(format!("max_pool_{t}"));
        let d = (2, 3, 4);
        for (op, args) in [
            ("batch_norm_stats", bn_stats_args([1, 2, 3, 4], d, true)),
            ("batch_norm_apply", bn_apply_args([1, 2, 3, 4, 5, 6, 7, 0, 0], d, 1e-5, 0.9, 1.0)),
            ("batch_norm_grad_sums", bn_sums_args([1, 2, 3, 4], d, 1e-5)),
            ("batch_norm_grad", bn_grad_args([1, 2, 3, 4, 5, 6, 7, 8], d, 1e-5, true)),
        ] {
            check(&format!("{op}_{t}"), &args);
            bn.push(format!("{op}_{t}"));
        }
    }
    for t in FLOATS_F32_F64 {
        check(&format!("max_pool_grad_{t}"), &max_pool_grad_args(1, 2, 3, 4, 5, 6, 0));
        pool.push(format!("max_pool_grad_{t}"));
    }
    let scan: Vec<String> = ARITH
        .iter()
        .map(|t| {
            check(&format!("cumsum_{t}"), &cumsum_args(1, 2, (1, 2, 3), true, false));
            format!("cumsum_{t}")
        })
        .collect();
    assert_covers("conv", &conv);
    assert_covers("pool", &pool);
    assert_covers("batchnorm", &bn);
    assert_covers("scan", &scan);
}

/// Dense f64 product: out[b][m][n] = Σ_k a[m][k] · b[b][k][n] (a shared over the batch), with
/// `ta` reading a as [k][m].
fn host_gemm(a: &[f64], b: &[f64], batch: usize, (m, n, k): (usize, usize, usize), ta: bool) -> Vec<f64> {
    let mut out = vec![0.0; batch * m * n];
    for s in 0..batch {
        for i in 0..m {
            for j in 0..n {
                out[(s * m + i) * n + j] = (0..k).map(|r| if ta { a[r * m + i] } else { a[i * k + r] } * b[(s * k + r) * n + j]).sum();
            }
        }
    }
    out
}

#[test]
fn gpu_im2col_and_col2im_match_the_cpu_convolution() {
    let Some(g) = gpu("gpu_im2col_and_col2im_match_the_cpu_convolution") else { return };
    let mut rng = Rng::new(41);
    let cases: Vec<(Vec<usize>, Vec<usize>, Attrs)> = vec![
        (
            vec![2, 3, 7, 6],
            vec![4, 3, 3, 3],
            Attrs::default().with("pads", Attr::Ints(vec![1, 2, 1, 0])).with("strides", Attr::Ints(vec![2, 1])),
        ),
        (
            vec![2, 2, 9],
            vec![3, 2, 3],
            Attrs::default().with("dilations", Attr::Ints(vec![2])).with("auto_pad", Attr::String("SAME_UPPER".into())),
        ),
    ];
    for (xs, ws, attrs) in cases {
        let (_, win) = crate::ops::conv_geometry_of(&node("Conv", &attrs), &xs, &ws).expect("geometry");
        let w2 = Win2d::new(&win, xs[1]);
        let (n, c, m) = (xs[0], xs[1], ws[0]);
        let (kk, ohw) = (win.kernel_size(), win.out_size());
        let rows = c * kk;
        let mut ys = vec![n, m];
        ys.extend(&win.output);
        for t in FLOATS {
            let case = format!("{t} x {xs:?} w {ws:?}");
            let x = rand_as(&mut rng, t, numel(&xs), -1.0, 1.0);
            let w = rand_as(&mut rng, t, numel(&ws), -1.0, 1.0);
            let dx = dev_as(g, t, &x);
            let col = zeros_as(g, t, n * rows * ohw);
            run(g, &format!("im2col_{t}"), Grid::new(64, 256), &win_args(dx.ptr(), col.ptr(), w2, n * rows * ohw));
            let colv = host_as(&col, t);
            let y = host_gemm(&w, &colv, n, (m, ohw, rows), false);
            let want = cpu("Conv", attrs.clone(), &[&t64(&xs, &x), &t64(&ws, &w)])[0].to_f64_vec();
            assert_close_scaled(&format!("{case}: W · im2col(x)"), &y, &want, 1e-9);
            // col2im(Wᵀ · dy) = ConvGradX(dy, w)
            let dy = rand_as(&mut rng, t, numel(&ys), -1.0, 1.0);
            let colg = rounded(t, &host_gemm(&w, &dy, n, (rows, ohw, m), true));
            let dcol = dev_as(g, t, &colg);
            let dxg = zeros_as(g, t, numel(&xs));
            run(g, &format!("col2im_{t}"), Grid::new(64, 256), &win_args(dcol.ptr(), dxg.ptr(), w2, numel(&xs)));
            let shape = shape_tensor(&xs);
            let want = cpu("ConvGradX", attrs.clone(), &[&t64(&ys, &dy), &t64(&ws, &w), &shape])[0].to_f64_vec();
            assert_close_scaled(&format!("{case}: col2im(Wᵀ · dy)"), &host_as(&dxg, t), &want, 4.0 * rtol(t).max(1e-9));
        }
    }
}

#[test]
fn gpu_pool_kernels_match_the_cpu_kernels() {
    let Some(g) = gpu("gpu_pool_kernels_match_the_cpu_kernels") else { return };
    let mut rng = Rng::new(43);
    let xs = vec![2, 3, 7, 6];
    let windows = [
        Attrs::default().with("kernel_shape", Attr::Ints(vec![2, 2])),
        Attrs::default()
            .with("kernel_shape", Attr::Ints(vec![3, 2]))
            .with("strides", Attr::Ints(vec![2, 2]))
            .with("pads", Attr::Ints(vec![1, 0, 1, 1]))
            .with("ceil_mode", Attr::Int(1)),
        Attrs::default().with("kernel_shape", Attr::Ints(vec![2, 3])).with("dilations", Attr::Ints(vec![2, 1])),
    ];
    for attrs in windows {
        let win = crate::ops::pool_geometry_of(&node("MaxPool", &attrs), &xs).expect("geometry");
        let w2 = Win2d::new(&win, xs[1]);
        let mut ys = xs[..2].to_vec();
        ys.extend(&win.output);
        let (ny, nx) = (numel(&ys), numel(&xs));
        for t in FLOATS {
            let case = format!("{t} {attrs:?}");
            let mut x = rand_as(&mut rng, t, nx, -1.0, 1.0);
            x[5] = f64::NAN; // a NaN wins its windows
            let dx = dev_as(g, t, &x);
            let (y, idx) = (zeros_as(g, t, ny), zeros::<i64>(g, ny));
            run(g, &format!("max_pool_{t}"), Grid::new(64, 256), &max_pool_args(dx.ptr(), y.ptr(), idx.ptr(), w2, ny));
            let want = cpu("MaxPool", attrs.clone(), &[&t64(&xs, &x)]);
            assert_close(&format!("{case}: max_pool"), &host_as(&y, t), &want[0].to_f64_vec(), 0.0, 0.0);
            let idxv = host::<i64>(&idx);
            assert_eq!(idxv, want[1].to_i64_vec().expect("indices"), "{case}: max_pool indices");
            if FLOATS_F32_F64.contains(t) {
                let dy = rand_as(&mut rng, t, ny, -1.0, 1.0);
                let (ddy, dxg, err) = (dev_as(g, t, &dy), zeros_as(g, t, nx), zeros::<i32>(g, 1));
                let planes = (numel(&ys[2..]), numel(&xs[2..]));
                let args = max_pool_grad_args(ddy.ptr(), idx.ptr(), dxg.ptr(), ny, planes.0, planes.1, err.ptr());
                run(g, &format!("max_pool_grad_{t}"), Grid::new(64, 256), &args);
                let idx_t = Tensor::from_i64(ys.clone(), idxv.clone());
                let want = cpu("MaxPoolGrad", Attrs::default(), &[&t64(&ys, &dy), &idx_t, &shape_tensor(&xs)])[0].to_f64_vec();
                assert_close_scaled(&format!("{case}: max_pool_grad"), &host_as(&dxg, t), &want, 1e-6);
                assert_eq!(host::<i32>(&err), vec![0], "{case}: error flag");
            }
            x[5] = 0.25;
            let dx = dev_as(g, t, &x);
            for include_pad in [false, true] {
                let a = attrs.clone().with("count_include_pad", Attr::Int(include_pad as i64));
                let y = zeros_as(g, t, ny);
                run(g, &format!("avg_pool_{t}"), Grid::new(64, 256), &avg_args(dx.ptr(), y.ptr(), w2, ny, include_pad));
                let want = cpu("AveragePool", a.clone(), &[&t64(&xs, &x)])[0].to_f64_vec();
                assert_close(&format!("{case} include_pad={include_pad}: avg_pool"), &host_as(&y, t), &want, rtol(t), atol(t));
                let dy = rand_as(&mut rng, t, ny, -1.0, 1.0);
                let (ddy, dxg) = (dev_as(g, t, &dy), zeros_as(g, t, nx));
                run(g, &format!("avg_pool_grad_{t}"), Grid::new(64, 256), &avg_args(ddy.ptr(), dxg.ptr(), w2, nx, include_pad));
                let want = cpu("AveragePoolGrad", a, &[&t64(&ys, &dy), &shape_tensor(&xs)])[0].to_f64_vec();
                assert_close(&format!("{case} include_pad={include_pad}: avg_pool_grad"), &host_as(&dxg, t), &want, rtol(t), atol(t));
            }
        }
    }
}

#[test]
fn gpu_batch_norm_kernels_match_the_cpu_kernels() {
    let Some(g) = gpu("gpu_batch_norm_kernels_match_the_cpu_kernels") else { return };
    let mut rng = Rng::new(47);
    let (xs, eps, momentum) = (vec![3, 5, 4, 7], 1e-3, 0.8);
    let (n, c, plane) = (xs[0], xs[1], 28);
    let total = numel(&xs);
    for t in FLOATS {
        for training in [true, false] {
            let case = format!("{t} training={training}");
            let x = rand_as(&mut rng, t, total, -1.0, 3.0);
            let [scale, bias, mean, var] =
                [(0.5, 1.5), (-0.5, 0.5), (-0.2, 0.2), (0.5, 2.0)].map(|(lo, hi)| rand_as(&mut rng, t, c, lo, hi));
            let attrs = Attrs::default()
                .with("epsilon", Attr::Float(eps as f32))
                .with("momentum", Attr::Float(momentum as f32))
                .with("training_mode", Attr::Int(training as i64))
                .with("unbiased_running_var", Attr::Int(1));
            // the attributes are f32s: the CPU kernel computes with their f32 values
            let (eps, momentum) = (eps as f32 as f64, momentum as f32 as f64);
            let p = |v: &[f64]| t64(&[c], v);
            let want = cpu("BatchNormalization", attrs.clone(), &[&t64(&xs, &x), &p(&scale), &p(&bias), &p(&mean), &p(&var)]);
            let [dx, ds, db, dm, dv] = [&x, &scale, &bias, &mean, &var].map(|v| dev_as(g, t, v));
            let (stats, sums) = (zeros::<f64>(g, 2 * c), zeros::<f64>(g, 2 * c));
            let (y, mo, vo) = (zeros_as(g, t, total), zeros_as(g, t, c), zeros_as(g, t, c));
            run(
                g,
                &format!("batch_norm_stats_{t}"),
                Grid::new(c as u32, 256),
                &bn_stats_args([dx.ptr(), dm.ptr(), dv.ptr(), stats.ptr()], (n, c, plane), training),
            );
            let count = (n * plane) as f64;
            let args = bn_apply_args(
                [dx.ptr(), ds.ptr(), db.ptr(), dm.ptr(), dv.ptr(), stats.ptr(), y.ptr(), mo.ptr(), vo.ptr()],
                (total, c, plane),
                eps,
                momentum,
                count / (count - 1.0),
            );
            run(g, &format!("batch_norm_apply_{t}"), Grid::new(16, 256), &args);
            let tol = 4.0 * rtol(t).max(1e-9);
            assert_close_scaled(&format!("{case}: y"), &host_as(&y, t), &want[0].to_f64_vec(), tol);
            if training {
                assert_close(&format!("{case}: running mean"), &host_as(&mo, t), &want[1].to_f64_vec(), tol, atol(t));
                assert_close(&format!("{case}: running var"), &host_as(&vo, t), &want[2].to_f64_vec(), tol, atol(t));
            }
            // the gradient
            let dyv = rand_as(&mut rng, t, total, -1.0, 1.0);
            let gattrs = Attrs::default().with("epsilon", Attr::Float(eps as f32)).with("training_mode", Attr::Int(training as i64));
            let want = cpu("BatchNormGrad", gattrs, &[&t64(&xs, &dyv), &t64(&xs, &x), &p(&scale), &p(&mean), &p(&var)]);
            let ddy = dev_as(g, t, &dyv);
            let (gx, gs, gb) = (zeros_as(g, t, total), zeros_as(g, t, c), zeros_as(g, t, c));
            run(
                g,
                &format!("batch_norm_grad_sums_{t}"),
                Grid::new(c as u32, 256),
                &bn_sums_args([ddy.ptr(), dx.ptr(), stats.ptr(), sums.ptr()], (n, c, plane), eps),
            );
            let args = bn_grad_args(
                [ddy.ptr(), dx.ptr(), ds.ptr(), stats.ptr(), sums.ptr(), gx.ptr(), gs.ptr(), gb.ptr()],
                (total, c, plane),
                eps,
                training,
            );
            run(g, &format!("batch_norm_grad_{t}"), Grid::new(16, 256), &args);
            for (what, got, k) in [("dx", &gx, 0), ("dscale", &gs, 1), ("dbias", &gb, 2)] {
                assert_close_scaled(&format!("{case}: {what}"), &host_as(got, t), &want[k].to_f64_vec(), tol);
            }
        }
    }
}

#[test]
fn gpu_cumsum_matches_the_cpu_kernel() {
    let Some(g) = gpu("gpu_cumsum_matches_the_cpu_kernel") else { return };
    let mut rng = Rng::new(53);
    let xs = [3usize, 37, 5];
    for t in ARITH {
        for axis in [0usize, 1, 2] {
            for (exclusive, reverse) in [(false, false), (true, false), (false, true), (true, true)] {
                let case = format!("{t} axis {axis} exclusive={exclusive} reverse={reverse}");
                let vals: Vec<f64> = if is_float(t) {
                    rand_as(&mut rng, t, numel(&xs), -1.0, 1.0)
                } else {
                    (0..numel(&xs)).map(|_| rng.int(-50, 50) as f64).collect()
                };
                let bytes = encode(t, &vals);
                let dx = dev(g, &bytes);
                let dy = zeros::<u8>(g, bytes.len());
                let dims = (xs[..axis].iter().product(), xs[axis], xs[axis + 1..].iter().product());
                run(g, &format!("cumsum_{t}"), Grid::new(8, 128), &cumsum_args(dx.ptr(), dy.ptr(), dims, exclusive, reverse));
                let attrs = Attrs::default().with("exclusive", Attr::Int(exclusive as i64)).with("reverse", Attr::Int(reverse as i64));
                let axis_t = Tensor::from_i64(vec![], vec![axis as i64]);
                let x_t = if is_float(t) { t64(&xs, &vals) } else { cpu_tensor(t, &xs, &bytes) };
                let want = cpu("CumSum", attrs, &[&x_t, &axis_t])[0].clone();
                let got = host::<u8>(&dy);
                if is_float(t) {
                    assert_close_scaled(&case, &decode(t, &got), &want.to_f64_vec(), 8.0 * rtol(t).max(1e-12));
                } else {
                    assert_same(&case, t, &got, &cpu_bytes(t, &want));
                }
            }
        }
    }
}
