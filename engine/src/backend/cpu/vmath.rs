//! Vectorised f32 row primitives for softmax-style kernels: max, Σ exp(x − m), and the softmax
//! cross-entropy gradient row. `exp` is a branch-free polynomial (Cody–Waite range reduction,
//! degree-6 Taylor on |r| ≤ ln2/2, relative error ≈ 2e-7) written so that LLVM vectorises it;
//! each primitive is compiled for AVX-512 and AVX2+FMA and picked at run time from CPU features
//! (the libm exp it replaces is scalar: ~20 M calls per LM-head step).

use std::sync::OnceLock;

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;

#[inline(always)]
fn exp_poly(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

const LANES: usize = 16;

#[inline(always)]
fn max_body(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    let mut m = tail.iter().fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    for a in acc {
        m = if a > m { a } else { m };
    }
    // a NaN anywhere makes the row NaN, as in the scalar kernel
    if x.iter().any(|v| v.is_nan()) {
        f32::NAN
    } else {
        m
    }
}

#[inline(always)]
fn sum_exp_body(x: &[f32], m: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += exp_poly(v - m);
        }
    }
    acc.iter().sum::<f32>() + tail.iter().map(|&v| exp_poly(v - m)).sum::<f32>()
}

/// out[k] = g · exp(x[k] − lse)
#[inline(always)]
fn scaled_softmax_body(out: &mut [f32], x: &[f32], lse: f32, g: f32) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = g * exp_poly(v - lse);
    }
}

macro_rules! multiversion {
    ($name:ident, $body:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        pub mod $name {
            use super::*;
            #[target_feature(enable = "avx512f")]
            unsafe fn avx512($($arg: $ty),*) -> $ret {
                $body($($arg),*)
            }
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($arg: $ty),*) -> $ret {
                $body($($arg),*)
            }
            fn generic($($arg: $ty),*) -> $ret {
                $body($($arg),*)
            }
            pub fn call($($arg: $ty),*) -> $ret {
                match level() {
                    // SAFETY: level() reported the CPU supports the enabled features.
                    Level::Avx512 => unsafe { avx512($($arg),*) },
                    // SAFETY: as above.
                    Level::Avx2 => unsafe { avx2($($arg),*) },
                    Level::Generic => generic($($arg),*),
                }
            }
        }
    };
}

#[derive(Clone, Copy)]
enum Level {
    Avx512,
    Avx2,
    Generic,
}

fn level() -> Level {
    static L: OnceLock<Level> = OnceLock::new();
    *L.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                return Level::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Level::Avx2;
            }
        }
        Level::Generic
    })
}

multiversion!(row_max, max_body, (x: &[f32]) -> f32);
multiversion!(row_sum_exp, sum_exp_body, (x: &[f32], m: f32) -> f32);
multiversion!(row_scaled_softmax, scaled_softmax_body, (out: &mut [f32], x: &[f32], lse: f32, g: f32) -> ());

/// Log-sum-exp of a row.
pub fn row_lse(x: &[f32]) -> f32 {
    let m = row_max::call(x);
    if !m.is_finite() {
        return m;
    }
    m + row_sum_exp::call(x, m).ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_libm() {
        let mut worst = 0f64;
        let mut x = -80.0f32;
        while x < 80.0 {
            let want = (x as f64).exp();
            let got = exp_poly(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.013;
        }
        assert!(worst < 5e-7, "worst relative error {worst:e}");
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
}
