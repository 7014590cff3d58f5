//! loss.cu: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss, forward (per-sample terms,
//! weights, log-probabilities, the fused gradient), the reduction (none, sum, mean), the fused
//! backward's scaling and the recomputing backward, for every float dtype, against the CPU
//! kernels (engine/src/backend/cpu/loss.rs, in f64 on the rounded inputs). The per-sample
//! buffers (loss_s, w_s) are the CPU loss with reduction "none" and the weights of
//! cpu::loss's `targets`; the unscaled fused gradient is the CPU gradient for dloss = 1 with
//! reduction "none"; sce_grad_scale is also checked on its own against the host product.
//! Cases: class weights, ignore_index (outside the classes, and a class), inner > 1, every
//! sample ignored (mean → NaN, gradients 0) and invalid labels (error flag set; the sample
//! counts as ignored, which the CPU reference reproduces by ignoring a sentinel label there).

use super::support::*;
use crate::backend::cpu::testutil;
use crate::backend::cuda::launch::{Grid, KArg};
use crate::backend::cuda::registry::types::FLOATS;
use crate::ir::{Attr, Attrs};
use crate::tensor::Tensor;

/// `sce_loss_T(x, labels, weights, loss_s, w_s, logp, grad, i64 S, i64 C, i64 inner,
/// i64 ignore_index, i32 has_ignore, i32 softmax, i32* err)`
#[allow(clippy::too_many_arguments)]
fn loss_args(
    x: u64,
    labels: u64,
    weights: u64,
    loss_s: u64,
    w_s: u64,
    logp: u64,
    grad: u64,
    (s, c, inner): (usize, usize, usize),
    ignore_index: i64,
    has_ignore: bool,
    softmax: bool,
    err: u64,
) -> Vec<KArg> {
    let p = KArg::Ptr;
    vec![
        p(x),
        p(labels),
        p(weights),
        p(loss_s),
        p(w_s),
        p(logp),
        p(grad),
        KArg::I64(s as i64),
        KArg::I64(c as i64),
        KArg::I64(inner as i64),
        KArg::I64(ignore_index),
        KArg::I32(has_ignore as i32),
        KArg::I32(softmax as i32),
        p(err),
    ]
}

/// `sce_reduce_T(loss_s, w_s, out, wsum, i64 S, i32 reduction)`
fn reduce_args(loss_s: u64, w_s: u64, out: u64, wsum: u64, s: usize, reduction: i32) -> Vec<KArg> {
    vec![KArg::Ptr(loss_s), KArg::Ptr(w_s), KArg::Ptr(out), KArg::Ptr(wsum), KArg::I64(s as i64), KArg::I32(reduction)]
}

/// `sce_grad_scale_T(dy, wsum, grad, i64 S, i64 C, i64 inner, i32 reduction)`
fn scale_args(dy: u64, wsum: u64, grad: u64, (s, c, inner): (usize, usize, usize), reduction: i32) -> Vec<KArg> {
    let i = |v: usize| KArg::I64(v as i64);
    vec![KArg::Ptr(dy), KArg::Ptr(wsum), KArg::Ptr(grad), i(s), i(c), i(inner), KArg::I32(reduction)]
}

/// `sce_grad_T(dy, x, labels, weights, wsum, dx, i64 S, i64 C, i64 inner, i64 ignore_index,
/// i32 has_ignore, i32 softmax, i32 reduction)`
#[allow(clippy::too_many_arguments)]
fn grad_args(
    dy: u64,
    x: u64,
    labels: u64,
    weights: u64,
    wsum: u64,
    dx: u64,
    (s, c, inner): (usize, usize, usize),
    ignore_index: i64,
    has_ignore: bool,
    softmax: bool,
    reduction: i32,
) -> Vec<KArg> {
    let p = KArg::Ptr;
    let i = |v: usize| KArg::I64(v as i64);
    vec![
        p(dy),
        p(x),
        p(labels),
        p(weights),
        p(wsum),
        p(dx),
        i(s),
        i(c),
        i(inner),
        KArg::I64(ignore_index),
        KArg::I32(has_ignore as i32),
        KArg::I32(softmax as i32),
        KArg::I32(reduction),
    ]
}

/// Which labels a case draws (the rest uniform over the classes).
#[derive(Clone, Copy)]
enum Labels {
    /// every k-th sample gets this label
    Every(usize, i64),
    /// every sample gets this label
    All(i64),
    /// samples 1 and 5 get C and -7 (out of range, not ignore_index)
    Invalid,
}

struct Case {
    name: &'static str,
    n: usize,
    c: usize,
    inner: usize,
    weights: bool,
    ignore: Option<i64>,
    softmax: bool,
    labels: Labels,
    threads: u32,
}

const CASES: &[Case] = &[
    Case {
        name: "weighted, ignore_index -100",
        n: 200,
        c: 1000,
        inner: 1,
        weights: true,
        ignore: Some(-100),
        softmax: true,
        labels: Labels::Every(5, -100),
        threads: 256,
    },
    Case {
        name: "inner 6, ignore_index 3 (a class)",
        n: 4,
        c: 37,
        inner: 6,
        weights: false,
        ignore: Some(3),
        softmax: true,
        labels: Labels::Every(4, 3),
        threads: 64,
    },
    Case {
        name: "NLL, weighted, inner 3, ignore_index -1",
        n: 16,
        c: 50,
        inner: 3,
        weights: true,
        ignore: Some(-1),
        softmax: false,
        labels: Labels::Every(7, -1),
        threads: 32,
    },
    Case {
        name: "every sample ignored",
        n: 8,
        c: 20,
        inner: 1,
        weights: true,
        ignore: Some(-100),
        softmax: true,
        labels: Labels::All(-100),
        threads: 32,
    },
    Case {
        name: "invalid labels, no ignore_index",
        n: 8,
        c: 20,
        inner: 2,
        weights: false,
        ignore: None,
        softmax: true,
        labels: Labels::Invalid,
        threads: 64,
    },
];

const REDUCTIONS: &[(i32, &str)] = &[(0, "none"), (1, "sum"), (2, "mean")];

/// The label the CPU reference ignores in place of an invalid one.
const SENTINEL: i64 = -999;

fn labels_of(case: &Case, rng: &mut Rng) -> Vec<i64> {
    let s = case.n * case.inner;
    (0..s)
        .map(|i| match case.labels {
            Labels::Every(k, v) if i % k == 0 => v,
            Labels::All(v) => v,
            Labels::Invalid if i == 1 => case.c as i64,
            Labels::Invalid if i == 5 => -7,
            _ => rng.int(0, case.c as i64),
        })
        .collect()
}

/// (ignore_index, has_ignore) of the launch: without one, ignore_index is sample 0's (valid)
/// label, which must then count.
fn ignore_arg(case: &Case, labels: &[i64]) -> (i64, bool) {
    match case.ignore {
        Some(v) => (v, true),
        None => (labels[0], false),
    }
}

fn shapes(case: &Case) -> (Vec<usize>, Vec<usize>) {
    if case.inner == 1 {
        (vec![case.n, case.c], vec![case.n])
    } else {
        (vec![case.n, case.c, case.inner], vec![case.n, case.inner])
    }
}

#[test]
fn loss_argument_lists_match_the_registry() {
    let mut checked = Vec::new();
    for case in CASES {
        let dims = (case.n * case.inner, case.c, case.inner);
        for t in FLOATS {
            check(&format!("sce_loss_{t}"), &loss_args(1, 1, 0, 1, 1, 0, 1, dims, -100, true, case.softmax, 1));
            for &(r, _) in REDUCTIONS {
                check(&format!("sce_reduce_{t}"), &reduce_args(1, 1, 1, 1, dims.0, r));
                check(&format!("sce_grad_scale_{t}"), &scale_args(1, 1, 1, dims, r));
                check(&format!("sce_grad_{t}"), &grad_args(1, 1, 1, 0, 1, 1, dims, -100, false, case.softmax, r));
            }
            checked.extend(["sce_loss", "sce_reduce", "sce_grad_scale", "sce_grad"].map(|op| format!("{op}_{t}")));
        }
    }
    checked.extend(super::lce::checked_kernels());
    assert_covers("loss", &checked);
}

#[test]
fn gpu_softmax_cross_entropy_and_nll_match_the_cpu_kernels() {
    let Some(g) = gpu("gpu_softmax_cross_entropy_and_nll_match_the_cpu_kernels") else { return };
    let mut rng = Rng::new(61);
    for case in CASES {
        let (s, c, inner) = (case.n * case.inner, case.c, case.inner);
        let dims = (s, c, inner);
        let len = s * c;
        let (xshape, lshape) = shapes(case);
        let labels = labels_of(case, &mut rng);
        let (ignore_index, has_ignore) = ignore_arg(case, &labels);
        let invalid = |y: i64| !((0..c as i64).contains(&y) || has_ignore && y == ignore_index);
        let expect_err = labels.iter().any(|&y| invalid(y));
        // the CPU fails on an invalid label: it ignores a sentinel there instead
        let ref_labels: Vec<i64> = labels.iter().map(|&y| if invalid(y) { SENTINEL } else { y }).collect();
        let ref_ignore = case.ignore.or(expect_err.then_some(SENTINEL));
        let (loss_op, grad_op) = if case.softmax {
            ("SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossGrad")
        } else {
            ("NegativeLogLikelihoodLoss", "NLLLossGrad")
        };
        let attrs = |reduction: &str| {
            let a = Attrs::default().with("reduction", Attr::String(reduction.into()));
            match ref_ignore {
                Some(v) => a.with("ignore_index", Attr::Int(v)),
                None => a,
            }
        };
        let lt = Tensor::from_i64(lshape.clone(), ref_labels.clone());
        let loss_grid = Grid::new(s.min(16) as u32, case.threads);
        for t in FLOATS {
            let a = acc_of(t);
            let what = |k: &str, more: &str| format!("{k} ({}: N {}, C {c}, inner {inner}{more})", case.name, case.n);
            let x = rand_as(&mut rng, t, len, -4.0, 4.0);
            let w = rand_as(&mut rng, t, c, 0.2, 2.0);
            let xt = t64(&xshape, &x);
            let wt = t64(&[c], &w);
            // the CPU op on `inputs`, then the class weights when the case has them
            let cpu = |op: &str, reduction: &str, inputs: &[&Tensor]| -> Vec<f64> {
                let mut v: Vec<&Tensor> = inputs.to_vec();
                if case.weights {
                    v.push(&wt);
                }
                testutil::run(op, attrs(reduction), &v)[0].to_f64_vec()
            };

            let (dxb, dl) = (dev_as(g, t, &x), dev(g, &labels));
            let dw = case.weights.then(|| dev_as(g, t, &w));
            let wp = dw.as_ref().map_or(0, |b| b.ptr());
            let (loss_s, w_s, grad, err) = (zeros_as(g, a, s), zeros_as(g, a, s), zeros_as(g, t, len), zeros::<i32>(g, 1));
            let logp = case.softmax.then(|| zeros_as(g, t, len));
            let lp = logp.as_ref().map_or(0, |b| b.ptr());
            let k = format!("sce_loss_{t}");
            run(
                g,
                &k,
                loss_grid,
                &loss_args(
                    dxb.ptr(),
                    dl.ptr(),
                    wp,
                    loss_s.ptr(),
                    w_s.ptr(),
                    lp,
                    grad.ptr(),
                    dims,
                    ignore_index,
                    has_ignore,
                    case.softmax,
                    err.ptr(),
                ),
            );

            assert_eq!(host::<i32>(&err)[0], expect_err as i32, "{}: the error flag", what(&k, ""));
            let per = cpu(loss_op, "none", &[&xt, &lt]);
            // x - m - lse cancels where p(label) is near 1: the error is relative to the largest term
            assert_close_scaled(&what(&k, ", loss_s"), &host_as(&loss_s, a), &rounded(a, &per), rtol(a));
            // cpu::loss's `targets`: 0 for an ignored sample, else the class weight (or 1)
            let want_w: Vec<f64> = ref_labels
                .iter()
                .map(|&y| {
                    if ref_ignore == Some(y) {
                        0.0
                    } else if case.weights {
                        w[y as usize]
                    } else {
                        1.0
                    }
                })
                .collect();
            let wsum_want: f64 = want_w.iter().sum();
            assert_close(&what(&k, ", w_s"), &host_as(&w_s, a), &want_w, 0.0, 0.0);
            if let Some(lpb) = &logp {
                let want = testutil::run("LogSoftmax", Attrs::default().with("axis", Attr::Int(1)), &[&xt])[0].to_f64_vec();
                assert_close_scaled(&what(&k, ", logp vs LogSoftmax over axis 1"), &host_as(lpb, t), &rounded(t, &want), rtol(t));
            }
            // the unscaled gradient w (softmax - onehot): the CPU gradient for dloss = 1, "none"
            let pre = host_as(&grad, t);
            let want_pre = cpu(grad_op, "none", &[&t64(&lshape, &vec![1.0; s]), &xt, &lt]);
            assert_close_scaled(&what(&k, ", fused gradient (dloss = 1, none)"), &pre, &rounded(t, &want_pre), rtol(t));

            let abs_sum: f64 = per.iter().map(|v| v.abs()).sum();
            for &(r, rname) in REDUCTIONS {
                let kr = format!("sce_reduce_{t}");
                let outs = if r == 0 { s } else { 1 };
                let (out, wsum) = (zeros_as(g, t, outs), zeros_as(g, a, 1));
                // one block of 64 threads: the sample loop runs for S = 200
                run(g, &kr, Grid::new(1, 64), &reduce_args(loss_s.ptr(), w_s.ptr(), out.ptr(), wsum.ptr(), s, r));
                let want = cpu(loss_op, rname, &[&xt, &lt]);
                // a sum's error is relative to the sum of |terms| (then / wsum for the mean)
                let scale = if r == 0 {
                    max_abs(&per)
                } else if r == 1 {
                    abs_sum
                } else {
                    abs_sum / wsum_want
                };
                assert_close(&what(&kr, &format!(", reduction {rname}")), &host_as(&out, t), &rounded(t, &want), rtol(t), rtol(t) * scale);
                let gw = host_as(&wsum, a);
                assert_close(&what(&kr, &format!(", wsum, reduction {rname}")), &gw, &[round_to(a, wsum_want)], rtol(a), 0.0);

                // the backward: dloss of the reduced shape
                let dy = if r == 0 { rand_as(&mut rng, t, s, -1.0, 1.0) } else { rand_as(&mut rng, t, 1, 0.5, 1.5) };
                let dyt = if r == 0 { t64(&lshape, &dy) } else { t64(&[], &dy) };
                let want = rounded(t, &cpu(grad_op, rname, &[&dyt, &xt, &lt]));
                let ddy = dev_as(g, t, &dy);

                // fused: scale the forward's gradient in place
                let ks = format!("sce_grad_scale_{t}");
                let scaled = dev_as(g, t, &pre);
                run(g, &ks, Grid::elementwise(len as i64, 8), &scale_args(ddy.ptr(), wsum.ptr(), scaled.ptr(), dims, r));
                let got = host_as(&scaled, t);
                let factor = |smp: usize| -> f64 {
                    match r {
                        0 => dy[smp],
                        1 => dy[0],
                        _ if gw[0] == 0.0 => 0.0,
                        _ => dy[0] / gw[0],
                    }
                };
                let host_scaled: Vec<f64> = (0..len)
                    .map(|e| round_to(t, pre[e] * factor(if inner == 1 { e / c } else { (e / (c * inner)) * inner + e % inner })))
                    .collect();
                assert_close(&what(&ks, &format!(", vs the host product, reduction {rname}")), &got, &host_scaled, rtol(t), atol(t));
                // the forward's gradient was rounded to T once already: two roundings for 16-bit
                let tol = if *t == "bf16" || *t == "f16" { 2.0 * rtol(t) } else { rtol(t) };
                assert_close_scaled(&what(&ks, &format!(", vs {grad_op}, reduction {rname}")), &got, &want, tol);

                // recomputed from the scores
                let kg = format!("sce_grad_{t}");
                let dx = zeros_as(g, t, len);
                let args =
                    grad_args(ddy.ptr(), dxb.ptr(), dl.ptr(), wp, wsum.ptr(), dx.ptr(), dims, ignore_index, has_ignore, case.softmax, r);
                run(g, &kg, loss_grid, &args);
                assert_close_scaled(&what(&kg, &format!(", vs {grad_op}, reduction {rname}")), &host_as(&dx, t), &want, rtol(t));
            }
        }
    }
}
