//! Adam/AdamW over many parameter tensors in one parallel pass: every tensor is cut into chunks
//! and all chunks of all tensors go to the thread pool together (one parallel region per step,
//! not one per tensor). The element loop is compiled for AVX-512 and AVX2 as well as the baseline
//! and picked at run time from CPU features; it is written with torch.optim.Adam's operations as
//! torch's vectorised CPU kernels round them (measured against torch 2.15 on AVX2: its lerp_,
//! addcmul_ and add(alpha=) are fused multiply-adds, its addcdiv_ is self + (value·t1)/t2), so
//! exp_avg and exp_avg_sq are bitwise torch's; the parameter differs where torch's vectorised
//! sqrt is not correctly rounded (~16% of elements, by one ulp of the denominator). `mul_add` is
//! one instruction on every path (the x86 loops are compiled with FMA; the baseline is libm's
//! exact fmaf), so the results are bitwise the same on every path.

use rayon::prelude::*;

use super::{AdamHyper, CHUNK};
use crate::simd::{level, Level};

/// One tensor's update: parameter, gradient, both moments (all of one length), its
/// hyper-parameters (the step number is per tensor), whether its moments are new (their
/// memory may be uninitialised: read as +0.0, only written) and where to keep a copy of the
/// parameter's values before the update (each chunk is copied just before its update, while
/// it is in cache: a copy pass of its own would read the parameters once more).
pub struct AdamTensor<'a> {
    pub p: &'a mut [f32],
    pub g: &'a [f32],
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
    pub h: AdamHyper,
    pub from_zero: bool,
    pub keep: Option<&'a mut [f32]>,
}

/// The per-tensor constants of the element loop (and of kernels/optim.cu's adam): each computed
/// in f64 from the user's hyper-parameters and rounded to f32 once, as torch.optim.Adam's Python
/// floats become its kernels' scalars.
#[derive(Clone, Copy, Debug)]
pub struct AdamScalars {
    pub beta2: f32,
    /// 1 − β₁: exp_avg.lerp_'s weight
    pub w1: f32,
    /// the lerp's coefficient: the weight, or weight − 1 when the weight is 0.5 or more (torch's
    /// lerp then works from the end: grad + (weight − 1)·(grad − exp_avg))
    pub lerp_coef: f32,
    /// The weight is 0.5 or more: lerp from the gradient.
    pub lerp_from_grad: bool,
    /// 1 − β₂ (exp_avg_sq.addcmul_'s value)
    pub w2: f32,
    pub eps: f32,
    /// lr / (1 − β₁ᵗ)
    pub step_size: f32,
    /// √(1 − β₂ᵗ)
    pub bc2_sqrt: f32,
    pub weight_decay: f32,
    /// 1 − lr · weight_decay (AdamW)
    pub decay: f32,
}

impl AdamScalars {
    pub fn of(h: &AdamHyper) -> AdamScalars {
        let bc1 = 1.0 - h.beta1.powi(h.step as i32);
        let bc2 = 1.0 - h.beta2.powi(h.step as i32);
        let weight = (1.0 - h.beta1) as f32;
        let lerp_from_grad = weight.abs() >= 0.5;
        AdamScalars {
            beta2: h.beta2 as f32,
            w1: weight,
            lerp_coef: if lerp_from_grad { weight - 1.0 } else { weight },
            lerp_from_grad,
            w2: (1.0 - h.beta2) as f32,
            eps: h.eps as f32,
            step_size: (h.lr / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            weight_decay: h.weight_decay as f32,
            decay: (1.0 - h.lr * h.weight_decay) as f32,
        }
    }
}

/// Weight decay kinds, as the element loop's const parameter.
const WD_NONE: u8 = 0;
const WD_L2: u8 = 1;
const WD_DECOUPLED: u8 = 2;

/// The element loop, every option a constant so that the compiled loop has no branch.
#[inline(always)]
fn body<const FROM_ZERO: bool, const MAXIMIZE: bool, const WD: u8>(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    c: &AdamScalars,
) {
    let n = p.len().min(g.len()).min(m.len()).min(v.len());
    let (p, g, m, v) = (&mut p[..n], &g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let mut grad = if MAXIMIZE { -g[i] } else { g[i] };
        if WD == WD_DECOUPLED {
            p[i] *= c.decay;
        } else if WD == WD_L2 {
            // grad.add(param, alpha=weight_decay)
            grad = p[i].mul_add(c.weight_decay, grad);
        }
        // IEEE arithmetic on +0.0 is not folded away (0.0 + -0.0 is +0.0), so the from-zero
        // expressions round exactly as the general ones on zeroed memory
        let (m0, v0) = if FROM_ZERO { (0.0f32, 0.0f32) } else { (m[i], v[i]) };
        // exp_avg.lerp_(grad, 1 - beta1)
        let m1 = c.lerp_coef.mul_add(grad - m0, if c.lerp_from_grad { grad } else { m0 });
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        let v1 = (c.w2 * grad).mul_add(grad, v0 * c.beta2);
        m[i] = m1;
        v[i] = v1;
        let denom = v1.sqrt() / c.bc2_sqrt + c.eps;
        // param.addcdiv_(exp_avg, denom, value=-step_size)
        p[i] += (-c.step_size * m1) / denom;
    }
}

type Loop = fn(&mut [f32], &[f32], &mut [f32], &mut [f32], &AdamScalars);

macro_rules! isa_loops {
    ($name:ident, $feat:literal) => {
        /// The element loop compiled with these CPU features (callers check them first).
        mod $name {
            use super::*;
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn run<const Z: bool, const MX: bool, const WD: u8>(
                p: &mut [f32],
                g: &[f32],
                m: &mut [f32],
                v: &mut [f32],
                c: &AdamScalars,
            ) {
                body::<Z, MX, WD>(p, g, m, v, c)
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
isa_loops!(avx512, "avx512f,fma");
#[cfg(target_arch = "x86_64")]
isa_loops!(avx2, "avx2,fma");

/// The element loop for these options on this instruction set.
fn pick<const Z: bool, const MX: bool, const WD: u8>(level: Level) -> Loop {
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: level() found AVX-512F and FMA, which this loop was compiled for.
        Level::Avx512 => |p, g, m, v, c| unsafe { avx512::run::<Z, MX, WD>(p, g, m, v, c) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: level() found AVX2 (and FMA), which this loop was compiled for.
        Level::Avx2 => |p, g, m, v, c| unsafe { avx2::run::<Z, MX, WD>(p, g, m, v, c) },
        _ => body::<Z, MX, WD>,
    }
}

fn pick_wd<const Z: bool, const MX: bool>(level: Level, h: &AdamHyper) -> Loop {
    match (h.weight_decay != 0.0, h.decoupled) {
        (false, _) => pick::<Z, MX, WD_NONE>(level),
        (true, false) => pick::<Z, MX, WD_L2>(level),
        (true, true) => pick::<Z, MX, WD_DECOUPLED>(level),
    }
}

fn loop_for(level: Level, h: &AdamHyper, from_zero: bool) -> Loop {
    match (from_zero, h.maximize) {
        (false, false) => pick_wd::<false, false>(level, h),
        (false, true) => pick_wd::<false, true>(level, h),
        (true, false) => pick_wd::<true, false>(level, h),
        (true, true) => pick_wd::<true, true>(level, h),
    }
}

/// Updates every tensor; all their chunks run in one parallel pass.
pub fn adam_many(tensors: Vec<AdamTensor<'_>>) {
    adam_many_on(level(), tensors)
}

fn adam_many_on(level: Level, tensors: Vec<AdamTensor<'_>>) {
    type Work<'a> = (Loop, AdamScalars, &'a mut [f32], &'a [f32], &'a mut [f32], &'a mut [f32], Option<&'a mut [f32]>);
    let mut work: Vec<Work> = Vec::new();
    for t in tensors {
        let (f, c) = (loop_for(level, &t.h, t.from_zero), AdamScalars::of(&t.h));
        let chunks = t.p.chunks_mut(CHUNK).zip(t.g.chunks(CHUNK)).zip(t.m.chunks_mut(CHUNK)).zip(t.v.chunks_mut(CHUNK));
        let mut keep = t.keep.map(|k| k.chunks_mut(CHUNK));
        work.extend(chunks.map(|(((p, g), m), v)| (f, c, p, g, m, v, keep.as_mut().and_then(|k| k.next()))));
    }
    work.into_par_iter().for_each(|(f, c, p, g, m, v, keep)| {
        if let Some(k) = keep {
            let n = k.len().min(p.len());
            k[..n].copy_from_slice(&p[..n]);
        }
        f(p, g, m, v, &c)
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case_data(n: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let g: Vec<f32> = (0..n)
            .map(|i| match i % 9 {
                0 => -0.0,
                1 => 0.0,
                2 => 1e-30 * i as f32,
                3 => -3.5e4 / (i as f32 + 1.0),
                4 => f32::MIN_POSITIVE / 3.0,
                _ => ((i as f32) * 0.37).sin() * 1e-3,
            })
            .collect();
        let p: Vec<f32> = (0..n).map(|i| if i % 5 == 0 { -0.0 } else { (i as f32 * 0.11).cos() }).collect();
        let m: Vec<f32> = (0..n).map(|i| (i as f32 * 0.07).sin() * 1e-3).collect();
        let v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.05).cos().abs() * 1e-6).collect();
        (p, g, m, v)
    }

    /// The plain scalar reference: torch.optim.Adam's single-tensor arithmetic, one element at
    /// a time (the loop this module replaced).
    fn scalar(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: &AdamHyper) {
        let c = AdamScalars::of(h);
        for i in 0..p.len() {
            let mut grad = if h.maximize { -g[i] } else { g[i] };
            if h.weight_decay != 0.0 {
                if h.decoupled {
                    p[i] *= c.decay;
                } else {
                    grad = p[i].mul_add(c.weight_decay, grad);
                }
            }
            m[i] = c.lerp_coef.mul_add(grad - m[i], if c.lerp_from_grad { grad } else { m[i] });
            v[i] = (c.w2 * grad).mul_add(grad, v[i] * c.beta2);
            let denom = v[i].sqrt() / c.bc2_sqrt + c.eps;
            p[i] += (-c.step_size * m[i]) / denom;
        }
    }

    fn isas() -> Vec<Level> {
        let mut out = vec![Level::Generic];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") {
                out.push(Level::Avx2);
            }
            if is_x86_feature_detected!("avx512f") {
                out.push(Level::Avx512);
            }
        }
        out
    }

    /// Every instruction set, every option, tensors of odd lengths (vector tails) and several
    /// chunks, updated together: bitwise the scalar loop's results.
    #[test]
    fn every_path_is_bitwise_the_scalar_loop() {
        let base =
            AdamHyper { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false, maximize: false, step: 1 };
        let hypers = [
            base.clone(),
            AdamHyper { weight_decay: 0.01, ..base.clone() },
            AdamHyper { weight_decay: 0.1, decoupled: true, ..base.clone() },
            AdamHyper { maximize: true, beta1: 0.8, beta2: 0.99, ..base.clone() },
            // a lerp weight of 0.5 or more (torch's lerp then works from the gradient)
            AdamHyper { beta1: 0.3, ..base.clone() },
            AdamHyper { step: 7, weight_decay: 0.02, maximize: true, ..base },
        ];
        let lens = [1usize, 7, 8, 17, 64 + 3, 2 * CHUNK + 5];
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for isa in isas() {
            for from_zero in [false, true] {
                let mut want = Vec::new();
                let mut got: Vec<_> = Vec::new();
                for (i, &n) in lens.iter().enumerate() {
                    let h = hypers[i % hypers.len()].clone();
                    let (p, g, mut m, mut v) = case_data(n);
                    if from_zero {
                        m.iter_mut().chain(v.iter_mut()).for_each(|x| *x = 0.0);
                    }
                    let (mut p1, mut m1, mut v1) = (p.clone(), m.clone(), v.clone());
                    scalar(&mut p1, &g, &mut m1, &mut v1, &h);
                    want.push((p1, m1, v1));
                    let (m2, v2) = if from_zero { (vec![f32::NAN; n], vec![-7.0; n]) } else { (m, v) };
                    got.push((p, g, m2, v2, h));
                }
                let tensors =
                    got.iter_mut().map(|(p, g, m, v, h)| AdamTensor { p, g, m, v, h: h.clone(), from_zero, keep: None }).collect();
                adam_many_on(isa, tensors);
                for ((p, _, m, v, h), (wp, wm, wv)) in got.iter().zip(&want) {
                    let what = format!("{isa:?} from_zero={from_zero} n={} {h:?}", p.len());
                    assert_eq!(bits(p), bits(wp), "p: {what}");
                    assert_eq!(bits(m), bits(wm), "m: {what}");
                    assert_eq!(bits(v), bits(wv), "v: {what}");
                }
            }
        }
    }
}

#[cfg(test)]
mod keep_tests {
    use super::*;

    /// `keep` receives every parameter's values as they were before the update, across chunks.
    #[test]
    fn keep_holds_the_parameters_before_the_update() {
        let h = AdamHyper { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false, maximize: false, step: 1 };
        let n = 2 * CHUNK + 3;
        let p0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.3).sin()).collect();
        let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.7).cos()).collect();
        let (mut p, mut m, mut v, mut keep) = (p0.clone(), vec![0f32; n], vec![0f32; n], vec![f32::NAN; n]);
        let (mut q, mut m2, mut v2, mut keep2) = (vec![5f32; 7], vec![0f32; 7], vec![0f32; 7], vec![f32::NAN; 7]);
        let ts = vec![
            AdamTensor { p: &mut p, g: &g, m: &mut m, v: &mut v, h: h.clone(), from_zero: false, keep: Some(&mut keep) },
            AdamTensor { p: &mut q, g: &g[..7], m: &mut m2, v: &mut v2, h: h.clone(), from_zero: true, keep: Some(&mut keep2) },
        ];
        adam_many(ts);
        assert_eq!(keep, p0);
        assert_eq!(keep2, vec![5f32; 7]);
        assert!(p.iter().zip(&p0).all(|(a, b)| a != b));
    }
}

#[cfg(test)]
mod bench {
    use super::*;

    /// The tutorial model's 12 M parameters in its tensor sizes, per instruction set:
    /// `cargo test --release -p ortrain-engine adam_speed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn adam_speed() {
        let sizes = [5_756_400usize, 5_756_400, 28782, 80_000, 40_000, 40_000, 600, 200, 200, 200];
        type Buffers = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);
        let mut bufs: Vec<Buffers> = sizes.iter().map(|&n| (vec![0.5; n], vec![1e-3; n], vec![1e-4; n], vec![1e-6; n])).collect();
        let h = AdamHyper { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false, maximize: false, step: 3 };
        let mut isas = vec![Level::Generic];
        if is_x86_feature_detected!("avx2") {
            isas.push(Level::Avx2);
        }
        if level() == Level::Avx512 {
            isas.push(Level::Avx512);
        }
        for round in 0..4 {
            for &isa in &isas {
                let t = std::time::Instant::now();
                let tensors =
                    bufs.iter_mut().map(|(p, g, m, v)| AdamTensor { p, g, m, v, h: h.clone(), from_zero: false, keep: None }).collect();
                adam_many_on(isa, tensors);
                let many = t.elapsed().as_secs_f64() * 1e3;
                let t = std::time::Instant::now();
                for (p, g, m, v) in bufs.iter_mut() {
                    super::super::adam_per_tensor_scalar(p, g, m, v, &h);
                }
                let old = t.elapsed().as_secs_f64() * 1e3;
                println!("round {round}: {isa:?} one pass {many:.1} ms; old per-tensor scalar {old:.1} ms");
            }
        }
    }
}
