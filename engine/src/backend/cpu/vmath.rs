//! Vectorised f32 primitives: tanh and the logistic sigmoid (`tanh_slice`, `sigmoid_slice`, for
//! the Tanh and Sigmoid ops), `exp_poly` (softmax.rs's rows), and rows of softmax-style kernels: log-Σ-exp in one pass (online
//! max) and the scaled softmax row of the cross-entropy gradient, and the same for blocks stored
//! column by column (the fp32 LM head's tiles): each row's shifted exps and sum, the scaled
//! gradient with its column sums. `exp` is a branch-free polynomial (Cody–Waite range reduction, degree-6 Taylor on |r| ≤ ln2/2, relative error ≈ 2e-7) written so that LLVM vectorises it;
//! each primitive is compiled for AVX-512 and AVX2+FMA and picked at run time from CPU features
//! (the libm exp it replaces is scalar: ~20 M calls per LM-head step).

use crate::simd::multiversion;
#[cfg(test)]
use crate::simd::{level, Level};

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;

/// 1.5·2²³: adding it to a float of magnitude < 2²² rounds it to an integer held in the low
/// mantissa bits, so rounding and the float→int conversion need no conversion instruction.
const MAGIC: f32 = 12_582_912.0;

/// a·b + c: one fused multiply-add on the paths compiled with FMA (`FMA`), else two roundings
/// (the baseline path would call libm's software fmaf).
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// e^x; with FMA the range reduction and the Horner steps are fused multiply-adds (0.62 vs 0.87
/// ns per element of the softmax row pass on Zen 3, and no less accurate).
#[inline(always)]
pub(super) fn exp_poly<const FMA: bool>(x: f32) -> f32 {
    // comparisons keep this a plain select that vectorises (a NaN stays NaN either way)
    #[allow(clippy::manual_clamp)]
    let x = if x < -87.0 {
        -87.0
    } else if x > 88.0 {
        88.0
    } else {
        x
    };
    let t = madd::<FMA>(x, LOG2E, MAGIC);
    let n = t - MAGIC;
    let r = madd::<FMA>(-n, LN2_LO, madd::<FMA>(-n, LN2_HI, x));
    let p = 1.0 / 720.0;
    let p = madd::<FMA>(p, r, 1.0 / 120.0);
    let p = madd::<FMA>(p, r, 1.0 / 24.0);
    let p = madd::<FMA>(p, r, 1.0 / 6.0);
    let p = madd::<FMA>(p, r, 0.5);
    let p = madd::<FMA>(p, r, 1.0);
    let p = madd::<FMA>(p, r, 1.0);
    let e = t.to_bits().wrapping_sub(MAGIC.to_bits()).wrapping_add(127) << 23;
    p * f32::from_bits(e)
}

/// tanh: the odd Taylor polynomial through x¹⁵ for |x| < 0.55, else sign(x)·(1 − 2/(e^{2|x|} + 1))
/// with `exp_poly`; ±1 from |x| ≈ 9 on, NaN stays NaN. At most 1.7 ULP from the exact value on
/// [−10, 10] (checked against f64; libm's f32 tanh: 1.4), branch-free so that LLVM vectorises it.
#[inline(always)]
fn tanh_poly<const FMA: bool>(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let p = -929_569.0 / 638_512_875.0;
    let p = p * z + 21_844.0 / 6_081_075.0;
    let p = p * z - 1_382.0 / 155_925.0;
    let p = p * z + 62.0 / 2_835.0;
    let p = p * z - 17.0 / 315.0;
    let p = p * z + 2.0 / 15.0;
    let p = p * z - 1.0 / 3.0;
    // on |x|, then x's sign bit (tanh is odd; keeps −0 and the sign of tiny values)
    let small = a + a * z * p;
    let big = 1.0 - 2.0 / (exp_poly::<FMA>(2.0 * a) + 1.0);
    let r = if a < 0.55 { small } else { big };
    f32::from_bits(r.to_bits() | (x.to_bits() & 0x8000_0000))
}

/// out[k] = tanh(x[k])
#[inline(always)]
fn tanh_body<const FMA: bool>(out: &mut [f32], x: &[f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = tanh_poly::<FMA>(v);
    }
}

/// out[k] = 1 / (1 + e^(−x[k])), within 3 ULP of the exact value; below x = −88 `exp_poly`'s
/// clamp gives 6·10⁻³⁹ where the exact value is a denormal or 0. NaN stays NaN.
#[inline(always)]
fn sigmoid_body<const FMA: bool>(out: &mut [f32], x: &[f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = 1.0 / (1.0 + exp_poly::<FMA>(-v));
    }
}

/// f32 lanes of the row primitives' partial sums and maxima (one AVX-512 vector).
pub(super) const LANES: usize = 16;

/// One LANES-wide step of `lse_body`: each lane's running max and rescaled sum, and the NaN
/// poison (v · 0 is NaN for a NaN or an infinity).
#[inline(always)]
fn lse_lanes<const FMA: bool>(m: &mut [f32; LANES], s: &mut [f32; LANES], poison: &mut [f32; LANES], c: impl Iterator<Item = f32>) {
    for (((mi, si), p), v) in m.iter_mut().zip(s.iter_mut()).zip(poison.iter_mut()).zip(c) {
        let hi = mi.max(v);
        *si = *si * exp_poly::<FMA>(*mi - hi) + exp_poly::<FMA>(v - hi);
        *mi = hi;
        *p += v * 0.0;
    }
}

/// log Σ exp(x) in one pass (online: each lane keeps a running max and a sum rescaled to it).
#[inline(always)]
fn lse_body<const FMA: bool>(x: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut s = [0f32; LANES];
    let mut poison = [0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        lse_lanes::<FMA>(&mut m, &mut s, &mut poison, c.iter().copied());
    }
    let mut top = m.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut bad = poison.iter().sum::<f32>();
    for &v in tail.iter() {
        top = top.max(v);
        bad += v * 0.0;
    }
    if bad.is_nan() || top == f32::NEG_INFINITY {
        return if bad.is_nan() { f32::NAN } else { top };
    }
    let mut total = 0f32;
    for (mi, si) in m.iter().zip(&s) {
        if *mi > f32::NEG_INFINITY {
            total += si * exp_poly::<FMA>(mi - top);
        }
    }
    total += tail.iter().map(|&v| exp_poly::<FMA>(v - top)).sum::<f32>();
    top + total.ln()
}

/// out[k] = g · exp(x[k] − lse)
#[inline(always)]
fn scaled_softmax_body<const FMA: bool>(out: &mut [f32], x: &[f32], lse: f32, g: f32) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = g * exp_poly::<FMA>(v - lse);
    }
}

/// Columns whose exps `cols_exp_shifted_inplace` sums in f32 before adding them to a row's f64
/// sum: at most 7 roundings of an 8-term sum of positive terms (~4·10⁻⁷ relative), below the
/// f32 rounding of the stored sum's own ulp budget in the log-sum-exp.
const EXP_SUM_GROUP: usize = 8;

/// A block of rows × columns stored column by column (`x[c·rows + i]`: the logits of one
/// vocabulary tile, rows contiguous, as the LM head's tiled gemm writes them): per row i,
/// x[·, i] = exp(x[·, i] + bias − m[i]) in place, m[i] the row's largest x + bias (bias: empty
/// for none, else one per column), s[i] the sum of its stored values, accumulated in f64 (`acc`,
/// one per row) over f32 sums of `EXP_SUM_GROUP` columns: a row's sum runs along its columns one
/// term at a time, which all in f32 lost up to 4 times the accuracy of the 16-lane row sums it
/// replaced. The loops run along the rows, so each step is one vector of rows. A NaN or an
/// infinity in a row gives m[i] = s[i] = NaN (as `row_lse` gives NaN) and leaves that row's
/// values not to be used; rows of an empty block get (−∞, 0).
#[inline(always)]
fn cols_exp_shifted_inplace_body<const FMA: bool>(x: &mut [f32], bias: &[f32], m: &mut [f32], s: &mut [f32], acc: &mut [f64]) {
    let rows = m.len();
    m.fill(f32::NEG_INFINITY);
    s.fill(0.0);
    if rows == 0 || x.len() < rows {
        return;
    }
    let acc = &mut acc[..rows];
    // s holds each row's poison until the exp sweep: v·0 is NaN for an infinity or a NaN
    for (c, col) in x.chunks_exact_mut(rows).enumerate() {
        if let Some(&b) = bias.get(c) {
            col.iter_mut().for_each(|v| *v += b);
        }
        for ((&v, mi), pi) in col.iter().zip(m.iter_mut()).zip(s.iter_mut()) {
            *mi = if v > *mi { v } else { *mi };
            *pi += v * 0.0;
        }
    }
    for (mi, &si) in m.iter_mut().zip(s.iter()) {
        if si.is_nan() {
            *mi = f32::NAN;
        }
    }
    acc.fill(0.0);
    // a NaN row's exps, hence its sum, are NaN. Per group of columns the exps are summed in f32
    // (s, free once the poison is read), then added to the f64 sums: with f64 terms in the loop
    // LLVM vectorised it 8 rows wide (ymm) and read and wrote acc for every element.
    for group in x.chunks_mut(rows * EXP_SUM_GROUP) {
        s.fill(0.0);
        for col in group.chunks_exact_mut(rows) {
            for ((v, &mi), si) in col.iter_mut().zip(m.iter()).zip(s.iter_mut()) {
                let e = exp_poly::<FMA>(*v - mi);
                *v = e;
                *si += e;
            }
        }
        acc.iter_mut().zip(s.iter()).for_each(|(a, &si)| *a += si as f64);
    }
    s.iter_mut().zip(acc.iter()).for_each(|(si, &a)| *si = a as f32);
}

/// For a block stored column by column as above: out[c·rows + i] = f[i] · e[c·rows + i], and
/// sums[c] += the column's Σ of out (the gradient's column sums: the LM head's db).
#[inline(always)]
fn cols_scale_and_sum_body<const FMA: bool>(out: &mut [f32], e: &[f32], f: &[f32], sums: &mut [f32]) {
    let rows = f.len();
    if rows == 0 {
        return;
    }
    for ((oc, ec), sc) in out.chunks_exact_mut(rows).zip(e.chunks_exact(rows)).zip(sums.iter_mut()) {
        let mut acc = [0f32; LANES];
        let mut blocks = oc.chunks_exact_mut(LANES).zip(ec.chunks_exact(LANES)).zip(f.chunks_exact(LANES));
        for ((o, e), f) in &mut blocks {
            for (((o, &e), &f), a) in o.iter_mut().zip(e).zip(f).zip(acc.iter_mut()) {
                *o = f * e;
                *a += *o;
            }
        }
        let done = rows - rows % LANES;
        let mut tail = 0f32;
        for ((o, &e), &f) in oc[done..].iter_mut().zip(&ec[done..]).zip(&f[done..]) {
            *o = f * e;
            tail += *o;
        }
        *sc += acc.iter().sum::<f32>() + tail;
    }
}

multiversion!(tanh_slice, tanh_body, (out: &mut [f32], x: &[f32]) -> ());
multiversion!(sigmoid_slice, sigmoid_body, (out: &mut [f32], x: &[f32]) -> ());

multiversion!(row_lse_online, lse_body, (x: &[f32]) -> f32);
multiversion!(row_scaled_softmax, scaled_softmax_body, (out: &mut [f32], x: &[f32], lse: f32, g: f32) -> ());
multiversion!(cols_exp_shifted_inplace, cols_exp_shifted_inplace_body, (x: &mut [f32], bias: &[f32], m: &mut [f32], s: &mut [f32], acc: &mut [f64]) -> ());
multiversion!(cols_scale_and_sum, cols_scale_and_sum_body, (out: &mut [f32], e: &[f32], f: &[f32], sums: &mut [f32]) -> ());

/// Log-sum-exp of a row (NaN if the row holds a NaN or an infinity).
pub fn row_lse(x: &[f32]) -> f32 {
    row_lse_online::call(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_libm() {
        for fma in [false, true] {
            let mut worst = 0f64;
            let mut x = -80.0f32;
            while x < 80.0 {
                let want = (x as f64).exp();
                let got = if fma { exp_poly::<true>(x) } else { exp_poly::<false>(x) } as f64;
                worst = worst.max(((got - want) / want).abs());
                x += 0.013;
            }
            assert!(worst < 5e-7, "fma {fma}: worst relative error {worst:e}");
        }
    }

    #[test]
    fn lse_matches_f64_and_handles_tails() {
        for n in [1usize, 5, 16, 17, 100, 28782] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 / 37.0 - 10.0).collect();
            let m = x.iter().cloned().fold(f64::NEG_INFINITY, |a, b| a.max(b as f64));
            let want = m + x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
            let got = row_lse(&x) as f64;
            assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "n={n}: {got} vs {want}");
        }
        assert!(row_lse(&[1.0, f32::NAN, 2.0]).is_nan());
    }

    #[test]
    fn tanh_is_within_two_ulp_of_the_exact_value() {
        let x: Vec<f32> = (-200_000..=200_000).map(|i| i as f32 * 5e-5).chain([-30.0, 9.5, 88.5, 1e30, -0.0, 1e-30]).collect();
        let mut got = vec![0f32; x.len()];
        tanh_slice::call(&mut got, &x);
        for (&v, &g) in x.iter().zip(&got) {
            let exact = (v as f64).tanh();
            let ulp = ((exact as f32).abs().max(f32::MIN_POSITIVE) as f64) * f32::EPSILON as f64;
            assert!(((g as f64) - exact).abs() <= 2.0 * ulp, "tanh({v}) = {g}, exact {exact}");
            assert_eq!(g.is_sign_negative(), v.is_sign_negative(), "sign of tanh({v})");
        }
        let mut nan = [0f32; 3];
        tanh_slice::call(&mut nan, &[f32::NAN, f32::INFINITY, f32::NEG_INFINITY]);
        assert!(nan[0].is_nan() && nan[1] == 1.0 && nan[2] == -1.0);
    }

    #[test]
    fn sigmoid_is_within_three_ulp_of_the_exact_value() {
        let x: Vec<f32> = (-170_000..=200_000).map(|i| i as f32 * 5e-4).chain([-0.0, 1e-30, 1e30]).collect();
        let mut got = vec![0f32; x.len()];
        sigmoid_slice::call(&mut got, &x);
        for (&v, &g) in x.iter().zip(&got) {
            let exact = 1.0 / (1.0 + (-(v as f64)).exp());
            let ulp = ((exact as f32).max(f32::MIN_POSITIVE) as f64) * f32::EPSILON as f64;
            assert!(((g as f64) - exact).abs() <= 3.0 * ulp, "sigmoid({v}) = {g}, exact {exact}");
        }
        let mut ends = [0f32; 4];
        sigmoid_slice::call(&mut ends, &[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -1e30]);
        assert!(ends[0].is_nan() && ends[1] == 1.0 && ends[2] < 1e-38 && ends[3] < 1e-38);
    }

    /// A block stored column by column, as the LM head's tiles are: per row, the shifted exps
    /// are its softmax times the sum, m + ln(sum) its log-sum-exp, with and without a bias.
    #[test]
    fn column_block_exp_gives_each_rows_softmax_and_log_sum_exp() {
        for (rows, cols) in [(1usize, 1usize), (5, 3), (16, 40), (17, 33), (234, 512), (3, 28782)] {
            let row = |i: usize| -> Vec<f32> { (0..cols).map(|c| (((i * 31 + c) * 7919) % 1000) as f32 / 37.0 - 10.0).collect() };
            let bias: Vec<f32> = (0..cols).map(|c| (c % 8) as f32 * 0.25 - 1.0).collect();
            for biased in [false, true] {
                // column c, row i at c·rows + i; with a bias the block holds x − bias (exact)
                let mut block = vec![0f32; rows * cols];
                for i in 0..rows {
                    for (c, v) in row(i).into_iter().enumerate() {
                        block[c * rows + i] = if biased { v - bias[c] } else { v };
                    }
                }
                let (mut m, mut sum, mut acc) = (vec![0f32; rows], vec![0f32; rows], vec![0f64; rows]);
                cols_exp_shifted_inplace::call(&mut block, if biased { &bias } else { &[] }, &mut m, &mut sum, &mut acc);
                for i in 0..rows {
                    let x = row(i);
                    let (lse, mut want) = (row_lse(&x), vec![0f32; cols]);
                    row_scaled_softmax::call(&mut want, &x, lse, 0.25);
                    let got_lse = m[i] + sum[i].ln();
                    assert!((got_lse - lse).abs() <= 2e-6 * lse.abs().max(1.0), "{rows}x{cols} row {i}: lse {got_lse} vs {lse}");
                    for (c, w) in want.iter().enumerate() {
                        let a = block[c * rows + i] * (0.25 / sum[i]);
                        assert!((a - w).abs() <= 4e-6 * w.abs() + 1e-30, "{rows}x{cols} row {i} col {c}: {a} vs {w}");
                    }
                }
            }
        }
        // a NaN or an infinity poisons its row only
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let (rows, cols) = (20usize, 40usize);
            let mut block: Vec<f32> = (0..rows * cols).map(|i| (i % 13) as f32 * 0.1).collect();
            block[21 * rows + 7] = bad;
            let (mut m, mut sum, mut acc) = (vec![0f32; rows], vec![0f32; rows], vec![0f64; rows]);
            cols_exp_shifted_inplace::call(&mut block, &[], &mut m, &mut sum, &mut acc);
            for i in 0..rows {
                assert_eq!(m[i].is_nan() && sum[i].is_nan(), i == 7, "{bad} row {i}: {} {}", m[i], sum[i]);
            }
        }
        let (mut m, mut sum, mut acc) = (vec![1f32; 4], vec![1f32; 4], vec![0f64; 4]);
        cols_exp_shifted_inplace::call(&mut [], &[], &mut m, &mut sum, &mut acc);
        assert!(m.iter().all(|&v| v == f32::NEG_INFINITY) && sum.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn column_block_scale_and_sum_scales_rows_and_sums_columns() {
        for (rows, cols) in [(1usize, 3usize), (16, 5), (37, 9), (234, 40)] {
            let e: Vec<f32> = (0..rows * cols).map(|i| (i % 23) as f32 * 0.125 - 1.0).collect();
            let f: Vec<f32> = (0..rows).map(|i| (i % 5) as f32 * 0.5 + 0.25).collect();
            let (mut out, mut sums) = (vec![0f32; rows * cols], vec![1f32; cols]);
            cols_scale_and_sum::call(&mut out, &e, &f, &mut sums);
            for c in 0..cols {
                let mut want = 0f64;
                for i in 0..rows {
                    assert_eq!(out[c * rows + i], f[i] * e[c * rows + i]);
                    want += out[c * rows + i] as f64;
                }
                assert!((sums[c] as f64 - 1.0 - want).abs() <= 1e-5 * want.abs().max(1.0), "{rows}x{cols} col {c}");
            }
        }
    }
}

#[cfg(test)]
mod bench {
    use super::*;

    /// `cargo test --release -p ortrain-engine vmath_speed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn vmath_speed() {
        let x: Vec<f32> = (0..28782 * 100).map(|i| ((i * 7919) % 1000) as f32 / 37.0 - 10.0).collect();
        let mut out = vec![0f32; x.len()];
        for _ in 0..3 {
            let t = std::time::Instant::now();
            let mut s = 0.0;
            for row in x.chunks(28782) {
                s += row_lse(row);
            }
            let t1 = t.elapsed();
            let t = std::time::Instant::now();
            for (o, row) in out.chunks_mut(28782).zip(x.chunks(28782)) {
                row_scaled_softmax::call(o, row, 3.0, 0.5);
            }
            let t2 = t.elapsed();
            out.copy_from_slice(&x);
            // as the LM head's tiles: blocks of 512 columns × 100 rows, stored column by column
            let (mut m, mut sums, mut acc) = (vec![0f32; 100], vec![0f32; 100], vec![0f64; 100]);
            let t = std::time::Instant::now();
            for block in out.chunks_mut(512 * 100) {
                cols_exp_shifted_inplace::call(block, &[], &mut m[..], &mut sums[..], &mut acc[..]);
                s += sums[0];
            }
            let t3 = t.elapsed();
            let ns = |d: std::time::Duration| d.as_nanos() as f64 / x.len() as f64;
            println!(
                "{:?}: lse {:.2} ns/elem, softmax {:.2} ns/elem, one-exp shifted exp (column blocks) {:.2} ns/elem ({s})",
                level_name(),
                ns(t1),
                ns(t2),
                ns(t3)
            );
        }
    }

    fn level_name() -> &'static str {
        match level() {
            Level::Avx512 => "avx512",
            Level::Avx2 => "avx2",
            Level::Generic => "generic",
        }
    }
}
