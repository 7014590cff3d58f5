//! CPU kernels of ops/random_draws.rs (RandomUniform(Like), RandomNormal(Like), Bernoulli),
//! drawing from the same counter-based stream as Dropout (random.rs): one fresh key per call,
//! element bits a hash of (key, index), so chunks run in parallel and give the same numbers.
//! Outputs are computed in f32 or f64 (16-bit outputs are rounded from f32 by widen.rs).
//!
//! - uniform: low + (high - low)·u, u from 24 bits (f32) or 53 bits of two draws (f64);
//! - normal: Box-Muller over pairs of elements (2m, 2m + 1), in f64;
//! - Bernoulli: 1 where a 24-bit u < p, else 0 (p = 1 always gives 1, p = 0 never).

use rayon::prelude::*;

use super::random::for_each_bits;
use super::tensor_view::{In, Out};
use super::{CpuCtx, KernelTable, PAR_MIN};
use crate::error::Result;
use crate::ir::Node;
use crate::ops::random_draws::{law, seed_mix, Law, DRAW_OPS};
use crate::tensor::DType;

/// Elements per parallel task (even: normal pairs never straddle two tasks).
const CHUNK: usize = 1 << 14;

const U24: f64 = 1.0 / (1u64 << 24) as f64;
const U53: f64 = 1.0 / (1u64 << 53) as f64;

/// A draw's element type on the CPU: f32 or f64.
trait Drawn: Copy + Send + Sync {
    /// 53-bit uniforms for this type (two draws per element), else 24-bit ones.
    const WIDE: bool;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
}
impl Drawn for f32 {
    const WIDE: bool = false;
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}
impl Drawn for f64 {
    const WIDE: bool = true;
    fn from_f64(v: f64) -> Self {
        v
    }
    fn to_f64(self) -> f64 {
        self
    }
}

/// Fills `y` (elements `start..` of the stream `key`) from `law`; `p`: Bernoulli's
/// probabilities for these elements.
fn fill<T: Drawn>(y: &mut [T], p: &[T], start: u64, key: u64, law: Law) {
    let n = y.len();
    match law {
        Law::Uniform { low, high } if T::WIDE => {
            let mut hi = 0u32;
            for_each_bits(2 * n, 2 * start, key, |k, b| {
                if k % 2 == 0 {
                    hi = b;
                } else {
                    let u = (((hi as u64) << 21) | (b >> 11) as u64) as f64 * U53;
                    y[k / 2] = T::from_f64(low + (high - low) * u);
                }
            });
        }
        Law::Uniform { low, high } => for_each_bits(n, start, key, |k, b| y[k] = T::from_f64(low + (high - low) * ((b >> 8) as f64 * U24))),
        Law::Normal { mean, scale } => {
            let mut u1 = 0.0;
            for_each_bits(n + n % 2, start, key, |k, b| {
                if k % 2 == 0 {
                    u1 = ((b >> 8) as f64 + 1.0) * U24; // (0, 1]: ln is finite
                } else {
                    let (r, theta) = ((-2.0 * u1.ln()).sqrt(), std::f64::consts::TAU * (b >> 8) as f64 * U24);
                    y[k - 1] = T::from_f64(mean + scale * r * theta.cos());
                    if k < n {
                        y[k] = T::from_f64(mean + scale * r * theta.sin());
                    }
                }
            });
        }
        Law::Bernoulli => {
            for_each_bits(n, start, key, |k, b| y[k] = T::from_f64(if ((b >> 8) as f64 * U24) < p[k].to_f64() { 1.0 } else { 0.0 }))
        }
    }
}

fn draw_typed<T: Drawn>(y: &mut [T], p: &[T], key: u64, law: Law) {
    let task = |(c, y): (usize, &mut [T])| {
        let at = c * CHUNK;
        let p = if p.is_empty() { p } else { &p[at..at + y.len()] };
        fill(y, p, at as u64, key, law);
    };
    if y.len() >= PAR_MIN {
        y.par_chunks_mut(CHUNK).enumerate().for_each(task);
    } else {
        y.chunks_mut(CHUNK).enumerate().for_each(task);
    }
}

fn draw(node: &Node, inputs: &[Option<In>], out: &mut [Out], ctx: &mut CpuCtx) -> Result<()> {
    let law = law(node)?;
    let key = ctx.rng.next_key() ^ seed_mix(node)?;
    let p = match law {
        Law::Bernoulli => Some(inputs.first().and_then(|x| x.as_ref()).ok_or_else(|| node.err("the probabilities (input 0) are missing"))?),
        _ => None,
    };
    let o = &mut out[0];
    if let Some(p) = p {
        if p.dtype != o.dtype || p.shape != o.shape {
            return Err(node.err(format!("Bernoulli of {} probabilities into {}: the types must match", p.dtype.name(), o.dtype.name())));
        }
    }
    match o.dtype {
        DType::F32 => draw_typed::<f32>(o.slice::<f32>()?, p.map(|p| p.slice::<f32>()).transpose()?.unwrap_or(&[]), key, law),
        DType::F64 => draw_typed::<f64>(o.slice::<f64>()?, p.map(|p| p.slice::<f64>()).transpose()?.unwrap_or(&[]), key, law),
        d => return Err(node.err(format!("element type {} is not supported by this kernel", d.name()))),
    }
    Ok(())
}

pub fn register(t: &mut KernelTable) {
    for op in DRAW_OPS {
        t.add(op, draw);
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::cpu::testutil::run;
    use crate::ir::{Attr, Attrs};
    use crate::tensor::{DType, Data, Tensor};

    /// `v` as a tensor of `dtype` (a float type).
    fn floats(dtype: DType, v: &[f64]) -> Tensor {
        let data = match dtype {
            DType::F32 => Data::F32(v.iter().map(|&x| x as f32).collect()),
            DType::F64 => Data::F64(v.to_vec()),
            DType::BF16 => Data::BF16(v.iter().map(|&x| half::bf16::from_f64(x)).collect()),
            _ => Data::F16(v.iter().map(|&x| half::f16::from_f64(x)).collect()),
        };
        Tensor::new(vec![v.len()], data).unwrap()
    }

    fn moments(v: &[f64]) -> (f64, f64) {
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        (mean, v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / v.len() as f64)
    }

    fn like(dtype: DType, n: usize) -> Tensor {
        floats(dtype, &vec![0.0; n])
    }

    #[test]
    fn uniform_draws_cover_low_to_high_with_the_uniform_moments() {
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let attrs = Attrs::default().with("low", Attr::Float(-2.0)).with("high", Attr::Float(3.0));
            let y = run("RandomUniformLike", attrs, &[&like(dtype, 100_001)]).remove(0);
            assert_eq!(y.dtype(), dtype);
            let v = y.to_f64_vec();
            assert!(v.iter().all(|&x| (-2.0..=3.0).contains(&x)), "{dtype:?}: a draw outside [-2, 3]");
            let (mean, var) = moments(&v);
            assert!((mean - 0.5).abs() < 0.03 && (var - 25.0 / 12.0).abs() < 0.05, "{dtype:?}: mean {mean}, variance {var}");
            // 53-bit f64 draws: far more distinct values than a 24-bit grid over 100k draws gives
            if dtype == DType::F64 {
                assert!(v.iter().any(|x| ((x + 2.0) / 5.0 * (1u64 << 24) as f64).fract() != 0.0), "f64 draws on a 24-bit grid");
            }
        }
    }

    #[test]
    fn normal_draws_have_the_mean_and_scale_asked_for() {
        for (dtype, n) in [(DType::F32, 100_001), (DType::F64, 100_000), (DType::BF16, 40_001)] {
            let attrs = Attrs::default().with("mean", Attr::Float(1.5)).with("scale", Attr::Float(2.0));
            let v = run("RandomNormalLike", attrs, &[&like(dtype, n)]).remove(0).to_f64_vec();
            assert!(v.iter().all(|x| x.is_finite()));
            let (mean, var) = moments(&v);
            assert!((mean - 1.5).abs() < 0.04 && (var.sqrt() - 2.0).abs() < 0.04, "{dtype:?}: mean {mean}, sd {}", var.sqrt());
            let tail = v.iter().filter(|&&x| (x - 1.5).abs() > 2.0 * 1.96).count() as f64 / n as f64;
            assert!((tail - 0.05).abs() < 0.005, "{dtype:?}: {tail} of the draws beyond 1.96 sd, not about 0.05");
        }
        let shaped = Attrs::default().with("shape", Attr::Ints(vec![3, 7])).with("dtype", Attr::Int(11));
        let y = run("RandomNormal", shaped, &[]).remove(0);
        assert_eq!((y.dtype(), y.shape.clone()), (DType::F64, vec![3, 7]));
    }

    #[test]
    fn bernoulli_draws_ones_at_each_elements_probability() {
        let n = 60_000;
        let p: Vec<f64> = (0..n).map(|i| [0.0, 0.2, 0.9, 1.0][i % 4]).collect();
        for dtype in [DType::F32, DType::F64, DType::F16] {
            let y = run("Bernoulli", Attrs::default(), &[&floats(dtype, &p)]).remove(0);
            assert_eq!(y.dtype(), dtype);
            let v = y.to_f64_vec();
            assert!(v.iter().all(|&x| x == 0.0 || x == 1.0));
            for (j, want) in [0.0, 0.2, 0.9, 1.0].into_iter().enumerate() {
                let ones = v.iter().skip(j).step_by(4).sum::<f64>() / (n / 4) as f64;
                assert!((ones - want).abs() < 0.015, "{dtype:?} p {want}: {ones} ones");
            }
        }
    }

    #[test]
    fn each_call_draws_afresh() {
        let a = run("RandomUniformLike", Attrs::default(), &[&like(DType::F32, 64)]).remove(0).to_f64_vec();
        let b = run("RandomUniformLike", Attrs::default().with("seed", Attr::Float(3.0)), &[&like(DType::F32, 64)]).remove(0).to_f64_vec();
        assert_ne!(a, b, "a seed attribute changes the stream");
    }
}
