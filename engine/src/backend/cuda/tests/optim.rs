//! optim.cu: the multi-tensor Adam/AdamW and SGD updates over 10 steps, for every gradient
//! dtype, against engine/src/optim (the CPU updates, f32, per tensor, on the same gradients
//! widened from the kernel's dtype), and gradient clipping: sum_squares per chunk, grad_norm and
//! scale_by against the clip-by-global-norm math of torch.nn.utils.clip_grad_norm_ (total =
//! sqrt(sum of squares), coef = max_norm / (total + 1e-6) when below 1), computed on the host in
//! f64 with optim::sum_squares / optim::scale. The CPU backend has no multi-tensor form: the
//! references loop over the tensors.

use super::support::*;
use crate::backend::cuda::abi::{AdamTensor, GradTensor, SgdTensor};
use crate::backend::cuda::launch::{DeviceBuffer, Grid, KArg};
use crate::backend::cuda::optim::TensorList;
use crate::backend::cuda::registry::types::GRADS;
use crate::optim::{self, AdamHyper, SgdHyper};

/// Tensor sizes (one of several chunks, the last partial; one below a chunk; a tiny one) and
/// the chunk length.
const SIZES: &[usize] = &[1000, 40_000, 5];
const CHUNK: usize = 4096;
/// Fewer blocks than chunks (12): the grid-stride chunk loop.
const BLOCKS: u32 = 5;
const STEPS: u64 = 10;

/// The chunk list of a launch: (tensor, start) of every chunk of every tensor.
fn chunk_list(sizes: &[usize], chunk: usize) -> (Vec<i32>, Vec<i64>) {
    sizes.iter().enumerate().flat_map(|(t, &n)| (0..n).step_by(chunk).map(move |s| (t as i32, s as i64))).unzip()
}

/// `adam_G(ts, chunk_tensor, chunk_start, i64 chunks, i64 chunk, f32 w1, f32 beta2, f32 w2,
/// f32 eps, f32 weight_decay, f32 decay, f32 step_size, f32 bc2_sqrt, i32 decoupled, i32 maximize)`
/// with the scalars engine/src/optim uses (AdamScalars: f64, rounded once)
fn adam_args(ts: u64, ct: u64, cs: u64, chunks: usize, h: &AdamHyper) -> Vec<KArg> {
    let s = optim::AdamScalars::of(h);
    let f = KArg::F32;
    vec![
        KArg::Ptr(ts),
        KArg::Ptr(ct),
        KArg::Ptr(cs),
        KArg::I64(chunks as i64),
        KArg::I64(CHUNK as i64),
        f(s.w1),
        f(s.beta2),
        f(s.w2),
        f(s.eps),
        f(s.weight_decay),
        f(s.decay),
        f(s.step_size),
        f(s.bc2_sqrt),
        KArg::I32(h.decoupled as i32),
        KArg::I32(h.maximize as i32),
    ]
}

/// `sgd_G(ts, chunk_tensor, chunk_start, i64 chunks, i64 chunk, f32 lr, f32 momentum,
/// f32 dampening, f32 weight_decay, i32 nesterov, i32 maximize, i32 first)`
fn sgd_args(ts: u64, ct: u64, cs: u64, chunks: usize, h: &SgdHyper, first: bool) -> Vec<KArg> {
    let f = KArg::F32;
    vec![
        KArg::Ptr(ts),
        KArg::Ptr(ct),
        KArg::Ptr(cs),
        KArg::I64(chunks as i64),
        KArg::I64(CHUNK as i64),
        f(h.lr),
        f(h.momentum),
        f(h.dampening),
        f(h.weight_decay),
        KArg::I32(h.nesterov as i32),
        KArg::I32(h.maximize as i32),
        KArg::I32(first as i32),
    ]
}

/// `sum_squares_G(ts, ..., f64* partial)` and `scale_by_G(ts, ..., const f32* coef)`
fn grads_args(ts: u64, ct: u64, cs: u64, chunks: usize, out: u64) -> Vec<KArg> {
    vec![KArg::Ptr(ts), KArg::Ptr(ct), KArg::Ptr(cs), KArg::I64(chunks as i64), KArg::I64(CHUNK as i64), KArg::Ptr(out)]
}

/// `grad_norm_f64(const f64* partial, i64 chunks, f32 max_norm, f32* norm, f32* coef)`
fn norm_args(partial: u64, chunks: usize, max_norm: f32, norm: u64, coef: u64) -> Vec<KArg> {
    vec![KArg::Ptr(partial), KArg::I64(chunks as i64), KArg::F32(max_norm), KArg::Ptr(norm), KArg::Ptr(coef)]
}

fn adam_configs() -> Vec<(&'static str, AdamHyper)> {
    let base = AdamHyper { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false, maximize: false, step: 1 };
    vec![
        ("Adam, L2 weight decay 0.01", AdamHyper { weight_decay: 0.01, ..base.clone() }),
        ("AdamW, decoupled weight decay 0.1", AdamHyper { weight_decay: 0.1, decoupled: true, ..base.clone() }),
        ("Adam, maximize, betas (0.8, 0.99)", AdamHyper { maximize: true, beta1: 0.8, beta2: 0.99, ..base.clone() }),
        ("Adam, betas (0.4, 0.999): lerp from the gradient", AdamHyper { beta1: 0.4, ..base }),
    ]
}

/// (name, hyperparameters, momentum buffer)
fn sgd_configs() -> Vec<(&'static str, SgdHyper, bool)> {
    let base = SgdHyper { lr: 0.05, momentum: 0.9, dampening: 0.1, weight_decay: 0.01, nesterov: false, maximize: false };
    vec![
        ("SGD, momentum 0.9, dampening 0.1, weight decay 0.01", base.clone(), true),
        ("SGD, Nesterov momentum 0.9, maximize", SgdHyper { nesterov: true, dampening: 0.0, maximize: true, ..base.clone() }, true),
        ("SGD without momentum buffer, weight decay 0.01", SgdHyper { momentum: 0.0, dampening: 0.0, ..base }, false),
    ]
}

#[test]
fn optim_argument_lists_match_the_registry() {
    let chunks = chunk_list(SIZES, CHUNK).0.len();
    assert_eq!(chunks, 1 + 10 + 1);
    let mut checked = Vec::new();
    for t in GRADS {
        for (_, h) in adam_configs() {
            check(&format!("adam_{t}"), &adam_args(1, 1, 1, chunks, &h));
        }
        for (_, h, _) in sgd_configs() {
            check(&format!("sgd_{t}"), &sgd_args(1, 1, 1, chunks, &h, true));
        }
        check(&format!("sum_squares_{t}"), &grads_args(1, 1, 1, chunks, 1));
        check(&format!("scale_by_{t}"), &grads_args(1, 1, 1, chunks, 1));
        checked.extend(["adam", "sgd", "sum_squares", "scale_by"].map(|op| format!("{op}_{t}")));
    }
    check("grad_norm_f64", &norm_args(1, chunks, 1.0, 1, 1));
    checked.push("grad_norm_f64".into());
    assert_covers("optim", &checked);
    // the descriptors are plain data the kernels read from device memory (abi.rs checks sizes)
    assert_eq!(std::mem::size_of::<[AdamTensor; 3]>(), 120);
}

/// Fresh gradients for every tensor, rounded to `t`, as f32 (what the CPU update reads) and
/// uploaded as `t`.
fn gradients(g: &crate::backend::cuda::loader::Loaded, rng: &mut Rng, t: &str) -> (Vec<Vec<f32>>, Vec<DeviceBuffer>) {
    SIZES
        .iter()
        .map(|&n| {
            let v = rand_as(rng, t, n, -1.0, 1.0);
            (v.iter().map(|&x| x as f32).collect::<Vec<f32>>(), dev_as(g, t, &v))
        })
        .unzip()
}

fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// Parameters, moments and momentum buffers after 10 steps: the kernels and the CPU differ by
/// FMA contraction (the GPU fuses, Rust does not), a few f32 ulps a step.
const RTOL: f64 = 1e-5;
const ATOL: f64 = 1e-6;

#[test]
fn gpu_adam_adamw_and_sgd_match_engine_optim_over_10_steps() {
    let Some(g) = gpu("gpu_adam_adamw_and_sgd_match_engine_optim_over_10_steps") else { return };
    let mut rng = Rng::new(71);
    let (ct, cs) = chunk_list(SIZES, CHUNK);
    let chunks = ct.len();
    let (dct, dcs) = (dev(g, &ct), dev(g, &cs));
    let grid = Grid::new(BLOCKS, 256);
    for t in GRADS {
        for (name, mut h) in adam_configs() {
            let k = format!("adam_{t}");
            let mut p: Vec<Vec<f32>> = SIZES.iter().map(|&n| (0..n).map(|_| rng.f32(-1.0, 1.0)).collect()).collect();
            let mut m: Vec<Vec<f32>> = SIZES.iter().map(|&n| vec![0.0; n]).collect();
            let mut v = m.clone();
            let dp: Vec<DeviceBuffer> = p.iter().map(|x| dev(g, x)).collect();
            let (dm, dv): (Vec<DeviceBuffer>, Vec<DeviceBuffer>) = SIZES.iter().map(|&n| (zeros::<f32>(g, n), zeros::<f32>(g, n))).unzip();
            for step in 1..=STEPS {
                h.step = step;
                let (gv, dg) = gradients(g, &mut rng, t);
                let ts: Vec<AdamTensor> = (0..SIZES.len())
                    .map(|i| AdamTensor { p: dp[i].ptr(), g: dg[i].ptr(), m: dm[i].ptr(), v: dv[i].ptr(), n: SIZES[i] as i64 })
                    .collect();
                let dts = dev(g, &ts);
                run(g, &k, grid, &adam_args(dts.ptr(), dct.ptr(), dcs.ptr(), chunks, &h));
                for i in 0..SIZES.len() {
                    optim::adam(&mut p[i], &gv[i], &mut m[i], &mut v[i], &h);
                }
            }
            for i in 0..SIZES.len() {
                let case = format!("{k} ({name}), tensor {i} of {} elements, after {STEPS} steps", SIZES[i]);
                assert_close(&format!("{case}: p"), &widen(&host::<f32>(&dp[i])), &widen(&p[i]), RTOL, ATOL);
                assert_close(&format!("{case}: m"), &widen(&host::<f32>(&dm[i])), &widen(&m[i]), RTOL, ATOL);
                assert_close(&format!("{case}: v"), &widen(&host::<f32>(&dv[i])), &widen(&v[i]), RTOL, ATOL * 1e-3);
            }
        }

        for (name, h, with_buf) in sgd_configs() {
            let k = format!("sgd_{t}");
            let mut p: Vec<Vec<f32>> = SIZES.iter().map(|&n| (0..n).map(|_| rng.f32(-1.0, 1.0)).collect()).collect();
            let mut buf: Vec<Vec<f32>> = SIZES.iter().map(|&n| vec![0.0; n]).collect();
            let dp: Vec<DeviceBuffer> = p.iter().map(|x| dev(g, x)).collect();
            let dbuf: Vec<DeviceBuffer> = SIZES.iter().map(|&n| zeros::<f32>(g, n)).collect();
            for step in 1..=STEPS {
                let (gv, dg) = gradients(g, &mut rng, t);
                let ts: Vec<SgdTensor> = (0..SIZES.len())
                    .map(|i| SgdTensor {
                        p: dp[i].ptr(),
                        g: dg[i].ptr(),
                        buf: if with_buf { dbuf[i].ptr() } else { 0 },
                        n: SIZES[i] as i64,
                    })
                    .collect();
                let dts = dev(g, &ts);
                run(g, &k, grid, &sgd_args(dts.ptr(), dct.ptr(), dcs.ptr(), chunks, &h, step == 1));
                for i in 0..SIZES.len() {
                    let b = if with_buf { Some(&mut buf[i][..]) } else { None };
                    optim::sgd(&mut p[i], &gv[i], b, step == 1, &h);
                }
            }
            for i in 0..SIZES.len() {
                let case = format!("{k} ({name}), tensor {i} of {} elements, after {STEPS} steps", SIZES[i]);
                assert_close(&format!("{case}: p"), &widen(&host::<f32>(&dp[i])), &widen(&p[i]), RTOL, ATOL);
                if with_buf {
                    assert_close(&format!("{case}: momentum buffer"), &widen(&host::<f32>(&dbuf[i])), &widen(&buf[i]), RTOL, ATOL);
                } else {
                    assert!(host::<f32>(&dbuf[i]).iter().all(|&x| x == 0.0), "{case}: the unused buffer was written");
                }
            }
        }
    }
}

#[test]
fn gpu_clip_grad_norm_matches_the_global_norm_math() {
    let Some(g) = gpu("gpu_clip_grad_norm_matches_the_global_norm_math") else { return };
    let mut rng = Rng::new(81);
    let (ct, cs) = chunk_list(SIZES, CHUNK);
    let chunks = ct.len();
    let (dct, dcs) = (dev(g, &ct), dev(g, &cs));
    for t in GRADS {
        // max_norm 1 clips (the norm is about sqrt(41005 / 3) ≈ 117); 1e6 does not (coef 1)
        for max_norm in [1.0f32, 1e6] {
            let case = format!("{} tensors of {SIZES:?} in {chunks} chunks of {CHUNK}, max_norm {max_norm}", SIZES.len());
            let (gv, dg) = gradients(g, &mut rng, t);
            let ts: Vec<GradTensor> = (0..SIZES.len()).map(|i| GradTensor { g: dg[i].ptr(), n: SIZES[i] as i64 }).collect();
            let dts = dev(g, &ts);

            let k = format!("sum_squares_{t}");
            let partial = dev(g, &vec![f64::NAN; chunks]);
            run(g, &k, Grid::new(BLOCKS, 256), &grads_args(dts.ptr(), dct.ptr(), dcs.ptr(), chunks, partial.ptr()));
            let want: Vec<f64> = ct
                .iter()
                .zip(&cs)
                .map(|(&ti, &s)| {
                    let v = &gv[ti as usize];
                    let end = (s as usize + CHUNK).min(v.len());
                    optim::sum_squares(&v[s as usize..end])
                })
                .collect();
            let gp = host::<f64>(&partial);
            assert_close(&format!("{k} partial per chunk, {case}"), &gp, &want, 1e-12, 0.0);

            let (norm, coef) = (zeros::<f32>(g, 1), zeros::<f32>(g, 1));
            run(g, "grad_norm_f64", Grid::new(1, 256), &norm_args(partial.ptr(), chunks, max_norm, norm.ptr(), coef.ptr()));
            let total = gv.iter().map(|v| optim::sum_squares(v)).sum::<f64>().sqrt();
            let want_coef = (max_norm as f64 / (total + 1e-6)).min(1.0);
            let (gn, gc) = (host::<f32>(&norm)[0] as f64, host::<f32>(&coef)[0] as f64);
            assert_close(&format!("grad_norm_f64 norm, {case}"), &[gn], &[total], rtol("f32"), 0.0);
            assert_close(&format!("grad_norm_f64 coef, {case}"), &[gc], &[want_coef], rtol("f32"), 0.0);
            if max_norm > 1e3 {
                assert_eq!(gc, 1.0, "grad_norm_f64 coef, {case}: not clipped must be exactly 1");
            }

            // scale_by with the kernel's own coef: exactly optim::scale's f32 product, rounded to G
            let k = format!("scale_by_{t}");
            run(g, &k, Grid::new(BLOCKS, 256), &grads_args(dts.ptr(), dct.ptr(), dcs.ptr(), chunks, coef.ptr()));
            for i in 0..SIZES.len() {
                let mut want = gv[i].clone();
                optim::scale(&mut want, gc as f32);
                let want: Vec<f64> = want.iter().map(|&x| round_to(t, x as f64)).collect();
                assert_close(&format!("{k} tensor {i}, {case}"), &host_as(&dg[i], t), &want, 0.0, 0.0);
            }
        }
    }

    // grad_norm over more partials than threads (the strided loop of its one block)
    let partials: Vec<f64> = (0..3000).map(|_| rng.f32(0.0, 1.0) as f64).collect();
    let (dpart, norm, coef) = (dev(g, &partials), zeros::<f32>(g, 1), zeros::<f32>(g, 1));
    run(g, "grad_norm_f64", Grid::new(1, 256), &norm_args(dpart.ptr(), partials.len(), 5.0, norm.ptr(), coef.ptr()));
    let total = partials.iter().sum::<f64>().sqrt();
    let what = "grad_norm_f64 over 3000 partials, 256 threads";
    assert_close(what, &[host::<f32>(&norm)[0] as f64], &[total], rtol("f32"), 0.0);
    assert_close(what, &[host::<f32>(&coef)[0] as f64], &[5.0 / (total + 1e-6)], rtol("f32"), 0.0);
}

/// `optim::clip_f32`, the three launches the Python clip_grad_norm_ bridge queues: on f32
/// gradients (one of them two of the engine's chunks), the norm and coefficient of the global
/// norm math (the coefficient exactly the CPU clip's of that norm), each gradient multiplied by
/// that coefficient as optim::scale does; a max_norm past the norm leaves them as they were; a
/// NaN among the gradients makes the norm, the coefficient and so every gradient NaN, as
/// torch's clip_grad_norm_ does (its clamp keeps the NaN).
#[test]
fn gpu_clip_f32_clips_by_the_global_norm() {
    let Some(g) = gpu("gpu_clip_f32_clips_by_the_global_norm") else { return };
    let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
    let mut rng = Rng::new(83);
    let sizes = [1000usize, 70_000, 5];
    let (ct, cs) = crate::backend::cuda::optim::chunk_list(&sizes);
    assert_eq!(ct.len(), 4, "the middle gradient spans two chunks");
    let (dct, dcs) = (dev(g, &ct), dev(g, &cs));
    for (max_norm, nan) in [(1.0f32, false), (1e6, false), (1.0, true), (1e6, true)] {
        let mut gv: Vec<Vec<f32>> = sizes.iter().map(|&n| (0..n).map(|_| rng.f32(-1.0, 1.0)).collect()).collect();
        if nan {
            gv[1][40_000] = f32::NAN;
        }
        let dg: Vec<DeviceBuffer> = gv.iter().map(|v| dev(g, v)).collect();
        let ts: Vec<GradTensor> = (0..sizes.len()).map(|i| GradTensor { g: dg[i].ptr(), n: sizes[i] as i64 }).collect();
        let dts = dev(g, &ts);
        let (partial, norm, coef) = (zeros::<f64>(g, ct.len()), zeros::<f32>(g, 1), zeros::<f32>(g, 1));
        // SAFETY: every buffer above is live device memory of the sizes the call is given, and
        // the synchronize below waits for the launches before any is dropped.
        unsafe {
            let list = TensorList { table: dts.ptr(), chunk_tensor: dct.ptr(), chunk_start: dcs.ptr(), chunks: ct.len() };
            crate::backend::cuda::optim::clip_f32(rt, std::ptr::null_mut(), &list, max_norm, partial.ptr(), norm.ptr(), coef.ptr())
        }
        .expect("clip_f32");
        g.synchronize().expect("sync");
        let case = format!("max_norm {max_norm}{}", if nan { ", a NaN gradient element" } else { "" });
        let (gn, gc) = (host::<f32>(&norm)[0], host::<f32>(&coef)[0]);
        if nan {
            assert!(gn.is_nan() && gc.is_nan(), "{case}: norm {gn} and coefficient {gc} must be NaN");
            assert!(dg.iter().all(|d| host::<f32>(d).iter().all(|x| x.is_nan())), "{case}: every gradient NaN, as torch's");
            continue;
        }
        let total = gv.iter().map(|v| optim::sum_squares(v)).sum::<f64>().sqrt();
        assert_close(&format!("{case}: norm"), &[gn as f64], &[total], rtol("f32"), 0.0);
        assert_eq!(gc.to_bits(), optim::clip_coefficient(gn, max_norm as f64).to_bits(), "{case}: the CPU clip's coefficient of that norm");
        for (i, v) in gv.iter().enumerate() {
            let mut want = v.clone();
            optim::scale(&mut want, gc);
            assert_eq!(host::<f32>(&dg[i]), want, "{case}: gradient {i} multiplied by the coefficient");
        }
        if max_norm > 1e3 {
            assert_eq!(host::<f32>(&dg[1]), gv[1], "{case}: a norm under max_norm leaves the gradients as they were");
        }
    }
}
