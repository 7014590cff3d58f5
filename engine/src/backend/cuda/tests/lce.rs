//! loss.cu's LinearCrossEntropy kernels against their definition computed on the host in f64
//! (the CPU backend has no kernel of this shape: its LinearCrossEntropy walks whole chunks with
//! its gemms): `lce_weights` (row weights with class weights, ignore_index and invalid labels,
//! their sum) and `lce_rows` (a chunk's logits plus bias into the unit-seed gradient
//! w·f·(softmax − one-hot), f = 1/Σw for the mean or 1 for the sum, and the rows' loss terms),
//! for f32 and f64, on a chunk that starts inside the rows (the kernels' offset arguments).
//! The whole op (cuBLAS and these kernels) runs in exec.rs's `lm_head` models.

use super::support::*;
use crate::backend::cuda::launch::{Grid, KArg};
use crate::backend::cuda::registry::types::{FLOATS, HALVES};

/// `lce_weights_T(labels, weights, A* w_s, A* wsum, i64 rows, i64 C, i64 ignore_index,
/// i32 has_ignore, i32* err)`
#[allow(clippy::too_many_arguments)]
fn weights_args(labels: u64, weights: u64, w_s: u64, wsum: u64, rows: usize, c: usize, ignore: Option<i64>, err: u64) -> Vec<KArg> {
    let p = KArg::Ptr;
    vec![
        p(labels),
        p(weights),
        p(w_s),
        p(wsum),
        KArg::I64(rows as i64),
        KArg::I64(c as i64),
        KArg::I64(ignore.unwrap_or(0)),
        KArg::I32(ignore.is_some() as i32),
        p(err),
    ]
}

/// `lce_rows_T(T* g, const T* bias, labels, const A* w_s, const A* wsum, A* loss_s, i64 R,
/// i64 C, i64 ldx, i32 mean)`, the rows contiguous (ldx = C)
#[allow(clippy::too_many_arguments)]
fn rows_args(g: u64, bias: u64, labels: u64, w_s: u64, wsum: u64, loss_s: u64, r: usize, c: usize, mean: bool) -> Vec<KArg> {
    let p = KArg::Ptr;
    let i = |v: usize| KArg::I64(v as i64);
    vec![p(g), p(bias), p(labels), p(w_s), p(wsum), p(loss_s), i(r), i(c), i(c), KArg::I32(mean as i32)]
}

/// `lce_rows_v16_D(D* g, labels, const f32* w_s, const f32* wsum, f32* loss_s, i64 R, i64 C,
/// i64 ldx, i32 mean)`
#[allow(clippy::too_many_arguments)]
fn v16_args(g: u64, labels: u64, w_s: u64, wsum: u64, loss_s: u64, r: usize, c: usize, ldx: usize, mean: bool) -> Vec<KArg> {
    let p = KArg::Ptr;
    let i = |v: usize| KArg::I64(v as i64);
    vec![p(g), p(labels), p(w_s), p(wsum), p(loss_s), i(r), i(c), i(ldx), KArg::I32(mean as i32)]
}

/// The kernels whose argument lists are checked here (for loss.rs's coverage of loss.cu).
pub fn checked_kernels() -> Vec<String> {
    let mut checked = Vec::new();
    for t in FLOATS {
        check(&format!("lce_weights_{t}"), &weights_args(1, 0, 1, 1, 10, 5, Some(-100), 1));
        check(&format!("lce_rows_{t}"), &rows_args(1, 0, 1, 1, 1, 1, 10, 5, true));
        checked.extend(["lce_weights", "lce_rows"].map(|op| format!("{op}_{t}")));
    }
    for d in HALVES {
        check(&format!("lce_rows_v16_{d}"), &v16_args(1, 1, 1, 1, 1, 10, 5, 8, true));
        checked.push(format!("lce_rows_v16_{d}"));
    }
    checked
}

#[test]
fn lce_argument_lists_match_the_registry() {
    assert_eq!(checked_kernels().len(), 2 * FLOATS.len() + HALVES.len());
}

/// Row weights of `labels` as the kernels define them: 0 for ignore_index and invalid labels.
fn row_weights(labels: &[i64], class_w: Option<&[f64]>, c: usize, ignore: Option<i64>) -> Vec<f64> {
    labels.iter().map(|&y| if ignore == Some(y) || y < 0 || y >= c as i64 { 0.0 } else { class_w.map_or(1.0, |w| w[y as usize]) }).collect()
}

#[test]
fn gpu_lce_kernels_match_the_definition() {
    let Some(g) = gpu("gpu_lce_kernels_match_the_definition") else { return };
    let mut rng = Rng::new(71);
    let (rows, c, r0, r) = (300, 1000, 120, 150);
    // every 7th row ignored, rows 5 and 9 invalid (C and -3: counted as ignored, flag set)
    let labels: Vec<i64> = (0..rows)
        .map(|i| match i {
            5 => c as i64,
            9 => -3,
            _ if i % 7 == 0 => -100,
            _ => rng.int(0, c as i64),
        })
        .collect();
    for t in ["f32", "f64"] {
        let a = acc_of(t);
        for (mean, class_weights, bias) in [(true, true, true), (false, false, false)] {
            let what = |k: &str| format!("{k}_{t} (mean {mean}, class weights {class_weights}, bias {bias})");
            let cw = class_weights.then(|| rand_as(&mut rng, t, c, 0.2, 2.0));
            let b = bias.then(|| rand_as(&mut rng, t, c, -1.0, 1.0));
            let x = rand_as(&mut rng, t, r * c, -6.0, 6.0);
            let (dl, dcw) = (dev(g, &labels), cw.as_ref().map(|w| dev_as(g, t, w)));
            let (w_s, wsum, err) = (zeros_as(g, a, rows), zeros_as(g, a, 1), zeros::<i32>(g, 1));
            let cwp = dcw.as_ref().map_or(0, |d| d.ptr());
            let k = format!("lce_weights_{t}");
            run(g, &k, Grid::new(1, 1024), &weights_args(dl.ptr(), cwp, w_s.ptr(), wsum.ptr(), rows, c, Some(-100), err.ptr()));
            let want_w = row_weights(&labels, cw.as_deref(), c, Some(-100));
            assert_eq!(host::<i32>(&err)[0], 1, "{}: the error flag", what("lce_weights"));
            assert_close(&what("lce_weights: w_s"), &host_as(&w_s, a), &rounded(a, &want_w), 0.0, 0.0);
            let total: f64 = want_w.iter().sum();
            assert_close(&what("lce_weights: wsum"), &host_as(&wsum, a), &[total], rtol(a), 0.0);

            // the chunk: rows r0..r0 + r of the logits
            let (dx, db, loss_s) = (dev_as(g, t, &x), b.as_ref().map(|v| dev_as(g, t, v)), zeros_as(g, a, rows));
            let (es, st) = (float_size(a) as u64, 8u64);
            let k = format!("lce_rows_{t}");
            let args = rows_args(
                dx.ptr(),
                db.as_ref().map_or(0, |d| d.ptr()),
                dl.ptr() + r0 as u64 * st,
                w_s.ptr() + r0 as u64 * es,
                wsum.ptr(),
                loss_s.ptr() + r0 as u64 * es,
                r,
                c,
                mean,
            );
            run(g, &k, Grid::new(r as u32, 1024), &args);
            let f = if mean { 1.0 / total } else { 1.0 };
            let (mut want_g, mut want_l) = (vec![0.0; r * c], vec![0.0; rows]);
            for i in 0..r {
                let w = want_w[r0 + i];
                if w == 0.0 {
                    continue;
                }
                let z: Vec<f64> = (0..c).map(|j| x[i * c + j] + b.as_ref().map_or(0.0, |b| b[j])).collect();
                let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let lse = m + z.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
                let y = labels[r0 + i] as usize;
                want_l[r0 + i] = -w * (z[y] - lse);
                for j in 0..c {
                    want_g[i * c + j] = w * f * ((z[j] - lse).exp() - if j == y { 1.0 } else { 0.0 });
                }
            }
            assert_close_scaled(&what("lce_rows: gradient"), &host_as(&dx, t), &want_g, rtol(t));
            assert_close_scaled(&what("lce_rows: loss terms"), &host_as(&loss_s, a), &want_l, rtol(a));
        }
    }
}

/// `lce_rows_v16_{bf16,f16}` is `lce_rows_{bf16,f16}` (the row pass in place over 16-bit
/// logits) with 16-byte loads and stores: on a chunk starting inside the rows (offset labels,
/// weights and loss terms), with ignored and invalid rows, for the mean and the sum, 1003
/// classes (three past the last whole vector, one label among them) in rows of 1008, the same G
/// within one 16-bit rounding and the same loss terms within f32 rounding (the two sum a row in
/// different orders), and the columns past C untouched.
#[test]
fn gpu_lce_rows_v16_is_the_row_pass_in_place() {
    let Some(g) = gpu("gpu_lce_rows_v16_is_the_row_pass_in_place") else { return };
    let mut rng = Rng::new(73);
    let (rows, c, ld, r0, r) = (300, 1003, 1008, 120, 150);
    let labels: Vec<i64> = (0..rows)
        .map(|i| match i {
            130 => c as i64,
            131 => c as i64 - 1,
            _ if i % 7 == 0 => -100,
            _ => rng.int(0, c as i64),
        })
        .collect();
    let dl = dev(g, &labels);
    let (w_s, wsum, err) = (zeros_as(g, "f32", rows), zeros_as(g, "f32", 1), zeros::<i32>(g, 1));
    run(g, "lce_weights_f32", Grid::new(1, 1024), &weights_args(dl.ptr(), 0, w_s.ptr(), wsum.ptr(), rows, c, Some(-100), err.ptr()));
    let at = |b: &crate::backend::cuda::launch::DeviceBuffer, row: usize, es: u64| b.ptr() + row as u64 * es;
    for d in HALVES {
        // the logits in rows of `ld`, the padding a NaN pattern that must stay
        let logits: Vec<f64> = (0..r * ld).map(|i| if i % ld < c { rng.f32(-6.0, 6.0) as f64 } else { f64::NAN }).collect();
        for mean in [true, false] {
            let what = format!("lce_rows_v16_{d} (mean {mean})");
            let (scalar, scalar_loss) = (dev_as(g, d, &logits), zeros_as(g, "f32", rows));
            let i = |v: usize| KArg::I64(v as i64);
            let p = KArg::Ptr;
            let args = [
                p(scalar.ptr()),
                p(0),
                p(at(&dl, r0, 8)),
                p(at(&w_s, r0, 4)),
                p(wsum.ptr()),
                p(at(&scalar_loss, r0, 4)),
                i(r),
                i(c),
                i(ld),
                KArg::I32(mean as i32),
            ];
            run(g, &format!("lce_rows_{d}"), Grid::new(r as u32, 1024), &args);
            let (vector, vector_loss) = (dev_as(g, d, &logits), zeros_as(g, "f32", rows));
            let args = v16_args(vector.ptr(), at(&dl, r0, 8), at(&w_s, r0, 4), wsum.ptr(), at(&vector_loss, r0, 4), r, c, ld, mean);
            run(g, &format!("lce_rows_v16_{d}"), Grid::new(r as u32, 1024), &args);
            let (want, got) = (host_as(&scalar, d), host_as(&vector, d));
            // one ulp of b: at most 2^-7 of it in bf16, 2^-10 in f16 (and f16's subnormal step)
            let ulp = if *d == "bf16" { 2f64.powi(-7) } else { 2f64.powi(-10) };
            for (k, (a, b)) in got.iter().zip(&want).enumerate() {
                if k % ld >= c {
                    assert!(a.is_nan(), "{what}: column {} of row {} (past C) written", k % ld, k / ld);
                } else {
                    assert!(
                        (a - b).abs() <= (ulp * b.abs()).max(2f64.powi(-24)),
                        "{what}: G[{}][{}] = {a}, the scalar pass {b}",
                        k / ld,
                        k % ld
                    );
                }
            }
            assert_close(&format!("{what}: loss terms"), &host_as(&vector_loss, "f32"), &host_as(&scalar_loss, "f32"), 1e-6, 0.0);
            assert!(host_as(&vector_loss, "f32").iter().any(|&l| l != 0.0), "{what}: some loss terms");
            assert!(got.iter().enumerate().any(|(k, &x)| k % ld < c && x != 0.0), "{what}: G computed");
        }
    }
}
