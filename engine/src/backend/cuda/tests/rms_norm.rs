//! rmsnorm.cu: the RMS normalisation forward (with and without a scale) and its gradient (dx, and
//! dscale through the dx kernel's per-block partials and layernorm.cu's reduction), for rows of
//! 1, 200, 1023 and 4096 elements (a warp a row up to 1024, a block a row beyond) and every float
//! dtype, against the CPU kernels (backend/cpu/rms_norm.rs, in f64 on the rounded inputs).

use super::support::*;
use crate::backend::cpu::{testutil, CpuCtx};
use crate::backend::cuda::launch::{Grid, KArg};
use crate::backend::cuda::registry::types::FLOATS;
use crate::ir::{Attr, Attrs};
use crate::tensor::Tensor;

const EPS: f32 = 1e-5;

/// `rms_norm_T(x, scale, y, inv_rms, i64 rows, i64 n, f32 eps)`
fn fwd_args(x: u64, scale: u64, y: u64, inv: u64, rows: usize, n: usize) -> Vec<KArg> {
    let p = KArg::Ptr;
    vec![p(x), p(scale), p(y), p(inv), KArg::I64(rows as i64), KArg::I64(n as i64), KArg::F32(EPS)]
}

/// `rms_norm_grad_T(dy, x, scale, inv_rms, dx, partial, i64 rows, i64 n)`
#[allow(clippy::too_many_arguments)]
fn grad_args(dy: u64, x: u64, scale: u64, inv: u64, dx: u64, partial: u64, rows: usize, n: usize) -> Vec<KArg> {
    let (p, i) = (KArg::Ptr, |v: usize| KArg::I64(v as i64));
    vec![p(dy), p(x), p(scale), p(inv), p(dx), p(partial), i(rows), i(n)]
}

/// `layer_norm_grad_params_reduce_T(partial, dscale, null, null, parts 1, chunks, n)`: dscale.
fn reduce_args(partial: u64, dscale: u64, chunks: usize, n: usize) -> Vec<KArg> {
    let (p, i) = (KArg::Ptr, |v: usize| KArg::I64(v as i64));
    vec![p(partial), p(dscale), p(0), p(0), i(1), i(chunks), i(n)]
}

/// Row length, threads of the row kernels, threads of the dx kernel summing the partials (as
/// layernorm.rs's cases: rows up to 1024 a warp each, longer ones a block each).
const CASES: &[(usize, u32, u32)] = &[(1, 32, 32), (200, 64, 128), (1023, 256, 128), (4096, 256, 256)];
/// 37 rows, walked grid-stride by 16 blocks; the partial-summing launch takes 3 blocks (every
/// warp a few rows) and 16 (warps or blocks without a row: zero partials).
const ROWS: usize = 37;
const ROW_BLOCKS: u32 = 16;
const PARTIAL_BLOCKS: [u32; 2] = [3, 16];

fn eps_attr() -> Attrs {
    Attrs::default().with("epsilon", Attr::Float(EPS))
}

/// The CPU kernel's outputs for these inputs (f64 tensors: the reference in f64).
fn cpu(op: &str, inputs: &[Option<&Tensor>]) -> Vec<Vec<f64>> {
    let outs = testutil::try_run_opt(op, eps_attr(), inputs, &mut CpuCtx::new(0)).unwrap_or_else(|e| panic!("{op}: {e}"));
    outs.iter().map(|t| t.to_f64_vec()).collect()
}

#[test]
fn rmsnorm_argument_lists_match_the_registry() {
    let mut checked = Vec::new();
    for t in FLOATS {
        for (k, args) in [
            (format!("rms_norm_{t}"), fwd_args(1, 1, 1, 1, ROWS, 200)),
            (format!("rms_norm_{t}"), fwd_args(1, 0, 1, 1, ROWS, 200)),
            (format!("rms_norm_grad_{t}"), grad_args(1, 1, 1, 1, 1, 1, ROWS, 200)),
            (format!("rms_norm_grad_{t}"), grad_args(1, 0, 1, 1, 1, 0, ROWS, 200)),
        ] {
            check(&k, &args);
            checked.push(k);
        }
        check(&format!("layer_norm_grad_params_reduce_{t}"), &reduce_args(1, 1, 3, 200));
    }
    assert_covers("rmsnorm", &checked);
}

#[test]
fn gpu_rms_norm_and_its_gradients_match_the_cpu_kernels() {
    let Some(g) = gpu("gpu_rms_norm_and_its_gradients_match_the_cpu_kernels") else { return };
    let mut rng = Rng::new(37);
    for &(n, threads, pthreads) in CASES {
        let len = ROWS * n;
        let row_grid = Grid::new(ROW_BLOCKS, threads);
        for t in FLOATS {
            let a = acc_of(t);
            // values around 0.7, scale around 1
            let x = rand_as(&mut rng, t, len, -1.3, 2.7);
            let scale = rand_as(&mut rng, t, n, 0.5, 1.5);
            let dy = rand_as(&mut rng, t, len, -1.0, 1.0);
            let (dx_in, ds_in, ddy) = (dev_as(g, t, &x), dev_as(g, t, &scale), dev_as(g, t, &dy));
            let (xt, st, dyt) = (t64(&[ROWS, n], &x), t64(&[n], &scale), t64(&[ROWS, n], &dy));
            for scaled in [true, false] {
                let case = format!("{t}, {ROWS} rows of {n}, {threads} threads, {}", if scaled { "scaled" } else { "no scale" });
                let (sp, s_ref) = if scaled { (ds_in.ptr(), Some(&st)) } else { (0, None) };

                let k = format!("rms_norm_{t}");
                let (y, inv) = (zeros_as(g, t, len), zeros_as(g, a, ROWS));
                run(g, &k, row_grid, &fwd_args(dx_in.ptr(), sp, y.ptr(), inv.ptr(), ROWS, n));
                let want = cpu("RmsNorm", &[Some(&xt), s_ref]);
                assert_close_scaled(&format!("{k} y, {case}"), &host_as(&y, t), &rounded(t, &want[0]), rtol(t));
                assert_close(&format!("{k} 1/rms, {case}"), &host_as(&inv, a), &rounded(a, &want[1]), rtol(a), 0.0);

                let winv = t64(&[ROWS, 1], &want[1]);
                let wgrad = cpu("RmsNormGrad", &[Some(&dyt), Some(&xt), s_ref, Some(&winv)]);
                let kg = format!("rms_norm_grad_{t}");
                let dx = zeros_as(g, t, len);
                run(g, &kg, row_grid, &grad_args(ddy.ptr(), dx_in.ptr(), sp, inv.ptr(), dx.ptr(), 0, ROWS, n));
                let gdx = host_as(&dx, t);
                // dx = r (g - h mean(g h)) cancels: the error is relative to the terms, r·|dy·scale|
                let r_max = want[1].iter().fold(0f64, |m, &v| m.max(v));
                let terms = r_max * max_abs(&dy) * if scaled { max_abs(&scale) } else { 1.0 };
                assert_close(&format!("{kg} dx, {case}"), &gdx, &rounded(t, &wgrad[0]), rtol(t), rtol(t) * terms);
                if !scaled {
                    continue;
                }
                // dscale = Σ over rows of dy·x·r: per-block partials, then their reduction
                let abs_ds: Vec<f64> = (0..n).map(|j| (0..ROWS).map(|r| (dy[r * n + j] * x[r * n + j] * want[1][r]).abs()).sum()).collect();
                for blocks in PARTIAL_BLOCKS {
                    let shared = if n <= 1024 { pthreads as usize / 32 * n * float_size(a) } else { 0 };
                    let pgrid = Grid { blocks, threads: pthreads, shared: shared as u32 };
                    let pcase = format!("{case}, dx kernel summing the partials on {blocks} x {pthreads}");
                    // NaN-filled: a block that writes no partials (zeros where it has no row) fails
                    let (dx2, partial) = (zeros_as(g, t, len), dev_as(g, a, &vec![f64::NAN; blocks as usize * n]));
                    run(g, &kg, pgrid, &grad_args(ddy.ptr(), dx_in.ptr(), sp, inv.ptr(), dx2.ptr(), partial.ptr(), ROWS, n));
                    assert_eq!(host_as(&dx2, t), gdx, "{kg} dx summing the partials vs without, {pcase}");
                    let kr = format!("layer_norm_grad_params_reduce_{t}");
                    let ds = zeros_as(g, t, n);
                    run(g, &kr, Grid::new(2, 1024), &reduce_args(partial.ptr(), ds.ptr(), blocks as usize, n));
                    let what = format!("{kr} dscale vs RmsNormGrad, {pcase}");
                    assert_close(&what, &host_as(&ds, t), &rounded(t, &wgrad[1]), rtol(t), rtol(t) * max_abs(&abs_ds));
                }
            }
        }
    }
}
