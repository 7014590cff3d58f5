//! Optimizer updates over parameter memory, in place: Adam/AdamW and SGD with exactly
//! torch.optim's arithmetic (same operation order, so results match to the last bits where the
//! compiler allows), plus the global gradient norm for clipping. Parallel over chunks.

mod adam;
mod clip;

use rayon::prelude::*;

pub use adam::{adam_many, AdamScalars, AdamTensor};
pub use clip::{clip_coefficient, global_norm, scale_many, sum_squares_many};

const CHUNK: usize = 1 << 14;

#[derive(Clone, Debug)]
/// Adam/AdamW hyper-parameters as the user gave them (Python floats: f64). torch derives the
/// update's scalars (1 − β, lr / (1 − β₁ᵗ), 1 − lr·wd, …) in f64 and rounds each to f32 once as a
/// kernel's scalar argument; `AdamScalars::of` does the same (1 − β₂ from an f32 β₂ is 1.3e-5
/// off torch's).
pub struct AdamHyper {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// AdamW: decay the weights directly instead of adding to the gradient.
    pub decoupled: bool,
    pub maximize: bool,
    /// The step number after this update (1 for the first update).
    pub step: u64,
}

/// One Adam/AdamW update of a parameter tensor (torch.optim.Adam, foreach=False semantics).
pub fn adam(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: &AdamHyper) {
    adam_many(vec![AdamTensor { p, g, m, v, h: h.clone(), from_zero: false, keep: None }]);
}

/// The first Adam/AdamW update of a parameter whose moments torch would have just created as
/// zeros: `m` and `v` are only written (their memory may be uninitialised, so that a first step
/// neither zero-fills nor reads 2 × the parameters' bytes). The arithmetic is `adam`'s with
/// both moments read as +0.0, so the results are bitwise the same as `adam` on zeroed moments.
pub fn adam_from_zero(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: &AdamHyper) {
    adam_many(vec![AdamTensor { p, g, m, v, h: h.clone(), from_zero: true, keep: None }]);
}

/// The per-tensor scalar loop adam_many replaced, kept for its speed comparison (adam.rs bench).
#[cfg(test)]
fn adam_per_tensor_scalar(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: &AdamHyper) {
    let c = AdamScalars::of(h);
    p.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).zip(m.par_chunks_mut(CHUNK)).zip(v.par_chunks_mut(CHUNK)).for_each(
        |(((p, g), m), v)| {
            for i in 0..p.len() {
                let grad = if h.maximize { -g[i] } else { g[i] };
                m[i] = c.lerp_coef.mul_add(grad - m[i], if c.lerp_from_grad { grad } else { m[i] });
                v[i] = (c.w2 * grad).mul_add(grad, v[i] * c.beta2);
                let denom = v[i].sqrt() / c.bc2_sqrt + c.eps;
                p[i] += (-c.step_size * m[i]) / denom;
            }
        },
    );
}

#[derive(Clone, Debug)]
pub struct SgdHyper {
    pub lr: f32,
    pub momentum: f32,
    pub dampening: f32,
    pub weight_decay: f32,
    pub nesterov: bool,
    pub maximize: bool,
}

/// One SGD update. `buf` is the momentum buffer (None without momentum); `first` says that the
/// buffer is new (torch then initialises it with the gradient itself).
pub fn sgd(p: &mut [f32], g: &[f32], buf: Option<&mut [f32]>, first: bool, h: &SgdHyper) {
    let upd = |p: &mut [f32], g: &[f32], mut b: Option<&mut [f32]>| {
        for i in 0..p.len() {
            let mut d = if h.maximize { -g[i] } else { g[i] };
            if h.weight_decay != 0.0 {
                d += h.weight_decay * p[i];
            }
            if let Some(b) = b.as_deref_mut() {
                b[i] = if first { d } else { b[i] * h.momentum + (1.0 - h.dampening) * d };
                d = if h.nesterov { d + h.momentum * b[i] } else { b[i] };
            }
            p[i] -= h.lr * d;
        }
    };
    match buf {
        Some(b) if h.momentum != 0.0 => {
            p.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).zip(b.par_chunks_mut(CHUNK)).for_each(|((p, g), b)| upd(p, g, Some(b)))
        }
        _ => p.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).for_each(|(p, g)| upd(p, g, None)),
    }
}

#[derive(Clone, Debug)]
pub struct LambHyper {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub bias_correction: bool,
    /// Bounds of the trust ratio ||p|| / ||update||.
    pub ratio_min: f32,
    pub ratio_max: f32,
    pub step: u64,
}

/// One LAMB update (You et al. 2019; ORT's LambOptimizer): Adam direction plus weight decay,
/// scaled per tensor by the trust ratio ||p|| / ||direction||.
pub fn lamb(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: &LambHyper) {
    let (bc1, bc2) = if h.bias_correction {
        (1.0 - (h.beta1 as f64).powi(h.step as i32), 1.0 - (h.beta2 as f64).powi(h.step as i32))
    } else {
        (1.0, 1.0)
    };
    let mut dir = vec![0f32; p.len()];
    dir.par_chunks_mut(CHUNK)
        .zip(p.par_chunks(CHUNK))
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .for_each(|((((d, p), g), m), v)| {
            for i in 0..d.len() {
                m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * g[i];
                v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * g[i] * g[i];
                let mh = m[i] as f64 / bc1;
                let vh = v[i] as f64 / bc2;
                d[i] = (mh / (vh.sqrt() + h.eps as f64)) as f32 + h.weight_decay * p[i];
            }
        });
    let pn = sum_squares(p).sqrt();
    let dn = sum_squares(&dir).sqrt();
    let ratio = if pn > 0.0 && dn > 0.0 { ((pn / dn) as f32).clamp(h.ratio_min, h.ratio_max) } else { 1.0 };
    let step = h.lr * ratio;
    p.par_chunks_mut(CHUNK).zip(dir.par_chunks(CHUNK)).for_each(|(p, d)| p.iter_mut().zip(d).for_each(|(p, d)| *p -= step * d));
}

/// Sum of squares of a gradient tensor, accumulated in f64.
pub fn sum_squares(g: &[f32]) -> f64 {
    sum_squares_many(&[g])[0]
}

/// Scales a tensor in place.
pub fn scale(g: &mut [f32], s: f32) {
    scale_many(vec![g], s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adam_first_step_moves_by_lr() {
        // with bias correction the first Adam step is lr·sign(g) (up to eps)
        let mut p = vec![1.0f32, -2.0];
        let g = vec![0.5f32, -3.0];
        let (mut m, mut v) = (vec![0.0; 2], vec![0.0; 2]);
        let h = AdamHyper { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false, maximize: false, step: 1 };
        adam(&mut p, &g, &mut m, &mut v, &h);
        assert!((p[0] - 0.9).abs() < 1e-5 && (p[1] + 1.9).abs() < 1e-5, "{p:?}");
    }

    #[test]
    fn adam_from_zero_is_bitwise_adam_on_zeroed_moments() {
        // signed zeros, tiny and large gradients, every option: same bits as adam() from zeros
        let g: Vec<f32> = (0..3 * CHUNK + 17)
            .map(|i| match i % 7 {
                0 => -0.0,
                1 => 0.0,
                2 => 1e-30 * i as f32,
                3 => -3.5e4 / (i as f32 + 1.0),
                _ => ((i as f32) * 0.37).sin() * 1e-3,
            })
            .collect();
        let p0: Vec<f32> = (0..g.len()).map(|i| if i % 5 == 0 { -0.0 } else { (i as f32 * 0.11).cos() }).collect();
        let base =
            AdamHyper { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false, maximize: false, step: 1 };
        let cases = [
            base.clone(),
            AdamHyper { weight_decay: 0.01, ..base.clone() },
            AdamHyper { weight_decay: 0.1, decoupled: true, ..base.clone() },
            AdamHyper { maximize: true, beta1: 0.8, beta2: 0.99, ..base.clone() },
            AdamHyper { step: 3, ..base },
        ];
        for h in &cases {
            let (mut p1, mut m1, mut v1) = (p0.clone(), vec![0.0f32; g.len()], vec![0.0f32; g.len()]);
            adam(&mut p1, &g, &mut m1, &mut v1, h);
            let (mut p2, mut m2, mut v2) = (p0.clone(), vec![f32::NAN; g.len()], vec![-7.0f32; g.len()]);
            adam_from_zero(&mut p2, &g, &mut m2, &mut v2, h);
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&p1), bits(&p2), "{h:?}");
            assert_eq!(bits(&m1), bits(&m2), "{h:?}");
            assert_eq!(bits(&v1), bits(&v2), "{h:?}");
        }
    }

    #[test]
    fn sgd_momentum_first_step_uses_gradient() {
        let mut p = vec![1.0f32];
        let mut b = vec![123.0f32];
        let h = SgdHyper { lr: 0.5, momentum: 0.9, dampening: 0.0, weight_decay: 0.0, nesterov: false, maximize: false };
        sgd(&mut p, &[2.0], Some(&mut b), true, &h);
        assert_eq!((p[0], b[0]), (0.0, 2.0));
        sgd(&mut p, &[2.0], Some(&mut b), false, &h);
        assert!((b[0] - 3.8).abs() < 1e-6 && (p[0] + 1.9).abs() < 1e-6);
    }
}
