//! cuBLASLt products with an epilogue (blas_lt.rs) against an f64 host reference:
//! D = alpha·op(A)·op(B) + beta·C + bias, for f32, bf16 and f16 operands (16-bit results, and
//! f32 results with C a separate f32 buffer: the residual fusion's form), every transpose
//! combination, with and without the bias and C. Each call must be taken by cuBLASLt (on a GPU:
//! the combinations the engine relies on have a kernel), and a separate C is left as it was.
//! And the GELU-gradient epilogue: D = GELU'(aux) ⊙ alpha·op(A)·op(B), the tanh approximation's
//! derivative, against the same reference.

use super::support::*;
use crate::backend::cuda::blas::{F32Mode, Gemm, GemmType};
use crate::backend::cuda::blas_lt::Epilogue;
use crate::backend::cuda::loader::Loaded;

fn round(t: GemmType, v: f64) -> f64 {
    match t {
        GemmType::Bf16 => bf16_value(bf16_bits(v as f32)) as f64,
        GemmType::F16 => f16_value(f16_bits(v as f32)) as f64,
        GemmType::F32 => v as f32 as f64,
        GemmType::F64 => v,
    }
}

fn upload(g: &Loaded, t: GemmType, v: &[f64]) -> crate::backend::cuda::launch::DeviceBuffer {
    match t {
        GemmType::F64 => dev(g, v),
        GemmType::F32 => dev(g, &v.iter().map(|&x| x as f32).collect::<Vec<_>>()),
        GemmType::Bf16 => dev(g, &v.iter().map(|&x| bf16_bits(x as f32)).collect::<Vec<_>>()),
        GemmType::F16 => dev(g, &v.iter().map(|&x| f16_bits(x as f32)).collect::<Vec<_>>()),
    }
}

fn download(t: GemmType, b: &crate::backend::cuda::launch::DeviceBuffer) -> Vec<f64> {
    match t {
        GemmType::F64 => host::<f64>(b),
        GemmType::F32 => host::<f32>(b).into_iter().map(f64::from).collect(),
        GemmType::Bf16 => host::<u16>(b).into_iter().map(|x| bf16_value(x) as f64).collect(),
        GemmType::F16 => host::<u16>(b).into_iter().map(|x| f16_value(x) as f64).collect(),
    }
}

#[test]
fn gpu_epilogue_products_add_the_bias_and_a_separate_c() {
    let Some(gpu_) = gpu("gpu_epilogue_products_add_the_bias_and_a_separate_c") else { return };
    let mut rng = Rng::new(53);
    let (m, n, k) = (37, 24, 48);
    // (operands, result and C, tolerance relative to the sum of |terms|)
    let types = [
        (GemmType::F32, GemmType::F32, 2e-6),
        (GemmType::Bf16, GemmType::Bf16, 8e-3),
        (GemmType::F16, GemmType::F16, 1e-3),
        (GemmType::Bf16, GemmType::F32, 2e-6),
        (GemmType::F16, GemmType::F32, 2e-6),
    ];
    for (ab, cd, rtol) in types {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            for (with_bias, with_c) in [(true, false), (true, true), (false, true)] {
                let name = format!("{ab:?} -> {cd:?}, trans_a {ta}, trans_b {tb}, bias {with_bias}, C {with_c}");
                let mut g = Gemm::contiguous(1, m, n, k, ta, tb, ab);
                g.c_type = cd;
                g.f32_mode = F32Mode::Exact;
                g.alpha = 0.75;
                g.beta = if with_c { 1.0 } else { 0.0 };
                let vals = |rng: &mut Rng, t: GemmType, len: usize| -> Vec<f64> {
                    rng.f32s(len, -1.0, 1.0).into_iter().map(|v| round(t, v as f64)).collect()
                };
                let (a, b, c, bias) =
                    (vals(&mut rng, ab, m * k), vals(&mut rng, ab, k * n), vals(&mut rng, cd, m * n), vals(&mut rng, cd, n));
                let (da, db, dc, dbias) = (upload(gpu_, ab, &a), upload(gpu_, ab, &b), upload(gpu_, cd, &c), upload(gpu_, cd, &bias));
                let dd = upload(gpu_, cd, &vec![f64::NAN; m * n]);
                let bias_ptr = if with_bias { dbias.ptr() } else { 0 };
                let taken = blas(gpu_)
                    .gemm_epilogue(std::ptr::null_mut(), &g, da.ptr(), db.ptr(), dc.ptr(), dd.ptr(), Epilogue::Bias(bias_ptr))
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                assert!(taken, "{name}: cuBLASLt has no kernel for it");
                gpu_.synchronize().unwrap_or_else(|e| panic!("{name}: {e}"));
                let got = download(cd, &dd);
                assert_eq!(download(cd, &dc), c, "{name}: C changed");
                for i in 0..m {
                    for j in 0..n {
                        let (mut s, mut scale) = (0.0, 0.0);
                        for l in 0..k {
                            let av = if ta { a[l * m + i] } else { a[i * k + l] };
                            let bv = if tb { b[j * k + l] } else { b[l * n + j] };
                            s += av * bv;
                            scale += (av * bv).abs();
                        }
                        let mut want = g.alpha * s;
                        scale *= g.alpha;
                        if with_c {
                            want += c[i * n + j];
                            scale += c[i * n + j].abs();
                        }
                        if with_bias {
                            want += bias[j];
                            scale += bias[j].abs();
                        }
                        let v = got[i * n + j];
                        assert!((v - want).abs() <= rtol * scale.max(1e-30), "{name}: [{i}, {j}] got {v}, expected {want}");
                    }
                }
            }
        }
    }
}

/// Where cuBLASLt has no kernel (f64, batches, operands half_gemm.rs rounds), the call says
/// so and queues nothing.
#[test]
fn gpu_epilogue_products_decline_what_cublaslt_cannot_do() {
    let Some(gpu_) = gpu("gpu_epilogue_products_decline_what_cublaslt_cannot_do") else { return };
    let out = upload(gpu_, GemmType::F64, &[1.0; 16]);
    let mut declined = Vec::new();
    let f64_gemm = Gemm::contiguous(1, 4, 4, 4, false, false, GemmType::F64);
    let batched = Gemm::contiguous(2, 2, 2, 2, false, false, GemmType::F32);
    let rounded = Gemm { f32_mode: F32Mode::Bf16, ..Gemm::contiguous(1, 4, 4, 4, false, false, GemmType::F32) };
    for (what, g) in [("f64", f64_gemm), ("a batch of 2", batched), ("f32 rounded to bf16", rounded)] {
        let taken =
            blas(gpu_).gemm_epilogue(std::ptr::null_mut(), &g, out.ptr(), out.ptr(), 0, out.ptr(), Epilogue::Plain).expect("no error");
        if !taken {
            declined.push(what);
        }
    }
    gpu_.synchronize().expect("sync");
    assert_eq!(declined, ["f64", "a batch of 2", "f32 rounded to bf16"]);
    assert_eq!(host::<f64>(&out), vec![1.0; 16], "nothing was queued");
}

/// Operands at addresses less aligned than the 256 bytes cuBLASLt assumes unless told (a
/// PyTorch view with a storage offset, a 64-byte-aligned arena buffer): blas_lt.rs tells it each
/// address's real alignment, so the product either runs and is right, or is declined with
/// nothing queued. A bias that is not 16-byte aligned is always declined.
#[test]
fn gpu_epilogue_products_take_operands_at_any_alignment() {
    let Some(gpu_) = gpu("gpu_epilogue_products_take_operands_at_any_alignment") else { return };
    let mut rng = Rng::new(67);
    let (m, n, k, t) = (16, 8, 24, GemmType::Bf16);
    let vals = |rng: &mut Rng, len: usize| -> Vec<f64> { rng.f32s(len, -1.0, 1.0).into_iter().map(|v| round(t, v as f64)).collect() };
    for (offset, bias_offset) in [(1usize, 0usize), (4, 0), (8, 0), (32, 0), (0, 1)] {
        let name = format!("operands {offset} bf16 elements past an allocation, the bias {bias_offset}");
        let (a, b, bias) = (vals(&mut rng, offset + m * k), vals(&mut rng, offset + k * n), vals(&mut rng, bias_offset + n));
        let (da, db, dbias) = (upload(gpu_, t, &a), upload(gpu_, t, &b), upload(gpu_, t, &bias));
        let dd = upload(gpu_, t, &vec![f64::NAN; offset + m * n]);
        let at = |buf: &crate::backend::cuda::launch::DeviceBuffer, elems: usize| buf.ptr() + 2 * elems as u64;
        let g = Gemm::contiguous(1, m, n, k, false, false, t);
        let taken = blas(gpu_)
            .gemm_epilogue(
                std::ptr::null_mut(),
                &g,
                at(&da, offset),
                at(&db, offset),
                0,
                at(&dd, offset),
                Epilogue::Bias(at(&dbias, bias_offset)),
            )
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        gpu_.synchronize().unwrap_or_else(|e| panic!("{name}: {e}"));
        let got = download(t, &dd);
        if bias_offset % 8 != 0 {
            assert!(!taken, "{name}: a bias off 16 bytes must be declined");
        }
        if !taken {
            assert!(got.iter().all(|v| v.is_nan()), "{name}: declined, yet D was written");
            continue;
        }
        for i in 0..m {
            for j in 0..n {
                let (mut s, mut scale) = (bias[bias_offset + j], bias[bias_offset + j].abs());
                for l in 0..k {
                    let p = a[offset + i * k + l] * b[offset + l * n + j];
                    s += p;
                    scale += p.abs();
                }
                let v = got[offset + i * n + j];
                assert!((v - s).abs() <= 8e-3 * scale, "{name}: [{i}, {j}] got {v}, expected {s}");
            }
        }
    }
}

/// The derivative of the tanh-approximated GELU at x (PyTorch's `gelu(approximate="tanh")`).
fn gelu_tanh_slope(x: f64) -> f64 {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let t = (k * (x + 0.044715 * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x)
}

/// DGELU: every product element times the GELU's slope at the same element of the GELU input
/// (D's type and layout), for f32, bf16 and f16 and every transpose combination, GELU inputs
/// over [-4, 4] (both tails and the bend); with DGELU_BGRAD also the sums of D's rows. A row
/// length that is not a multiple of 8 (cuBLASLt wants the input's leading dimension so) and a
/// GELU input off 16 bytes are declined with nothing queued.
#[test]
fn gpu_gelu_grad_epilogue_multiplies_the_product_by_the_gelu_slope() {
    let Some(gpu_) = gpu("gpu_gelu_grad_epilogue_multiplies_the_product_by_the_gelu_slope") else { return };
    let mut rng = Rng::new(71);
    let (m, k) = (37, 40);
    for (t, rtol) in [(GemmType::F32, 2e-6), (GemmType::Bf16, 8e-3), (GemmType::F16, 1e-3)] {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            for (n, aux_offset, with_sums) in [(24usize, 0usize, false), (24, 0, true), (20, 0, true), (24, 1, false)] {
                let name = format!("{t:?}, trans_a {ta}, trans_b {tb}, n {n}, the GELU input {aux_offset} elements in, sums {with_sums}");
                let mut g = Gemm::contiguous(1, m, n, k, ta, tb, t);
                g.f32_mode = F32Mode::Exact;
                g.alpha = 0.5;
                let vals = |rng: &mut Rng, len: usize, r: f32| -> Vec<f64> {
                    rng.f32s(len, -r, r).into_iter().map(|v| round(t, v as f64)).collect()
                };
                let (a, b, aux) = (vals(&mut rng, m * k, 1.0), vals(&mut rng, k * n, 1.0), vals(&mut rng, aux_offset + m * n, 4.0));
                let (da, db, daux) = (upload(gpu_, t, &a), upload(gpu_, t, &b), upload(gpu_, t, &aux));
                let (dd, dsums) = (upload(gpu_, t, &vec![f64::NAN; m * n]), upload(gpu_, t, &vec![f64::NAN; n]));
                let aux_ptr = daux.ptr() + (aux_offset * t.size()) as u64;
                let bias_grad = if with_sums { dsums.ptr() } else { 0 };
                let taken = blas(gpu_)
                    .gemm_epilogue(
                        std::ptr::null_mut(),
                        &g,
                        da.ptr(),
                        db.ptr(),
                        0,
                        dd.ptr(),
                        Epilogue::GeluGrad { aux: aux_ptr, bias_grad },
                    )
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                gpu_.synchronize().unwrap_or_else(|e| panic!("{name}: {e}"));
                let (got, sums) = (download(t, &dd), download(t, &dsums));
                if n % 8 != 0 || (aux_offset * t.size()) % 16 != 0 {
                    assert!(!taken, "{name}: must be declined");
                    assert!(got.iter().chain(&sums).all(|v| v.is_nan()), "{name}: declined, yet D or the sums were written");
                    continue;
                }
                assert!(taken, "{name}: cuBLASLt has no kernel for it");
                let (mut want_sums, mut sum_scale) = (vec![0.0; n], vec![0.0; n]);
                for i in 0..m {
                    for j in 0..n {
                        let (mut s, mut scale) = (0.0, 0.0);
                        for l in 0..k {
                            let p = (if ta { a[l * m + i] } else { a[i * k + l] }) * (if tb { b[j * k + l] } else { b[l * n + j] });
                            s += p;
                            scale += p.abs();
                        }
                        let slope = gelu_tanh_slope(aux[aux_offset + i * n + j]);
                        let want = slope * g.alpha * s;
                        let bound = rtol * (slope.abs().max(1.0) * g.alpha * scale).max(1e-30);
                        want_sums[j] += want;
                        sum_scale[j] += bound / rtol;
                        let v = got[i * n + j];
                        assert!((v - want).abs() <= bound, "{name}: [{i}, {j}] got {v}, expected {want}");
                    }
                }
                if with_sums {
                    for j in 0..n {
                        let (v, want) = (sums[j], want_sums[j]);
                        assert!((v - want).abs() <= rtol * sum_scale[j], "{name}: the sum of column {j} is {v}, expected {want}");
                    }
                } else {
                    assert!(sums.iter().all(|v| v.is_nan()), "{name}: no sums asked for, yet written");
                }
            }
        }
    }
}

/// GELU_AUX_BIAS (GELU_AUX without a bias): the product plus the bias written to the aux matrix
/// (D's type and layout) and its tanh-approximated GELU to D, for f32, bf16 and f16 and both
/// orientations of B (a Linear's); products over [-6, 6] (both tails and the bend). A row
/// length that is not a multiple of 8 and an aux matrix off 16 bytes are declined with nothing
/// queued.
#[test]
fn gpu_gelu_epilogue_writes_the_biased_product_and_its_gelu() {
    let Some(gpu_) = gpu("gpu_gelu_epilogue_writes_the_biased_product_and_its_gelu") else { return };
    let gelu = |x: f64| 0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh());
    let mut rng = Rng::new(73);
    let (m, k) = (37, 40);
    for (t, rtol) in [(GemmType::F32, 2e-6), (GemmType::Bf16, 8e-3), (GemmType::F16, 1e-3)] {
        for tb in [false, true] {
            for (n, aux_offset, with_bias) in [(24usize, 0usize, false), (24, 0, true), (20, 0, true), (24, 1, true)] {
                let name = format!("{t:?}, trans_b {tb}, n {n}, aux {aux_offset} elements in, bias {with_bias}");
                let mut g = Gemm::contiguous(1, m, n, k, false, tb, t);
                g.f32_mode = F32Mode::Exact;
                let vals = |rng: &mut Rng, len: usize, r: f32| -> Vec<f64> {
                    rng.f32s(len, -r, r).into_iter().map(|v| round(t, v as f64)).collect()
                };
                let (a, b, bias) = (vals(&mut rng, m * k, 1.0), vals(&mut rng, k * n, 0.6), vals(&mut rng, n, 2.0));
                let (da, db, dbias) = (upload(gpu_, t, &a), upload(gpu_, t, &b), upload(gpu_, t, &bias));
                let (dd, daux) = (upload(gpu_, t, &vec![f64::NAN; m * n]), upload(gpu_, t, &vec![f64::NAN; aux_offset + m * n]));
                let aux_ptr = daux.ptr() + (aux_offset * t.size()) as u64;
                let epilogue = Epilogue::Gelu { aux: aux_ptr, bias: if with_bias { dbias.ptr() } else { 0 } };
                let taken = blas(gpu_)
                    .gemm_epilogue(std::ptr::null_mut(), &g, da.ptr(), db.ptr(), 0, dd.ptr(), epilogue)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                gpu_.synchronize().unwrap_or_else(|e| panic!("{name}: {e}"));
                let (got, aux) = (download(t, &dd), download(t, &daux));
                if n % 8 != 0 || (aux_offset * t.size()) % 16 != 0 {
                    assert!(!taken, "{name}: must be declined");
                    assert!(got.iter().chain(&aux).all(|v| v.is_nan()), "{name}: declined, yet D or aux was written");
                    continue;
                }
                assert!(taken, "{name}: cuBLASLt has no kernel for it");
                for i in 0..m {
                    for j in 0..n {
                        let (mut s, mut scale) = (if with_bias { bias[j] } else { 0.0 }, 0.0);
                        for l in 0..k {
                            let p = a[i * k + l] * (if tb { b[j * k + l] } else { b[l * n + j] });
                            s += p;
                            scale += p.abs();
                        }
                        let bound = rtol * (scale + s.abs()).max(1e-30);
                        let (pre, h) = (aux[aux_offset + i * n + j], got[i * n + j]);
                        assert!((pre - s).abs() <= bound, "{name}: aux [{i}, {j}] got {pre}, expected {s}");
                        // the GELU's slope is within [-0.13, 1.13]: the sum's error, then D's rounding
                        let want = gelu(s);
                        assert!((h - want).abs() <= 1.13 * bound + rtol * want.abs(), "{name}: D [{i}, {j}] got {h}, expected {want}");
                    }
                }
            }
        }
    }
}
