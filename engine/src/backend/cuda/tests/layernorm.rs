//! layernorm.cu: LayerNormalization forward (with and without bias, with and without the saved
//! statistics), layer_norm_stats, the input gradient and the deterministic parameter gradients
//! (per-block partial sums written by the dx kernel, then their reduction), for rows of 1, 200,
//! 1023 and 4096 elements and every float dtype, against the CPU kernels
//! (engine/src/backend/cpu/norm.rs, in f64 on the rounded inputs). The CPU backend has no op for
//! the statistics alone nor for the per-block partials: those references are computed here in
//! f64, mirroring cpu::norm's `stats` and the dscale/dbias sums of its LayerNormGrad.

use super::support::*;
use crate::backend::cpu::testutil;
use crate::backend::cuda::launch::{Grid, KArg};
use crate::backend::cuda::registry::types::{FLOATS, HALVES};
use crate::ir::{Attr, Attrs};

const EPS: f32 = 1e-5;

/// `layer_norm_T(x, scale, bias, y, mean, rstd, i64 rows, i64 n, f32 eps)`
#[allow(clippy::too_many_arguments)]
fn ln_args(x: u64, scale: u64, bias: u64, y: u64, mean: u64, rstd: u64, rows: usize, n: usize) -> Vec<KArg> {
    let p = KArg::Ptr;
    vec![p(x), p(scale), p(bias), p(y), p(mean), p(rstd), KArg::I64(rows as i64), KArg::I64(n as i64), KArg::F32(EPS)]
}

/// `layer_norm_stats_T(x, mean, rstd, i64 rows, i64 n, f32 eps)`
fn stats_args(x: u64, mean: u64, rstd: u64, rows: usize, n: usize) -> Vec<KArg> {
    vec![KArg::Ptr(x), KArg::Ptr(mean), KArg::Ptr(rstd), KArg::I64(rows as i64), KArg::I64(n as i64), KArg::F32(EPS)]
}

/// `layer_norm_grad_T(dy, x, scale, mean, rstd, dx, partial, i64 parts, i64 rows, i64 n)`;
/// `partial` is (its address, parts).
#[allow(clippy::too_many_arguments)]
fn grad_args(dy: u64, x: u64, scale: u64, mean: u64, rstd: u64, dx: u64, partial: (u64, usize), rows: usize, n: usize) -> Vec<KArg> {
    let (p, i) = (KArg::Ptr, |v: usize| KArg::I64(v as i64));
    vec![p(dy), p(x), p(scale), p(mean), p(rstd), p(dx), p(partial.0), i(partial.1), i(rows), i(n)]
}

/// No partials (a row kernel's launch).
const NO_PARTIALS: (u64, usize) = (0, 2);

/// `layer_norm_grad_acc_f32_dy_D_H(dy, x, scale, mean, rstd, dres, dx, dxh, partial, i64 parts,
/// i64 rows, i64 n)`
#[allow(clippy::too_many_arguments)]
fn acc_args(
    dy: u64,
    x: u64,
    scale: u64,
    mean: u64,
    rstd: u64,
    dres: u64,
    dx: u64,
    dxh: u64,
    partial: (u64, usize),
    rows: usize,
    n: usize,
) -> Vec<KArg> {
    let (p, i) = (KArg::Ptr, |v: usize| KArg::I64(v as i64));
    vec![p(dy), p(x), p(scale), p(mean), p(rstd), p(dres), p(dx), p(dxh), p(partial.0), i(partial.1), i(rows), i(n)]
}

/// `layer_norm_grad_params_reduce_T(partial, dscale, dbias, dsum, i64 parts, i64 chunks, i64 n)`;
/// `outs` is (dscale, dbias, dsum).
fn reduce_args(partial: u64, outs: (u64, u64, u64), parts: usize, chunks: usize, n: usize) -> Vec<KArg> {
    let (p, i) = (KArg::Ptr, |v: usize| KArg::I64(v as i64));
    vec![p(partial), p(outs.0), p(outs.1), p(outs.2), i(parts), i(chunks), i(n)]
}

/// The dx kernel's launch summing `parts` rows of partials (layernorm.cu): rows up to 1024 a
/// warp per row, each warp's column sums in `threads / 32 * parts * n` statistics of shared
/// memory; longer rows a block per row, the sums in the partials themselves.
fn partial_grid(n: usize, parts: usize, stat: &str, blocks: u32, threads: u32) -> Grid {
    let shared = if n <= 1024 { threads as usize / 32 * parts * n * size_of(stat) } else { 0 };
    Grid { blocks, threads, shared: shared as u32 }
}

/// The block of a `grid` launch that handles row `r`: warps walk the rows grid-stride (a row a
/// warp), or whole blocks for rows over 1024.
fn block_of_row(r: usize, n: usize, grid: Grid) -> usize {
    let blocks = grid.blocks as usize;
    if n <= 1024 {
        let warps = grid.threads as usize / 32;
        r % (blocks * warps) / warps
    } else {
        r % blocks
    }
}

/// Row length, threads of the row kernels, threads of the dx kernel summing the partials (1 and
/// 4 warps, rows a warp each; 256 threads, a row a block). Rows up to 1024 go one warp per row
/// (16 blocks of 1 or 2 warps walk the 37 rows grid-stride), longer ones one block per row, of
/// at most 256 threads (kernels/layernorm.cu: the warp path's registers leave no room for 1024).
const CASES: &[(usize, u32, u32)] = &[(1, 32, 32), (200, 64, 128), (1023, 256, 128), (4096, 256, 256)];
/// 37 rows; 16 blocks for the row kernels (the grid-stride row loop). The partial-summing launch
/// takes 3 blocks (every warp a few rows) and 16 (blocks or warps without a row: zero partials).
const ROWS: usize = 37;
const ROW_BLOCKS: u32 = 16;
const PARTIAL_BLOCKS: [u32; 2] = [3, 16];

fn eps_attr() -> Attrs {
    Attrs::default().with("epsilon", Attr::Float(EPS)).with("axis", Attr::Int(-1))
}

/// cpu::norm's `stats` in f64: (mean, 1/sqrt(var + eps)) per row, two passes.
fn stats(x: &[f64], n: usize) -> (Vec<f64>, Vec<f64>) {
    x.chunks(n)
        .map(|r| {
            let mean = r.iter().sum::<f64>() / n as f64;
            let var = r.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64;
            (mean, 1.0 / (var + EPS as f64).sqrt())
        })
        .unzip()
}

#[test]
fn layernorm_argument_lists_match_the_registry() {
    let mut checked = Vec::new();
    for t in FLOATS {
        for &(n, _, _) in CASES {
            let ks = [
                ("layer_norm", ln_args(1, 1, 1, 1, 1, 1, ROWS, n)),
                ("layer_norm", ln_args(1, 1, 0, 1, 0, 0, ROWS, n)),
                ("layer_norm_stats", stats_args(1, 1, 1, ROWS, n)),
                ("layer_norm_grad", grad_args(1, 1, 1, 1, 1, 1, (1, 3), ROWS, n)),
                ("layer_norm_grad", grad_args(1, 1, 1, 1, 1, 1, NO_PARTIALS, ROWS, n)),
                ("layer_norm_grad_params_reduce", reduce_args(1, (1, 1, 1), 3, 3, n)),
                ("layer_norm_grad_params_reduce", reduce_args(1, (1, 0, 0), 2, 3, n)),
            ];
            for (op, args) in ks {
                check(&format!("{op}_{t}"), &args);
                checked.push(format!("{op}_{t}"));
            }
        }
    }
    for h in HALVES {
        let n = CASES[0].0;
        let ks = [
            (format!("layer_norm_f32_y_{h}"), ln_args(1, 1, 1, 1, 1, 1, ROWS, n)),
            (format!("layer_norm_grad_f32_dy_{h}"), grad_args(1, 1, 1, 1, 1, 1, (1, 2), ROWS, n)),
        ];
        for (k, args) in ks {
            check(&k, &args);
            checked.push(k);
        }
        for d in ["f32", "bf16", "f16"] {
            let k = format!("layer_norm_grad_acc_f32_dy_{d}_{h}");
            check(&k, &acc_args(1, 1, 1, 1, 1, 1, 1, 1, (1, 3), ROWS, n));
            checked.push(k);
        }
    }
    assert_covers("layernorm", &checked);
}

#[test]
fn gpu_layer_norm_forward_statistics_and_gradients_match_the_cpu_kernels() {
    let Some(g) = gpu("gpu_layer_norm_forward_statistics_and_gradients_match_the_cpu_kernels") else { return };
    let mut rng = Rng::new(31);
    for &(n, threads, pthreads) in CASES {
        let len = ROWS * n;
        let row_grid = Grid::new(ROW_BLOCKS, threads);
        for t in FLOATS {
            let a = acc_of(t);
            let case = format!("{ROWS} rows of {n}, {threads} threads");
            // values around 0.7 (a mean far from 0), scale around 1
            let x: Vec<f64> = rand_as(&mut rng, t, len, -1.3, 2.7);
            let scale = rand_as(&mut rng, t, n, 0.5, 1.5);
            let bias = rand_as(&mut rng, t, n, -0.5, 0.5);
            let dy = rand_as(&mut rng, t, len, -1.0, 1.0);
            let (dxb, dsc, dbi, ddy) = (dev_as(g, t, &x), dev_as(g, t, &scale), dev_as(g, t, &bias), dev_as(g, t, &dy));
            let (xt, st) = (t64(&[ROWS, n], &x), t64(&[n], &scale));

            // forward with bias and the saved statistics
            let k = format!("layer_norm_{t}");
            let (y, mean, rstd) = (zeros_as(g, t, len), zeros_as(g, a, ROWS), zeros_as(g, a, ROWS));
            run(g, &k, row_grid, &ln_args(dxb.ptr(), dsc.ptr(), dbi.ptr(), y.ptr(), mean.ptr(), rstd.ptr(), ROWS, n));
            let want = testutil::run("LayerNormalization", eps_attr(), &[&xt, &st, &t64(&[n], &bias)])[0].to_f64_vec();
            assert_close_scaled(&format!("{k} y, {case}"), &host_as(&y, t), &rounded(t, &want), rtol(t));
            // the statistics are A (f32, f64 for f64): the mean's error is relative to |x|
            let (wmean, wrstd) = stats(&x, n);
            let (gmean, grstd) = (host_as(&mean, a), host_as(&rstd, a));
            let xmax = max_abs(&x);
            assert_close(&format!("{k} mean, {case}"), &gmean, &rounded(a, &wmean), rtol(a), rtol(a) * xmax);
            assert_close(&format!("{k} rstd, {case}"), &grstd, &rounded(a, &wrstd), rtol(a), 0.0);

            // forward without bias, statistics not kept
            let y2 = zeros_as(g, t, len);
            run(g, &k, row_grid, &ln_args(dxb.ptr(), dsc.ptr(), 0, y2.ptr(), 0, 0, ROWS, n));
            let want = testutil::run("LayerNormalization", eps_attr(), &[&xt, &st])[0].to_f64_vec();
            assert_close_scaled(&format!("{k} y without bias, {case}"), &host_as(&y2, t), &rounded(t, &want), rtol(t));

            // the statistics alone: as the forward's (same code), and as the reference
            let ks = format!("layer_norm_stats_{t}");
            let (mean2, rstd2) = (zeros_as(g, a, ROWS), zeros_as(g, a, ROWS));
            run(g, &ks, row_grid, &stats_args(dxb.ptr(), mean2.ptr(), rstd2.ptr(), ROWS, n));
            // bit for bit: a CUDA LayerNormGrad reads the forward's (passes/layer_norm_stats.rs)
            // where it used to recompute them with this kernel
            assert_eq!(host_as(&mean2, a), gmean, "{ks} mean vs {k}'s, {case}");
            assert_eq!(host_as(&rstd2, a), grstd, "{ks} rstd vs {k}'s, {case}");
            assert_close(&format!("{ks} mean, {case}"), &host_as(&mean2, a), &rounded(a, &wmean), rtol(a), rtol(a) * xmax);

            // backward: dx from the forward's statistics; dscale and dbias through the partials
            let wgrad = testutil::run("LayerNormGrad", eps_attr(), &[&t64(&[ROWS, n], &dy), &xt, &st]);
            let (wdx, wds, wdb) = (wgrad[0].to_f64_vec(), wgrad[1].to_f64_vec(), wgrad[2].to_f64_vec());
            let kg = format!("layer_norm_grad_{t}");
            let dx = zeros_as(g, t, len);
            run(g, &kg, row_grid, &grad_args(ddy.ptr(), dxb.ptr(), dsc.ptr(), mean.ptr(), rstd.ptr(), dx.ptr(), NO_PARTIALS, ROWS, n));
            let gdx = host_as(&dx, t);
            // dx = rstd (g - mean(g) - h mean(g h)) cancels (to exactly 0 for rows of 1 element,
            // where an FMA may leave the rounding residue of dy·scale): the error is relative to
            // the terms, rstd·|dy·scale|
            let terms = wrstd.iter().fold(0f64, |m, &v| m.max(v)) * max_abs(&dy) * max_abs(&scale);
            assert_close(&format!("{kg} dx, {case}"), &gdx, &rounded(t, &wdx), rtol(t), rtol(t) * terms);

            let kr = format!("layer_norm_grad_params_reduce_{t}");
            let (abs_ds, abs_db) = abs_sums(&dy, &x, &wmean, &wrstd, n);
            // dx's column sums (the third row of partials, parts 3): dsum, against dx's own
            let (wsum, abs_sum) = column_sums(&gdx, n);
            for (blocks, parts) in PARTIAL_BLOCKS.iter().flat_map(|&b| [(b, 2), (b, 3)]) {
                let pgrid = partial_grid(n, parts, a, blocks, pthreads);
                let pcase = format!("{case}, dx kernel summing {parts} rows of partials on {blocks} x {pthreads}");
                let chunks = blocks as usize;
                // NaN-filled, so an element the kernel does not write fails
                let (dx2, partial) = (zeros_as(g, t, len), dev_as(g, a, &vec![f64::NAN; chunks * parts * n]));
                let args = grad_args(ddy.ptr(), dxb.ptr(), dsc.ptr(), mean.ptr(), rstd.ptr(), dx2.ptr(), (partial.ptr(), parts), ROWS, n);
                run(g, &kg, pgrid, &args);
                assert_eq!(host_as(&dx2, t), gdx, "{kg} dx summing the partials vs without, {pcase}");
                let gpart = host_as(&partial, a);
                let (wpart, wabs) = ref_partials(&dy, &x, &wmean, &wrstd, &gdx, n, parts, pgrid);
                let what = format!("{kg} partial [block][dscale, dbias, dx][column], {pcase}");
                assert_close(&what, &gpart, &wpart, rtol(a), rtol(a) * max_abs(&wabs));

                // at most 2 blocks of 1024 (32 chunk lanes) or 64 threads (2): the grid-stride
                // loop over groups of 32 columns, chunk lanes with one chunk or none
                for (rblocks, rthreads) in [(2, 1024), (1, 64)] {
                    let rgrid = Grid::new(rblocks, rthreads);
                    let rcase = format!("{pcase}, reduced on {rblocks} x {rthreads}");
                    let (ds, db, dsum) = (zeros_as(g, t, n), zeros_as(g, t, n), dev_as(g, t, &vec![f64::NAN; n]));
                    run(g, &kr, rgrid, &reduce_args(partial.ptr(), (ds.ptr(), db.ptr(), dsum.ptr()), parts, chunks, n));
                    let (gds, gdb, gsum) = (host_as(&ds, t), host_as(&db, t), host_as(&dsum, t));
                    // against the CPU gradient (sums over 37 rows that cancel: relative to the terms)
                    let what = format!("{kr} dscale vs LayerNormGrad, {rcase}");
                    assert_close(&what, &gds, &rounded(t, &wds), rtol(t), rtol(t) * max_abs(&abs_ds));
                    let what = format!("{kr} dbias vs LayerNormGrad, {rcase}");
                    assert_close(&what, &gdb, &rounded(t, &wdb), rtol(t), rtol(t) * max_abs(&abs_db));
                    // and against the sum of the kernel's own partials: one rounding to T
                    let sum_of = |which: usize| -> Vec<f64> {
                        (0..n).map(|j| (0..chunks).map(|c| gpart[(c * parts + which) * n + j]).sum()).collect()
                    };
                    assert_close(&format!("{kr} dscale vs its partials, {rcase}"), &gds, &rounded(t, &sum_of(0)), rtol(t), atol(t));
                    assert_close(&format!("{kr} dbias vs its partials, {rcase}"), &gdb, &rounded(t, &sum_of(1)), rtol(t), atol(t));
                    if parts == 3 {
                        let what = format!("{kr} dsum vs dx's column sums, {rcase}");
                        assert_close(&what, &gsum, &rounded(t, &wsum), rtol(t), rtol(t) * max_abs(&abs_sum));
                        assert_close(&format!("{kr} dsum vs its partials, {rcase}"), &gsum, &rounded(t, &sum_of(2)), rtol(t), atol(t));
                    } else {
                        assert!(gsum.iter().all(|v| v.is_nan()), "{kr} wrote dsum from 2 rows of partials, {rcase}");
                    }
                    // dbias and dsum null: dscale alone, the same values
                    let ds2 = zeros_as(g, t, n);
                    run(g, &kr, rgrid, &reduce_args(partial.ptr(), (ds2.ptr(), 0, 0), parts, chunks, n));
                    assert_eq!(host_as(&ds2, t), gds, "{kr} with dbias null: dscale differs, {rcase}");
                }
            }
        }
    }
}

/// The column sums of `dx` [rows, n] in f64, and of their absolute values.
fn column_sums(dx: &[f64], n: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut s, mut a) = (vec![0f64; n], vec![0f64; n]);
    for row in dx.chunks(n) {
        for j in 0..n {
            s[j] += row[j];
            a[j] += row[j].abs();
        }
    }
    (s, a)
}

/// The sums over rows of |dy·h| and |dy| per column: the scale of dscale's and dbias's rounding
/// errors.
fn abs_sums(dy: &[f64], x: &[f64], mean: &[f64], rstd: &[f64], n: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut ds, mut db) = (vec![0f64; n], vec![0f64; n]);
    for r in 0..dy.len() / n {
        for j in 0..n {
            let (d, h) = (dy[r * n + j], (x[r * n + j] - mean[r]) * rstd[r]);
            ds[j] += (d * h).abs();
            db[j] += d.abs();
        }
    }
    (ds, db)
}

/// Reference partials of a `grid` launch, [block][dscale, dbias, dx (parts 3)][column], in f64
/// with the f64 statistics and the kernel's stored `dx`, and the sums of |terms| (the scale of
/// their rounding errors), each block over the rows `block_of_row` gives it.
#[allow(clippy::too_many_arguments)]
fn ref_partials(dy: &[f64], x: &[f64], mean: &[f64], rstd: &[f64], dx: &[f64], n: usize, parts: usize, grid: Grid) -> (Vec<f64>, Vec<f64>) {
    let len = grid.blocks as usize * parts * n;
    let (mut part, mut abs) = (vec![0f64; len], vec![0f64; len]);
    for r in 0..dy.len() / n {
        let b = block_of_row(r, n, grid);
        for j in 0..n {
            let (d, h) = (dy[r * n + j], (x[r * n + j] - mean[r]) * rstd[r]);
            let mut terms = vec![d * h, d];
            if parts > 2 {
                terms.push(dx[r * n + j]);
            }
            for (p, v) in terms.into_iter().enumerate() {
                part[(b * parts + p) * n + j] += v;
                abs[(b * parts + p) * n + j] += v.abs();
            }
        }
    }
    (part, abs)
}

/// CUDA sessions keep LayerNorm's statistics for its gradient (passes/layer_norm_stats.rs): in
/// the CUDA train graph LayerNormGrad reads the forward node's Mean and InvStdDev, so the
/// gradient launches no layer_norm_stats; the CPU's recomputes them (three inputs).
#[test]
fn cuda_layer_norm_gradients_read_the_forward_statistics() {
    let m = super::exec_models::attention_bits(&mut Rng::new(5));
    for (target, kept) in [(crate::session::Target::Cuda, true), (crate::session::Target::Cpu, false)] {
        let s = super::exec::session_for(&m, target);
        let find = |op: &str| s.graph.nodes.iter().find(|n| n.op_type == op).unwrap_or_else(|| panic!("{op} in {target:?}"));
        let (ln, grad) = (find("LayerNormalization"), find("LayerNormGrad"));
        if kept {
            assert_eq!(grad.inputs[3..], [Some(ln.outputs[1]), Some(ln.outputs[2])], "{target:?}: {grad:?}");
        } else {
            assert_eq!(grad.inputs.len(), 3, "{target:?}: {grad:?}");
        }
    }
}

/// The mixed kernels of passes/layer_norm_half.rs (f32 x, 16-bit y or dy) compute what the f32
/// kernels compute around a cast, bit for bit: y is the f32 kernel's y rounded to 16 bits (where
/// the plan had LayerNorm then Cast), dx and the dscale/dbias partials from a 16-bit dy are the
/// f32 kernels' from that dy widened (where the plan had CastLike then LayerNormGrad).
#[test]
fn gpu_mixed_layer_norm_kernels_are_the_f32_kernels_around_a_cast() {
    let Some(g) = gpu("gpu_mixed_layer_norm_kernels_are_the_f32_kernels_around_a_cast") else { return };
    let mut rng = Rng::new(37);
    for &(n, threads, pthreads) in CASES {
        let (len, row_grid) = (ROWS * n, Grid::new(ROW_BLOCKS, threads));
        let x = rand_as(&mut rng, "f32", len, -1.3, 2.7);
        let (scale, bias) = (rand_as(&mut rng, "f32", n, 0.5, 1.5), rand_as(&mut rng, "f32", n, -0.5, 0.5));
        let (dx_in, dsc, dbi) = (dev_as(g, "f32", &x), dev_as(g, "f32", &scale), dev_as(g, "f32", &bias));
        let (y, mean, rstd) = (zeros_as(g, "f32", len), zeros_as(g, "f32", ROWS), zeros_as(g, "f32", ROWS));
        run(g, "layer_norm_f32", row_grid, &ln_args(dx_in.ptr(), dsc.ptr(), dbi.ptr(), y.ptr(), mean.ptr(), rstd.ptr(), ROWS, n));
        let pgrid = partial_grid(n, 3, "f32", PARTIAL_BLOCKS[0], pthreads);
        let chunks = pgrid.blocks as usize;
        for h in HALVES {
            let case = format!("{ROWS} rows of {n}, {threads} threads, {h}");
            let k = format!("layer_norm_f32_y_{h}");
            let (yh, mean_h, rstd_h) = (zeros_as(g, h, len), zeros_as(g, "f32", ROWS), zeros_as(g, "f32", ROWS));
            run(g, &k, row_grid, &ln_args(dx_in.ptr(), dsc.ptr(), dbi.ptr(), yh.ptr(), mean_h.ptr(), rstd_h.ptr(), ROWS, n));
            assert_eq!(host_as(&yh, h), rounded(h, &host_as(&y, "f32")), "{k} y vs layer_norm_f32's rounded, {case}");
            assert_eq!(host_as(&mean_h, "f32"), host_as(&mean, "f32"), "{k} mean, {case}");
            assert_eq!(host_as(&rstd_h, "f32"), host_as(&rstd, "f32"), "{k} rstd, {case}");

            // dy representable in 16 bits, given as 16 bits and as its f32 widening
            let dy = rand_as(&mut rng, h, len, -1.0, 1.0);
            let (dy_h, dy_f) = (dev_as(g, h, &dy), dev_as(g, "f32", &dy));
            let kg = format!("layer_norm_grad_f32_dy_{h}");
            let mut outs = Vec::new();
            for (k, dy) in [(kg.as_str(), &dy_h), ("layer_norm_grad_f32", &dy_f)] {
                let (dx, partial) = (zeros_as(g, "f32", len), dev_as(g, "f32", &vec![f64::NAN; chunks * 3 * n]));
                run(
                    g,
                    k,
                    pgrid,
                    &grad_args(dy.ptr(), dx_in.ptr(), dsc.ptr(), mean.ptr(), rstd.ptr(), dx.ptr(), (partial.ptr(), 3), ROWS, n),
                );
                outs.push((host_as(&dx, "f32"), host_as(&partial, "f32")));
            }
            let ((dx_h, part_h), (dx_f, part_f)) = (&outs[0], &outs[1]);
            assert_eq!(dx_h, dx_f, "{kg} dx vs layer_norm_grad_f32's, {case}");
            assert!(part_h.iter().all(|v| v.is_finite()), "{kg}: a partial was not written, {case}");
            assert_eq!(part_h, part_f, "{kg} partials vs layer_norm_grad_f32's, {case}");
        }
    }
}

/// In a bf16 CUDA session (autocast), the LayerNorm before a matmul writes bf16 itself
/// (passes/layer_norm_half.rs): no Cast reads its output, and its LayerNormGrad reads the bf16
/// gradient. Without a GPU: a kernel for every step, and the CPU executor's step within bf16's
/// precision of the fp32 session's; on a GPU, the GPU's within that of the CPU's.
#[test]
fn sixteen_bit_layer_norm_outputs_need_no_cast() {
    use crate::backend::cpu::bf16::MatmulPrecision;
    use crate::tensor::DType;
    let mut rng = Rng::new(41);
    let m = super::exec_models::attention_bits(&mut rng);
    let s = super::exec::session_with(&m, crate::session::Target::Cuda, MatmulPrecision::Bf16);
    let plan = s.plan(&[m.sig()], true).expect("plan");
    let steps: Vec<&crate::ir::Node> = plan.steps.iter().map(|n| &s.graph.nodes[n.0]).collect();
    let ln = steps.iter().find(|n| n.op_type == "LayerNormalization").expect("a LayerNorm step");
    let y = ln.outputs[0];
    assert_eq!(plan.dtype(y), Some(DType::BF16), "the LayerNorm writes bf16");
    assert!(!steps.iter().any(|n| n.op_type == "Cast" && n.input(0) == Some(y)), "no Cast reads the LayerNorm's output");
    let grad = steps.iter().find(|n| n.op_type == "LayerNormGrad").expect("a LayerNormGrad step");
    let (dy, dx) = (grad.input(0).expect("dy"), grad.outputs[0]);
    assert_eq!((plan.dtype(dy), plan.dtype(dx)), (Some(DType::BF16), Some(DType::F32)), "LayerNormGrad: bf16 dy, f32 dx");
    super::exec::bf16_step_matches("attention_bits", "sixteen_bit_layer_norm_outputs_need_no_cast", &m, &s, &plan, &mut rng);
}

/// The accumulating dx kernels of passes/layer_norm_grad_sum.rs compute what they replace, bit
/// for bit: the plain dx kernel's dx (f32 or 16-bit dy), plus the residual gradient in one f32
/// add (the Add kernel's), and that sum rounded to 16 bits (the cast kernel's); with dres or the
/// copy absent, the same without them.
#[test]
fn gpu_accumulating_layer_norm_grad_is_the_dx_kernel_then_add_and_cast() {
    let Some(g) = gpu("gpu_accumulating_layer_norm_grad_is_the_dx_kernel_then_add_and_cast") else { return };
    let mut rng = Rng::new(43);
    for &(n, threads, pthreads) in CASES {
        let (len, row_grid) = (ROWS * n, Grid::new(ROW_BLOCKS, threads));
        let pgrid = partial_grid(n, 3, "f32", PARTIAL_BLOCKS[1], pthreads);
        let chunks = pgrid.blocks as usize;
        let x = dev_as(g, "f32", &rand_as(&mut rng, "f32", len, -1.3, 2.7));
        let scale = dev_as(g, "f32", &rand_as(&mut rng, "f32", n, 0.5, 1.5));
        let (mean, rstd) = (zeros_as(g, "f32", ROWS), zeros_as(g, "f32", ROWS));
        run(g, "layer_norm_stats_f32", row_grid, &stats_args(x.ptr(), mean.ptr(), rstd.ptr(), ROWS, n));
        let dres_v = rand_as(&mut rng, "f32", len, -2.0, 2.0);
        let dres = dev_as(g, "f32", &dres_v);
        for d in ["f32", "bf16", "f16"] {
            let dy = dev_as(g, d, &rand_as(&mut rng, d, len, -1.0, 1.0));
            let (plain, partial) = (zeros_as(g, "f32", len), zeros_as(g, "f32", chunks * 3 * n));
            let k = if d == "f32" { "layer_norm_grad_f32".to_string() } else { format!("layer_norm_grad_f32_dy_{d}") };
            run(g, &k, pgrid, &grad_args(dy.ptr(), x.ptr(), scale.ptr(), mean.ptr(), rstd.ptr(), plain.ptr(), (partial.ptr(), 3), ROWS, n));
            let (plain, partial) = (host_as(&plain, "f32"), host_as(&partial, "f32"));
            let summed: Vec<f64> = plain.iter().zip(&dres_v).map(|(&a, &b)| (a as f32 + b as f32) as f64).collect();
            for h in HALVES {
                let case = format!("{ROWS} rows of {n}, {threads} threads, dy {d}, copy {h}");
                let acc = format!("layer_norm_grad_acc_f32_dy_{d}_{h}");
                // the row kernels' launch without partials, then the partial-summing one
                for (with_dres, with_copy, sums) in [(true, true, false), (true, false, true), (false, true, true)] {
                    let (dx, dxh) = (dev_as(g, "f32", &vec![f64::NAN; len]), dev_as(g, h, &vec![f64::NAN; len]));
                    let part = dev_as(g, "f32", &vec![f64::NAN; chunks * 3 * n]);
                    let (r, c) = (if with_dres { dres.ptr() } else { 0 }, if with_copy { dxh.ptr() } else { 0 });
                    let (grid, p) = if sums { (pgrid, (part.ptr(), 3)) } else { (row_grid, NO_PARTIALS) };
                    run(g, &acc, grid, &acc_args(dy.ptr(), x.ptr(), scale.ptr(), mean.ptr(), rstd.ptr(), r, dx.ptr(), c, p, ROWS, n));
                    let got_part = host_as(&part, "f32");
                    if sums {
                        // dscale's and dbias's rows as the plain kernel's, dx's the sums of this dx
                        let rows_of =
                            |v: &[f64], p: usize| -> Vec<f64> { (0..chunks).flat_map(|b| v[(b * 3 + p) * n..][..n].to_vec()).collect() };
                        for p in 0..2 {
                            assert_eq!(
                                rows_of(&got_part, p),
                                rows_of(&partial, p),
                                "{acc} partial row {p} vs {k}'s (dres {with_dres}), {case}"
                            );
                        }
                        let want = if with_dres { &summed } else { &plain };
                        let (wpart, wabs) = ref_partials(want, want, &[0.0; ROWS], &[0.0; ROWS], want, n, 3, pgrid);
                        let what = format!("{acc} dx's column-sum partials (dres {with_dres}), {case}");
                        assert_close(&what, &rows_of(&got_part, 2), &rows_of(&wpart, 2), rtol("f32"), rtol("f32") * max_abs(&wabs));
                    } else {
                        assert!(got_part.iter().all(|v| v.is_nan()), "{acc} wrote partials it was not given, {case}");
                    }
                    let want = if with_dres { &summed } else { &plain };
                    let got = host_as(&dx, "f32");
                    assert_eq!(&got, want, "{acc} dx (dres {with_dres}), {case}");
                    let copy = host_as(&dxh, h);
                    if with_copy {
                        assert_eq!(copy, rounded(h, want), "{acc} 16-bit copy (dres {with_dres}), {case}");
                    } else {
                        assert!(copy.iter().all(|v| v.is_nan()), "{acc} wrote a copy it was not given, {case}");
                    }
                }
            }
        }
    }
}

/// The LayerNormGrads of a pre-norm residual stack sum the residual stream's gradient
/// themselves (input 5) and, in bf16 sessions, write the 16-bit copy the matmul before them
/// reads (output 3): no Add or cast step reads their dx. fp32: the two blocks' sums; bf16: those,
/// two copies (the first block's sum flows on in f32, to the position term) and the first
/// block's bias gradient, the step within bf16's precision of the fp32 one (on a GPU, the GPU's
/// of the CPU's). The fp32 step's parity is gpu_train_step_matches_the_cpu_executor's and
/// recomputed_activations_give_the_same_train_step's (the model is one of exec_models::models).
#[test]
fn residual_gradients_sum_in_the_layer_norm_gradient() {
    use crate::backend::cpu::bf16::MatmulPrecision;
    use crate::tensor::DType;
    let mut rng = Rng::new(47);
    let m = super::exec_models::pre_norm_residual(&mut rng);
    for (precision, copies) in [(MatmulPrecision::Fp32, 0), (MatmulPrecision::Bf16, 2)] {
        let s = super::exec::session_with(&m, crate::session::Target::Cuda, precision);
        let plan = s.plan(&[m.sig()], true).expect("plan");
        let steps: Vec<&crate::ir::Node> = plan.steps.iter().map(|n| &s.graph.nodes[n.0]).collect();
        let grads: Vec<&&crate::ir::Node> = steps.iter().filter(|n| n.op_type == "LayerNormGrad").collect();
        assert_eq!(grads.len(), 3, "{precision:?}: LayerNormGrad steps");
        let summing = grads.iter().filter(|n| n.input(5).is_some()).count();
        assert_eq!(summing, 2, "{precision:?}: LayerNormGrads summing the residual gradient");
        // bf16: the first block's projection adds the residual itself (fuse_residual_linear), its
        // bias gradient the column sums of the second LayerNorm's dx, summed by that
        // LayerNormGrad (passes/layer_norm_grad_col_sum.rs); fp32: the Gemm's own rule
        let col_sums = grads.iter().filter(|n| n.attrs.int("dx_col_sum", 0).ok() == Some(1)).count();
        let sum_rows = steps.iter().filter(|n| n.op_type == "SumRows").count();
        let want = if precision == MatmulPrecision::Bf16 { 1 } else { 0 };
        assert_eq!((col_sums, sum_rows), (want, 0), "{precision:?}: dx column sums, SumRows");
        let with_copy: Vec<_> = grads.iter().filter(|n| n.attrs.int("dx_half_type", 0).ok().is_some_and(|t| t != 0)).collect();
        assert_eq!(with_copy.len(), copies, "{precision:?}: LayerNormGrads writing a 16-bit dx");
        for n in &with_copy {
            assert_eq!(plan.dtype(n.outputs[3]), Some(DType::BF16), "{precision:?}: {}'s copy", n.name);
        }
        for n in &grads {
            let dx = n.outputs[0];
            let reader = steps.iter().find(|r| {
                matches!(r.op_type.as_str(), "Add" | "Cast" | "CastLike") && r.input(0) == Some(dx)
                    || r.input(1) == Some(dx) && r.op_type == "Add"
            });
            assert!(reader.is_none(), "{precision:?}: {} reads {}'s dx", reader.map_or("", |r| r.name.as_str()), n.name);
        }
        if precision == MatmulPrecision::Bf16 {
            super::exec::bf16_step_matches(
                "pre_norm_residual",
                "residual_gradients_sum_in_the_layer_norm_gradient",
                &m,
                &s,
                &plan,
                &mut rng,
            );
        }
    }
}
