//! dropout.cu's random draws (`random_uniform_T`, `random_normal_T`, `bernoulli_T`): in every
//! float type the draws have the law's range and moments, Bernoulli's ones the frequency each
//! element's probability asks for, a key always draws the same numbers and another key others,
//! and a draw keyed through the seed in device memory (a recorded step's) is the host-keyed one.

use super::support::*;
use crate::backend::cuda::launch::{Grid, KArg};
use crate::backend::cuda::ops::random_key;
use crate::backend::cuda::registry::types::FLOATS;

/// `random_uniform_T` / `random_normal_T (T* y, i64 n, f64 a, f64 b, const u64* seed, u64 key)`
fn law_args(y: u64, n: usize, a: f64, b: f64, seed: u64, key: u64) -> Vec<KArg> {
    vec![KArg::Ptr(y), KArg::I64(n as i64), KArg::F64(a), KArg::F64(b), KArg::Ptr(seed), KArg::U64(key)]
}

/// `bernoulli_T(const T* p, T* y, i64 n, const u64* seed, u64 key)`
fn bernoulli_args(p: u64, y: u64, n: usize, seed: u64, key: u64) -> Vec<KArg> {
    vec![KArg::Ptr(p), KArg::Ptr(y), KArg::I64(n as i64), KArg::Ptr(seed), KArg::U64(key)]
}

/// Checks the draw kernels' argument lists; their names, for dropout.rs's coverage of the family.
pub(super) fn draw_kernels_checked() -> Vec<String> {
    let mut names = Vec::new();
    for t in FLOATS {
        for k in [format!("random_uniform_{t}"), format!("random_normal_{t}")] {
            check(&k, &law_args(1, 10, 0.0, 1.0, 0, 5));
            names.push(k);
        }
        check(&format!("bernoulli_{t}"), &bernoulli_args(1, 2, 10, 3, 5));
        names.push(format!("bernoulli_{t}"));
    }
    names
}

const N: usize = 100_003;
const KEY: u64 = 0x0123_4567_89AB_CDEF;

fn grid() -> Grid {
    Grid::elementwise(N.div_ceil(4) as i64, 16)
}

fn moments(v: &[f64]) -> (f64, f64) {
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    (mean, v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / v.len() as f64)
}

#[test]
fn gpu_random_draws_follow_their_laws_in_every_float_type() {
    let Some(g) = gpu("gpu_random_draws_follow_their_laws_in_every_float_type") else { return };
    for t in FLOATS {
        // uniform in [-2, 3)
        let ku = format!("random_uniform_{t}");
        let y = zeros_as(g, t, N);
        run(g, &ku, grid(), &law_args(y.ptr(), N, -2.0, 3.0, 0, KEY));
        let v = host_as(&y, t);
        assert!(v.iter().all(|&x| (-2.0..=3.0).contains(&x)), "{ku}: a draw outside [-2, 3]");
        let (mean, var) = moments(&v);
        assert!((mean - 0.5).abs() < 0.03 && (var - 25.0 / 12.0).abs() < 0.05, "{ku}: mean {mean}, variance {var}");
        if *t == "f64" {
            assert!(v.iter().any(|x| ((x + 2.0) / 5.0 * (1u64 << 24) as f64).fract() != 0.0), "{ku}: f64 draws on a 24-bit grid");
        }
        // the same key draws the same numbers, another key others
        let again = zeros_as(g, t, N);
        run(g, &ku, grid(), &law_args(again.ptr(), N, -2.0, 3.0, 0, KEY));
        assert_eq!(host_as(&again, t), v, "{ku}: one key drew two streams");
        run(g, &ku, grid(), &law_args(again.ptr(), N, -2.0, 3.0, 0, KEY + 1));
        assert_ne!(host_as(&again, t), v, "{ku}: two keys drew one stream");
        // keyed through a seed in device memory and a salt: the host-keyed draw
        let (seed, salt) = (0xFEED_u64, 0x5A17_u64);
        let slot = dev(g, &[seed]);
        run(g, &ku, grid(), &law_args(again.ptr(), N, -2.0, 3.0, slot.ptr(), salt));
        run(g, &ku, grid(), &law_args(y.ptr(), N, -2.0, 3.0, 0, random_key(seed, salt)));
        assert_eq!(host_as(&again, t), host_as(&y, t), "{ku}: the slot-keyed draw differs from the host-keyed one");

        // normal with mean 1.5 and scale 2
        let kn = format!("random_normal_{t}");
        run(g, &kn, grid(), &law_args(y.ptr(), N, 1.5, 2.0, 0, KEY));
        let v = host_as(&y, t);
        assert!(v.iter().all(|x| x.is_finite()), "{kn}: a draw is not finite");
        let (mean, var) = moments(&v);
        assert!((mean - 1.5).abs() < 0.04 && (var.sqrt() - 2.0).abs() < 0.04, "{kn}: mean {mean}, sd {}", var.sqrt());
        let tail = v.iter().filter(|&&x| (x - 1.5).abs() > 2.0 * 1.96).count() as f64 / N as f64;
        assert!((tail - 0.05).abs() < 0.005, "{kn}: {tail} of the draws beyond 1.96 sd, not about 0.05");

        // Bernoulli: ones at each element's probability
        let kb = format!("bernoulli_{t}");
        let probs = [0.0, 0.2, 0.9, 1.0];
        let p: Vec<f64> = (0..N).map(|i| probs[i % 4]).collect();
        let dp = dev_as(g, t, &p);
        run(g, &kb, grid(), &bernoulli_args(dp.ptr(), y.ptr(), N, 0, KEY));
        let v = host_as(&y, t);
        for (j, &want) in probs.iter().enumerate() {
            let drawn: Vec<f64> = v.iter().skip(j).step_by(4).copied().collect();
            assert!(drawn.iter().all(|&x| x == 0.0 || x == 1.0), "{kb}: a draw is neither 0 nor 1");
            let ones = drawn.iter().sum::<f64>() / drawn.len() as f64;
            assert!((ones - want).abs() < 0.015, "{kb} p {want}: {ones} ones");
        }
    }
}
