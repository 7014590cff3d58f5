//! reduce.cu: ReduceSum/Mean/Max/Min through both kernel shapes (one block per output and one
//! thread per output) over several sets of axes, NaN propagation of max/min, the i64 sum, and
//! ReduceGrad, against the CPU kernels (engine/src/backend/cpu/reduce.rs, in f64 on the rounded
//! inputs; i64 exactly).

use super::support::*;
use crate::backend::cpu::testutil;
use crate::backend::cuda::abi::{Reduce, Strides};
use crate::backend::cuda::launch::{Grid, KArg};
use crate::backend::cuda::registry::types::FLOATS;
use crate::ir::{Attr, Attrs};
use crate::tensor::Tensor;

/// The kernels' view of reducing a contiguous `shape` over `axes` (reduce.cu): the kept
/// dimensions in order (the contiguous output) and the reduced ones, each with its input stride.
fn reduce_layout(shape: &[usize], axes: &[usize]) -> Reduce {
    let mut l = Reduce { outputs: 1, count: 1, ..Default::default() };
    let mut stride = 1i64;
    for d in (0..shape.len()).rev() {
        let (dim, s) = (shape[d] as i64, stride);
        stride *= dim;
        if axes.contains(&d) {
            l.red_dims[l.red_rank as usize] = dim;
            l.red_stride[l.red_rank as usize] = s;
            l.red_rank += 1;
            l.count *= dim;
        } else {
            l.out_dims[l.out_rank as usize] = dim;
            l.out_stride[l.out_rank as usize] = s;
            l.out_rank += 1;
            l.outputs *= dim;
        }
    }
    // collected innermost first: put both lists in input order
    l.out_dims[..l.out_rank as usize].reverse();
    l.out_stride[..l.out_rank as usize].reverse();
    l.red_dims[..l.red_rank as usize].reverse();
    l.red_stride[..l.red_rank as usize].reverse();
    l
}

/// ReduceGrad's broadcast: dx has `shape` (contiguous); operand 0 (dy, the kept dimensions,
/// contiguous) has stride 0 on the reduced axes.
fn grad_strides(shape: &[usize], axes: &[usize]) -> Strides {
    let mut s = Strides { rank: shape.len() as i32, ..Default::default() };
    let mut stride = 1i64;
    for d in (0..shape.len()).rev() {
        s.dims[d] = shape[d] as i64;
        if !axes.contains(&d) {
            s.stride[0][d] = stride;
            stride *= shape[d] as i64;
        }
    }
    s
}

/// `reduce_<op>[_thread]_T(const T* x, T* y, Reduce l, f64 scale)`
fn reduce_args(x: u64, y: u64, l: Reduce, scale: f64) -> Vec<KArg> {
    vec![KArg::Ptr(x), KArg::Ptr(y), KArg::Reduce(l), KArg::F64(scale)]
}

/// `reduce_grad_T(const T* dy, T* dx, Strides s, i64 n, f64 scale)`
fn grad_args(dy: u64, dx: u64, s: Strides, n: usize, scale: f64) -> Vec<KArg> {
    vec![KArg::Ptr(dy), KArg::Ptr(dx), KArg::Strides(s), KArg::I64(n as i64), KArg::F64(scale)]
}

/// (shape, axes): innermost reduced, inner and outer, outermost only (a kept innermost
/// dimension, the thread kernel's case), a middle one, all (one output, out_rank 0), rank 1.
const CASES: &[(&[usize], &[usize])] = &[
    (&[6, 5, 300], &[2]),
    (&[6, 5, 300], &[0, 2]),
    (&[6, 5, 300], &[0]),
    (&[6, 5, 300], &[1]),
    (&[6, 5, 300], &[0, 1, 2]),
    (&[3001], &[0]),
];

/// The launch of each kernel shape: one block of 128 threads per output (at most 7 blocks: the
/// grid-stride output loop), one thread per output (at most 2 blocks of 256).
fn grid_of(thread_kernel: bool, outputs: i64) -> Grid {
    if thread_kernel {
        Grid::elementwise(outputs, 2)
    } else {
        Grid::new(outputs.min(7) as u32, 128)
    }
}

fn axes_attr(axes: &[usize]) -> Attrs {
    Attrs::default().with("axes", Attr::Ints(axes.iter().map(|&a| a as i64).collect())).with("keepdims", Attr::Int(0))
}

#[test]
fn reduce_argument_lists_match_the_registry() {
    let mut checked = Vec::new();
    for &(shape, axes) in CASES {
        let l = reduce_layout(shape, axes);
        for t in FLOATS.iter().chain(&["i64"]) {
            let ops: &[&str] = if *t == "i64" { &["reduce_sum"] } else { &["reduce_sum", "reduce_max", "reduce_min"] };
            for op in ops {
                for k in [format!("{op}_{t}"), format!("{op}_thread_{t}")] {
                    check(&k, &reduce_args(0, 0, l, 1.0));
                    checked.push(k);
                }
            }
        }
        for t in FLOATS {
            check(&format!("reduce_grad_{t}"), &grad_args(0, 0, grad_strides(shape, axes), shape.iter().product(), 1.0));
            checked.push(format!("reduce_grad_{t}"));
        }
    }
    assert_covers("reduce", &checked);
}

#[test]
fn the_reduce_layouts_are_the_kept_and_reduced_dimensions_in_order() {
    let l = reduce_layout(&[6, 5, 300], &[0, 2]);
    assert_eq!((l.out_rank, l.red_rank, l.outputs, l.count), (1, 2, 5, 1800));
    assert_eq!((l.out_dims[0], l.out_stride[0]), (5, 300));
    assert_eq!((&l.red_dims[..2], &l.red_stride[..2]), (&[6i64, 300][..], &[1500i64, 1][..]));
    let l = reduce_layout(&[6, 5, 300], &[0, 1, 2]);
    assert_eq!((l.out_rank, l.outputs, l.count), (0, 1, 9000));
    let s = grad_strides(&[6, 5, 300], &[0, 2]);
    assert_eq!((s.rank, &s.dims[..3], &s.stride[0][..3]), (3, &[6i64, 5, 300][..], &[0i64, 1, 0][..]));
    let s = grad_strides(&[6, 5, 300], &[1]);
    assert_eq!(&s.stride[0][..3], &[300, 0, 1]);
}

#[test]
fn gpu_reductions_match_the_cpu_kernels() {
    let Some(g) = gpu("gpu_reductions_match_the_cpu_kernels") else { return };
    let mut rng = Rng::new(41);
    for &(shape, axes) in CASES {
        let l = reduce_layout(shape, axes);
        let (len, outs) = (shape.iter().product::<usize>(), l.outputs as usize);
        let case = format!("{shape:?} over axes {axes:?}");
        for t in FLOATS {
            // U(-1, 3): sums of about count (no cancellation to speak of)
            let x = rand_as(&mut rng, t, len, -1.0, 3.0);
            // with a NaN at element 7 and 2000 (max and min propagate it)
            let mut xn = x.clone();
            for i in [7, 2000] {
                xn[i] = f64::NAN;
            }
            let (dxb, dxn) = (dev_as(g, t, &x), dev_as(g, t, &xn));
            let cpu =
                |op: &str, v: &[f64]| -> Vec<f64> { rounded(t, &testutil::run(op, axes_attr(axes), &[&t64(shape, v)])[0].to_f64_vec()) };
            // sum: the thread kernel adds up to 9000 terms serially in f32 (n·eps/2 ≈ 3e-4 at
            // worst, ~1e-5 as random walks go): f32 sums get 1e-4; the block kernel does better
            let sum_tol = if *t == "f32" { 1e-4 } else { rtol(t) };
            for thread in [false, true] {
                let sfx = if thread { "_thread" } else { "" };
                let grid = grid_of(thread, l.outputs);
                let gcase = format!("{case}, grid {} x {}", grid.blocks, grid.threads);
                let y = zeros_as(g, t, outs);
                let k = format!("reduce_sum{sfx}_{t}");
                run(g, &k, grid, &reduce_args(dxb.ptr(), y.ptr(), l, 1.0));
                assert_close(&format!("{k} (sum) {gcase}"), &host_as(&y, t), &cpu("ReduceSum", &x), sum_tol, atol(t));
                run(g, &k, grid, &reduce_args(dxb.ptr(), y.ptr(), l, 1.0 / l.count as f64));
                assert_close(&format!("{k} (mean: scale 1/count) {gcase}"), &host_as(&y, t), &cpu("ReduceMean", &x), sum_tol, atol(t));
                for (op, cpu_op) in [("max", "ReduceMax"), ("min", "ReduceMin")] {
                    // one of the inputs, exactly
                    let k = format!("reduce_{op}{sfx}_{t}");
                    run(g, &k, grid, &reduce_args(dxb.ptr(), y.ptr(), l, 1.0));
                    assert_close(&format!("{k} {gcase}"), &host_as(&y, t), &cpu(cpu_op, &x), 0.0, 0.0);
                    run(g, &k, grid, &reduce_args(dxn.ptr(), y.ptr(), l, 1.0));
                    assert_close(&format!("{k} {gcase}, NaN at 7 and 2000"), &host_as(&y, t), &cpu(cpu_op, &xn), 0.0, 0.0);
                }
            }

            // ReduceGrad: dy (the kept dimensions) broadcast over the reduced ones, times scale
            let k = format!("reduce_grad_{t}");
            let dy = rand_as(&mut rng, t, outs, -1.0, 1.0);
            let (ddy, dx) = (dev_as(g, t, &dy), zeros_as(g, t, len));
            let shape_t = Tensor::from_i64(vec![shape.len()], shape.iter().map(|&d| d as i64).collect());
            for mean in [false, true] {
                let scale = if mean { 1.0 / l.count as f64 } else { 1.0 };
                run(g, &k, Grid::elementwise(len as i64, 16), &grad_args(ddy.ptr(), dx.ptr(), grad_strides(shape, axes), len, scale));
                let attrs = axes_attr(axes).with("mean", Attr::Int(mean as i64));
                let want = testutil::run("ReduceGrad", attrs, &[&t64(&[outs], &dy), &shape_t])[0].to_f64_vec();
                assert_close(&format!("{k} {case}, mean {mean}"), &host_as(&dx, t), &rounded(t, &want), rtol(t), atol(t));
            }
        }

        // the i64 sum, exactly
        let xi: Vec<i64> = (0..len).map(|_| rng.int(-1000, 1000)).collect();
        let want =
            testutil::run("ReduceSum", axes_attr(axes), &[&Tensor::from_i64(shape.to_vec(), xi.clone())])[0].to_i64_vec().expect("i64");
        let dxi = dev(g, &xi);
        for thread in [false, true] {
            let k = format!("reduce_sum{}_i64", if thread { "_thread" } else { "" });
            let y = zeros::<i64>(g, outs);
            run(g, &k, grid_of(thread, l.outputs), &reduce_args(dxi.ptr(), y.ptr(), l, 1.0));
            let got = host::<i64>(&y);
            if let Some(i) = (0..outs).find(|&i| got[i] != want[i]) {
                panic!("{k} {case}: element {i}: got {}, expected {}", got[i], want[i]);
            }
        }
    }
}
