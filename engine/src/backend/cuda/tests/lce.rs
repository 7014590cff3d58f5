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

/// `lce_rows_round_D(f32* x, D* g, labels, const f32* w_s, const f32* wsum, f32* loss_s, i64 R,
/// i64 C, i64 ldx, i64 ldg, i32 mean)`, x's rows contiguous (ldx = C)
#[allow(clippy::too_many_arguments)]
fn round_args(x: u64, g: u64, labels: u64, w_s: u64, wsum: u64, loss_s: u64, r: usize, c: usize, ldg: usize, mean: bool) -> Vec<KArg> {
    let p = KArg::Ptr;
    let i = |v: usize| KArg::I64(v as i64);
    vec![p(x), p(g), p(labels), p(w_s), p(wsum), p(loss_s), i(r), i(c), i(c), i(ldg), KArg::I32(mean as i32)]
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
        check(&format!("lce_rows_round_{d}"), &round_args(1, 1, 1, 1, 1, 1, 10, 5, 8, true));
        checked.push(format!("lce_rows_round_{d}"));
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

/// `lce_rows_round_{bf16,f16}` is `lce_rows_f32` followed by `cast_rows_f32_{bf16,f16}` in one
/// pass, bit for bit: on a chunk starting inside the rows (offset labels, weights and loss
/// terms), with ignored and invalid rows, for the mean and the sum, 16-bit G in rows of 1008
/// for 1000 classes (the padding zeros over garbage), the same G bytes and loss terms as the
/// two kernels give; the logits are left as they were.
#[test]
fn gpu_lce_rows_round_is_the_row_pass_then_the_rounding() {
    let Some(g) = gpu("gpu_lce_rows_round_is_the_row_pass_then_the_rounding") else { return };
    let mut rng = Rng::new(73);
    let (rows, c, ld, r0, r) = (300, 1000, 1008, 120, 150);
    let labels: Vec<i64> = (0..rows)
        .map(|i| match i {
            130 => c as i64,
            _ if i % 7 == 0 => -100,
            _ => rng.int(0, c as i64),
        })
        .collect();
    let dl = dev(g, &labels);
    let (w_s, wsum, err) = (zeros_as(g, "f32", rows), zeros_as(g, "f32", 1), zeros::<i32>(g, 1));
    run(g, "lce_weights_f32", Grid::new(1, 1024), &weights_args(dl.ptr(), 0, w_s.ptr(), wsum.ptr(), rows, c, Some(-100), err.ptr()));
    let x = rand_as(&mut rng, "f32", r * c, -6.0, 6.0);
    let at = |b: &crate::backend::cuda::launch::DeviceBuffer, row: usize, es: u64| b.ptr() + row as u64 * es;
    for d in HALVES {
        for mean in [true, false] {
            let what = format!("lce_rows_round_{d} (mean {mean})");
            // the two kernels: G over the logits, then rounded into rows of `ld`
            let (two_x, two_loss) = (dev_as(g, "f32", &x), zeros_as(g, "f32", rows));
            let two_g = dev(g, &vec![0x7fffu16; r * ld]);
            let args = rows_args(two_x.ptr(), 0, at(&dl, r0, 8), at(&w_s, r0, 4), wsum.ptr(), at(&two_loss, r0, 4), r, c, mean);
            run(g, "lce_rows_f32", Grid::new(r as u32, 1024), &args);
            let i = |v: usize| KArg::I64(v as i64);
            let cast = [KArg::Ptr(two_x.ptr()), KArg::Ptr(two_g.ptr()), i(r), i(c), i(c), i(ld)];
            run(g, &format!("cast_rows_f32_{d}"), Grid::new(r as u32, 256), &cast);
            // the one: G rounded straight from the logits
            let (one_x, one_loss) = (dev_as(g, "f32", &x), zeros_as(g, "f32", rows));
            let one_g = dev(g, &vec![0x7fffu16; r * ld]);
            let args =
                round_args(one_x.ptr(), one_g.ptr(), at(&dl, r0, 8), at(&w_s, r0, 4), wsum.ptr(), at(&one_loss, r0, 4), r, c, ld, mean);
            run(g, &format!("lce_rows_round_{d}"), Grid::new(r as u32, 1024), &args);
            assert_eq!(host::<u16>(&one_g), host::<u16>(&two_g), "{what}: the 16-bit G");
            assert_eq!(host::<u32>(&one_loss), host::<u32>(&two_loss), "{what}: the loss terms");
            assert_eq!(host_as(&one_x, "f32"), x, "{what}: the logits are read, not written");
            assert!(host::<u32>(&one_loss).iter().any(|&l| l != 0), "{what}: some loss terms");
        }
    }
}
