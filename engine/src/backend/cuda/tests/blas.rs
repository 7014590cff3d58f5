//! cuBLAS matrix products against an f64 host reference: every transpose combination, batches
//! with a broadcast operand, row strides wider than the matrix, alpha/beta, f64, bf16/f16
//! operands with f32 or 16-bit results, TF32 on request, the runtime's mixed-precision gemms
//! (operands rounded to bf16/f16 to nearest, half_gemm.rs); and the speed of large products
//! (printed, for doc/GPU-RUNS.md).

use super::support::*;
use crate::backend::cuda::blas::{F32Mode, Gemm, GemmType};

/// The reference: C = alpha·op(A)·op(B) + beta·C0 in f64, with Gemm's row-major layout.
fn reference(g: &Gemm, a: &[f64], b: &[f64], c0: &[f64]) -> Vec<f64> {
    let mut c = c0.to_vec();
    for bi in 0..g.batch {
        for i in 0..g.m {
            for j in 0..g.n {
                let mut s = 0.0;
                for l in 0..g.k {
                    let av = if g.trans_a { a[bi * g.stride_a + l * g.lda + i] } else { a[bi * g.stride_a + i * g.lda + l] };
                    let bv = if g.trans_b { b[bi * g.stride_b + j * g.ldb + l] } else { b[bi * g.stride_b + l * g.ldb + j] };
                    s += av * bv;
                }
                let at = bi * g.stride_c + i * g.ldc + j;
                c[at] = g.alpha * s + g.beta * c0[at];
            }
        }
    }
    c
}

/// Elements each operand's buffer needs.
fn extent(batch: usize, stride: usize, rows: usize, ld: usize) -> usize {
    (batch - 1) * stride + rows * ld
}

/// Runs `g` on random data of its types and compares with the reference; `rtol` relative to
/// the sum of |products| of each element (so cancellation does not blow the tolerance up).
fn check(name: &str, g: &Gemm, rng: &mut Rng, rtol: f64) {
    let gpu_ = super::support::gpu_or_reason().expect("called under gpu()");
    let (a_rows, b_rows) = (if g.trans_a { g.k } else { g.m }, if g.trans_b { g.n } else { g.k });
    let na = extent(g.batch, g.stride_a, a_rows, g.lda);
    let nb = extent(g.batch, g.stride_b, b_rows, g.ldb);
    let nc = extent(g.batch, g.stride_c, g.m, g.ldc);
    let round = |t: GemmType, v: f32| -> f64 {
        match t {
            GemmType::Bf16 => bf16_value(bf16_bits(v)) as f64,
            GemmType::F16 => f16_value(f16_bits(v)) as f64,
            _ => v as f64,
        }
    };
    let a: Vec<f64> = rng.f32s(na, -1.0, 1.0).into_iter().map(|v| round(g.ab_type, v)).collect();
    let b: Vec<f64> = rng.f32s(nb, -1.0, 1.0).into_iter().map(|v| round(g.ab_type, v)).collect();
    let c0: Vec<f64> = rng.f32s(nc, -1.0, 1.0).into_iter().map(|v| round(g.c_type, v)).collect();
    let upload = |t: GemmType, v: &[f64]| match t {
        GemmType::F64 => dev(gpu_, v),
        GemmType::F32 => dev(gpu_, &v.iter().map(|&x| x as f32).collect::<Vec<_>>()),
        GemmType::Bf16 => dev(gpu_, &v.iter().map(|&x| bf16_bits(x as f32)).collect::<Vec<_>>()),
        GemmType::F16 => dev(gpu_, &v.iter().map(|&x| f16_bits(x as f32)).collect::<Vec<_>>()),
    };
    let (da, db, dc) = (upload(g.ab_type, &a), upload(g.ab_type, &b), upload(g.c_type, &c0));
    blas(gpu_).gemm(std::ptr::null_mut(), g, da.ptr(), db.ptr(), dc.ptr()).unwrap_or_else(|e| panic!("{name}: {e}"));
    gpu_.synchronize().unwrap_or_else(|e| panic!("{name}: {e}"));
    let got: Vec<f64> = match g.c_type {
        GemmType::F64 => host::<f64>(&dc),
        GemmType::F32 => host::<f32>(&dc).into_iter().map(f64::from).collect(),
        GemmType::Bf16 => host::<u16>(&dc).into_iter().map(|x| bf16_value(x) as f64).collect(),
        GemmType::F16 => host::<u16>(&dc).into_iter().map(|x| f16_value(x) as f64).collect(),
    };
    let want = reference(g, &a, &b, &c0);
    let abs = reference(
        &Gemm { alpha: g.alpha.abs(), beta: g.beta.abs(), ..*g },
        &a.iter().map(|x| x.abs()).collect::<Vec<_>>(),
        &b.iter().map(|x| x.abs()).collect::<Vec<_>>(),
        &c0.iter().map(|x| x.abs()).collect::<Vec<_>>(),
    );
    // only the elements C covers (padding columns of a wide ldc must stay untouched: c0)
    for (i, ((&gv, &wv), &scale)) in got.iter().zip(&want).zip(&abs).enumerate() {
        assert!(
            (gv - wv).abs() <= rtol * scale.max(1e-30),
            "{name}: element {i}: got {gv}, expected {wv} (scale {scale}, rtol {rtol}) {g:?}"
        );
    }
}

#[test]
fn gpu_gemm_matches_the_f64_reference() {
    let Some(_) = gpu("gpu_gemm_matches_the_f64_reference") else { return };
    let mut rng = Rng::new(7);
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        for t in [GemmType::F32, GemmType::F64] {
            let g = Gemm::contiguous(3, 37, 29, 53, ta, tb, t);
            check(&format!("{t:?} trans_a={ta} trans_b={tb}"), &g, &mut rng, if t == GemmType::F64 { 1e-13 } else { 2e-6 });
        }
    }
    // a broadcast operand (batch stride 0), wide row strides, alpha and beta
    let mut g = Gemm::contiguous(4, 16, 24, 40, false, true, GemmType::F32);
    g.stride_b = 0;
    g.lda = 47;
    g.stride_a = 16 * 47;
    g.ldc = 30;
    g.stride_c = 16 * 30;
    g.alpha = 0.5;
    g.beta = -2.0;
    check("f32 broadcast B, lda 47, ldc 30, alpha 0.5, beta -2", &g, &mut rng, 2e-6);
    // one row / one column / k = 1
    check("f32 m=1", &Gemm::contiguous(1, 1, 300, 7, false, false, GemmType::F32), &mut rng, 2e-6);
    check("f32 n=1", &Gemm::contiguous(2, 300, 1, 7, true, false, GemmType::F32), &mut rng, 2e-6);
    check("f32 k=1", &Gemm::contiguous(2, 9, 11, 1, false, true, GemmType::F32), &mut rng, 2e-6);
}

#[test]
fn gpu_gemm_16_bit_operands_accumulate_in_f32() {
    let Some(_) = gpu("gpu_gemm_16_bit_operands_accumulate_in_f32") else { return };
    let mut rng = Rng::new(11);
    for t in [GemmType::Bf16, GemmType::F16] {
        for (ta, tb) in [(false, false), (true, false), (false, true)] {
            // f32 results: products of 16-bit values are exact in f32, only the f32 sum rounds
            let mut g = Gemm::contiguous(2, 64, 48, 256, ta, tb, t);
            g.c_type = GemmType::F32;
            check(&format!("{t:?}→f32 trans_a={ta} trans_b={tb}"), &g, &mut rng, 2e-6);
            // 16-bit results: one rounding of the f32 result
            let g = Gemm::contiguous(2, 64, 48, 256, ta, tb, t);
            check(
                &format!("{t:?}→{t:?} trans_a={ta} trans_b={tb}"),
                &g,
                &mut rng,
                if t == GemmType::Bf16 { 1.0 / 128.0 } else { 1.0 / 1024.0 },
            );
        }
    }
}

#[test]
fn gpu_gemm_tf32_only_when_asked() {
    let Some(_) = gpu("gpu_gemm_tf32_only_when_asked") else { return };
    let mut rng = Rng::new(13);
    let mut g = Gemm::contiguous(1, 128, 128, 512, false, false, GemmType::F32);
    check("f32 no TF32 (tight)", &g, &mut rng, 2e-6);
    g.f32_mode = F32Mode::Tf32;
    // TF32 keeps 10 mantissa bits of each operand
    check("f32 with TF32", &g, &mut rng, 2e-3);
}

/// `precision="bf16"` on CUDA: f32 operands multiplied on bf16 tensor cores with f32
/// accumulation, f32 in and out; every transpose combination and a broadcast batch. The result
/// is within bf16's rounding of the exact product (each operand off by at most 2^-8 relative,
/// whatever rounding cuBLAS uses) and not the exact f32 product. Which rounding it is (to
/// nearest, or toward zero) is printed for doc/GPU-RUNS.md.
#[test]
fn gpu_gemm_f32_operands_as_bf16() {
    let Some(gpu_) = gpu("gpu_gemm_f32_operands_as_bf16") else { return };
    let mut rng = Rng::new(17);
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let mut g = Gemm::contiguous(3, 64, 48, 256, ta, tb, GemmType::F32);
        g.stride_b = if tb { 0 } else { g.stride_b };
        g.f32_mode = F32Mode::Bf16;
        let (a_rows, b_rows) = (if ta { g.k } else { g.m }, if tb { g.n } else { g.k });
        let a = rng.f32s(extent(g.batch, g.stride_a, a_rows, g.lda), -1.0, 1.0);
        let b = rng.f32s(extent(g.batch, g.stride_b, b_rows, g.ldb), -1.0, 1.0);
        let (da, db, dc) = (dev(gpu_, &a), dev(gpu_, &b), dev(gpu_, &vec![0f32; g.batch * g.m * g.n]));
        blas(gpu_).gemm(std::ptr::null_mut(), &g, da.ptr(), db.ptr(), dc.ptr()).unwrap_or_else(|e| panic!("{e}"));
        gpu_.synchronize().unwrap();
        let got: Vec<f64> = host::<f32>(&dc).into_iter().map(f64::from).collect();
        let nearest = |v: &[f32]| v.iter().map(|&x| bf16_value(bf16_bits(x)) as f64).collect::<Vec<f64>>();
        let toward_zero = |v: &[f32]| v.iter().map(|&x| f32::from_bits(x.to_bits() & 0xffff_0000) as f64).collect::<Vec<f64>>();
        let exact = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let abs = |v: &[f32]| v.iter().map(|&x| x.abs() as f64).collect::<Vec<f64>>();
        let zero = vec![0.0; got.len()];
        let full = reference(&g, &exact(&a), &exact(&b), &zero);
        let scale = reference(&g, &abs(&a), &abs(&b), &zero);
        let max_off = |want: &[f64]| got.iter().zip(want).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        let (off_near, off_zero) = (
            max_off(&reference(&g, &nearest(&a), &nearest(&b), &zero)),
            max_off(&reference(&g, &toward_zero(&a), &toward_zero(&b), &zero)),
        );
        let mut worst = 0f64;
        let mut rounded = false;
        for ((&gv, &fv), &sc) in got.iter().zip(&full).zip(&scale) {
            worst = worst.max((gv - fv).abs() / sc.max(1e-30));
            rounded |= (gv - fv).abs() > 1e-5 * sc;
        }
        println!("bf16 gemm trans_a={ta} trans_b={tb}: off the exact product by {worst:.2e} of Σ|ab| at most; off the round-to-nearest bf16 product by {off_near:.2e}, the truncated one by {off_zero:.2e}");
        // bf16 keeps 8 significant bits: an operand is off by 2^-7 relative at most (toward
        // zero; 2^-8 to nearest), a product by about twice that, plus f32 accumulation
        assert!(worst <= 1.0 / 32.0, "trans_a={ta} trans_b={tb}: {worst} of Σ|ab| from the exact product");
        assert!(rounded, "trans_a={ta} trans_b={tb}: the exact f32 product: the operands were not rounded to bf16");
    }
}

/// The runtime's gemm in a mixed-precision mode rounds both f32 operands to the 16-bit type
/// (nearest even) and accumulates in f32: within f32 accumulation of the product of the rounded
/// operands, and not the f32 product. Transposes, a broadcast operand and a row stride wider
/// than the matrix.
#[test]
fn gpu_runtime_mixed_precision_gemms_multiply_rounded_operands() {
    let Some(gpu_) = gpu("gpu_runtime_mixed_precision_gemms_multiply_rounded_operands") else { return };
    let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
    let mut rng = Rng::new(29);
    type Round = fn(f32) -> f32;
    let modes: [(F32Mode, Round); 2] = [(F32Mode::Bf16, |x| bf16_value(bf16_bits(x))), (F32Mode::F16, |x| f16_value(f16_bits(x)))];
    for (mode, round) in modes {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let mut g = Gemm::contiguous(3, 64, 48, 200, ta, tb, GemmType::F32);
            g.f32_mode = mode;
            g.stride_b = if tb { 0 } else { g.stride_b };
            g.lda += 3; // rows wider than the matrix: the gap is rounded too, and never read
            g.stride_a = g.lda * if ta { g.k } else { g.m };
            let (a_rows, b_rows) = (if ta { g.k } else { g.m }, if tb { g.n } else { g.k });
            let a = rng.f32s(extent(g.batch, g.stride_a, a_rows, g.lda), -1.0, 1.0);
            let b = rng.f32s(extent(g.batch, g.stride_b, b_rows, g.ldb), -1.0, 1.0);
            let (da, db, dc) = (dev(gpu_, &a), dev(gpu_, &b), dev(gpu_, &vec![0f32; g.batch * g.m * g.n]));
            rt.gemm(std::ptr::null_mut(), &g, da.ptr(), db.ptr(), dc.ptr()).unwrap_or_else(|e| panic!("{e}"));
            gpu_.synchronize().unwrap();
            let got: Vec<f64> = host::<f32>(&dc).into_iter().map(f64::from).collect();
            let f = |v: &[f32], r: &dyn Fn(f32) -> f32| v.iter().map(|&x| r(x) as f64).collect::<Vec<f64>>();
            let zero = vec![0.0; got.len()];
            let rounded = reference(&g, &f(&a, &round), &f(&b, &round), &zero);
            let exact = reference(&g, &f(&a, &|x| x), &f(&b, &|x| x), &zero);
            let scale = reference(&g, &f(&a, &|x: f32| x.abs()), &f(&b, &|x: f32| x.abs()), &zero);
            let (mut off_rounded, mut off_exact) = (0f64, 0f64);
            for i in 0..got.len() {
                off_rounded = off_rounded.max((got[i] - rounded[i]).abs() / scale[i].max(1e-30));
                off_exact = off_exact.max((got[i] - exact[i]).abs() / scale[i].max(1e-30));
            }
            println!("{mode:?} trans_a={ta} trans_b={tb}: off the rounded-operand product by {off_rounded:.2e}, the f32 one by {off_exact:.2e} (of Σ|ab|)");
            assert!(off_rounded < 1e-5, "{mode:?} trans_a={ta} trans_b={tb}: {off_rounded:.2e} from the product of rounded operands");
            // an f32 product is within ~1e-7 of Σ|ab|; rounding 200 operand pairs moves it by ~1e-5 (f16) and more
            assert!(off_exact > 5e-6, "{mode:?} trans_a={ta} trans_b={tb}: the f32 product: operands not rounded");
        }
    }
}

#[test]
fn gpu_gemm_speed() {
    let Some(g) = gpu_for_timing("gpu_gemm_speed") else { return };
    let n = 8192usize;
    for (t, mode) in
        [(GemmType::Bf16, F32Mode::Exact), (GemmType::F32, F32Mode::Exact), (GemmType::F32, F32Mode::Tf32), (GemmType::F32, F32Mode::Bf16)]
    {
        let mut desc = Gemm::contiguous(1, n, n, n, false, false, t);
        desc.f32_mode = mode;
        let (a, b, c) = (zeros::<u8>(g, n * n * t.size()), zeros::<u8>(g, n * n * t.size()), zeros::<u8>(g, n * n * t.size()));
        let bl = blas(g);
        let go = || bl.gemm(std::ptr::null_mut(), &desc, a.ptr(), b.ptr(), c.ptr()).unwrap_or_else(|e| panic!("{e}"));
        // the executor's path: mixed-precision f32 gemms with operands rounded first (half_gemm.rs)
        if mode == F32Mode::Bf16 {
            let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
            let run = || rt.gemm(std::ptr::null_mut(), &desc, a.ptr(), b.ptr(), c.ptr()).unwrap_or_else(|e| panic!("{e}"));
            run();
            g.synchronize().unwrap();
            let t0 = std::time::Instant::now();
            for _ in 0..20 {
                run();
            }
            g.synchronize().unwrap();
            let s = t0.elapsed().as_secs_f64() / 20.0;
            println!(
                "gemm {n}³ F32 Bf16 through the runtime (operands rounded to bf16 first): {:.3} ms, {:.0} TFLOP/s (zeros)",
                s * 1e3,
                2.0 * (n as f64).powi(3) / s / 1e12
            );
        }
        for _ in 0..3 {
            go();
        }
        g.synchronize().unwrap();
        let reps = if t == GemmType::Bf16 { 20 } else { 5 };
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            go();
        }
        g.synchronize().unwrap();
        let s = t0.elapsed().as_secs_f64() / reps as f64;
        println!("gemm {n}³ {t:?} {mode:?}: {:.3} ms, {:.0} TFLOP/s (zeros)", s * 1e3, 2.0 * (n as f64).powi(3) / s / 1e12);
    }
}

/// The runtime's vectors of ones (the sums by gemm: bias gradients, LinearCrossEntropy's db,
/// Conv's weight and bias gradients) hold 1.0 in every float type. 16-bit ones were f32 ones
/// before, which a 16-bit gemm reads as 0, 1, 0, 1, ….
#[test]
fn gpu_ones_are_one_in_every_float_type() {
    let Some(g) = gpu("gpu_ones_are_one_in_every_float_type") else { return };
    let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
    let n = 5000;
    for (t, one) in
        [(GemmType::F32, 1f32.to_bits() as u64), (GemmType::F64, 1f64.to_bits()), (GemmType::Bf16, 0x3F80), (GemmType::F16, 0x3C00)]
    {
        let addr = rt.ones(std::ptr::null_mut(), t, n).unwrap_or_else(|e| panic!("{e}"));
        g.synchronize().unwrap();
        let mut bytes = vec![0u8; n * t.size()];
        // SAFETY: `ones` returned a live buffer of at least n elements of t.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut bytes, addr) }.unwrap_or_else(|e| panic!("{e}"));
        for (i, c) in bytes.chunks_exact(t.size()).enumerate() {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            assert_eq!(u64::from_le_bytes(b), one, "{t:?}: element {i} of the ones");
        }
    }
}
