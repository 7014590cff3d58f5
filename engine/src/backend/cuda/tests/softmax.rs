//! softmax.cu: Softmax and LogSoftmax forward and backward over the middle axis of
//! [outer, n, inner], every float dtype, against the CPU kernels (engine/src/backend/cpu/
//! softmax.rs, in f64 on the rounded inputs), including in-place launches.

use super::support::*;
use crate::backend::cpu::testutil;
use crate::backend::cuda::launch::{Grid, KArg};
use crate::backend::cuda::registry::types::FLOATS;
use crate::ir::{Attr, Attrs};

/// `softmax_T / log_softmax_T(const T* x, T* y, i64 rows, i64 n, i64 inner)`
fn fwd_args(x: u64, y: u64, rows: usize, n: usize, inner: usize) -> Vec<KArg> {
    vec![KArg::Ptr(x), KArg::Ptr(y), KArg::I64(rows as i64), KArg::I64(n as i64), KArg::I64(inner as i64)]
}

/// `softmax_grad_T / log_softmax_grad_T(const T* dy, const T* y, T* dx, i64 rows, i64 n, i64 inner)`
fn bwd_args(dy: u64, y: u64, dx: u64, rows: usize, n: usize, inner: usize) -> Vec<KArg> {
    vec![KArg::Ptr(dy), KArg::Ptr(y), KArg::Ptr(dx), KArg::I64(rows as i64), KArg::I64(n as i64), KArg::I64(inner as i64)]
}

/// (outer, n, inner, threads per block, blocks): n not a multiple of 32, n > 1024 with inner > 1
/// on 1024 threads, n below one warp, and fewer blocks than rows (the grid-stride row loop).
const CASES: &[(usize, usize, usize, u32, u32)] = &[(5, 1000, 1, 256, 3), (3, 1500, 3, 1024, 4), (4, 7, 5, 64, 20), (2, 2049, 2, 128, 3)];

const OPS: &[(&str, &str)] = &[("softmax", "Softmax"), ("log_softmax", "LogSoftmax")];

fn axis1() -> Attrs {
    Attrs::default().with("axis", Attr::Int(1))
}

#[test]
fn softmax_argument_lists_match_the_registry() {
    let mut checked = Vec::new();
    for (op, _) in OPS {
        for t in FLOATS {
            for &(outer, n, inner, _, _) in CASES {
                check(&format!("{op}_{t}"), &fwd_args(0, 0, outer * inner, n, inner));
                check(&format!("{op}_grad_{t}"), &bwd_args(0, 0, 0, outer * inner, n, inner));
            }
            checked.extend([format!("{op}_{t}"), format!("{op}_grad_{t}")]);
        }
    }
    assert_covers("softmax", &checked);
}

#[test]
fn gpu_softmax_and_log_softmax_match_the_cpu_kernels() {
    let Some(g) = gpu("gpu_softmax_and_log_softmax_match_the_cpu_kernels") else { return };
    let mut rng = Rng::new(21);
    for &(outer, n, inner, threads, blocks) in CASES {
        let (rows, len) = (outer * inner, outer * n * inner);
        let shape = [outer, n, inner];
        let grid = Grid::new(blocks, threads);
        for t in FLOATS {
            let x = rand_as(&mut rng, t, len, -5.0, 5.0);
            let dy = rand_as(&mut rng, t, len, -1.0, 1.0);
            for &(op, cpu) in OPS {
                let case = format!("[{outer}, {n}, {inner}] over axis 1, grid {blocks} x {threads}");
                // forward
                let k = format!("{op}_{t}");
                let (dx_, y) = (dev_as(g, t, &x), zeros_as(g, t, len));
                run(g, &k, grid, &fwd_args(dx_.ptr(), y.ptr(), rows, n, inner));
                let got = host_as(&y, t);
                let want = rounded(t, &testutil::run(cpu, axis1(), &[&t64(&shape, &x)])[0].to_f64_vec());
                if op == "softmax" {
                    // y in (0, 1): relative to each element (exp and one division per element)
                    assert_close(&format!("{k} {case}"), &got, &want, rtol(t), atol(t));
                } else {
                    // x - logsumexp: the error is relative to |logsumexp|, not to the result
                    assert_close_scaled(&format!("{k} {case}"), &got, &want, rtol(t));
                }
                // in place (y aliases x): the same bits
                run(g, &k, grid, &fwd_args(dx_.ptr(), dx_.ptr(), rows, n, inner));
                assert_eq!(host_as(&dx_, t), got, "{k} {case}: in place differs from out of place");

                // backward, from the reference forward output (rounded)
                let kg = format!("{op}_grad_{t}");
                let (ddy, dyv, dxb) = (dev_as(g, t, &dy), dev_as(g, t, &want), zeros_as(g, t, len));
                run(g, &kg, grid, &bwd_args(ddy.ptr(), dyv.ptr(), dxb.ptr(), rows, n, inner));
                let got = host_as(&dxb, t);
                let wantg = testutil::run(&format!("{cpu}Grad"), axis1(), &[&t64(&shape, &dy), &t64(&shape, &want)])[0].to_f64_vec();
                // dy - sum(...) cancels: the error is relative to the row's terms
                assert_close_scaled(&format!("{kg} {case}"), &got, &rounded(t, &wantg), rtol(t));
                // in place (dx aliases dy)
                run(g, &kg, grid, &bwd_args(ddy.ptr(), dyv.ptr(), ddy.ptr(), rows, n, inner));
                assert_eq!(host_as(&ddy, t), got, "{kg} {case}: in place differs from out of place");
            }
        }
    }
}
