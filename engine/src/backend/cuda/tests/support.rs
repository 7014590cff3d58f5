//! What every GPU parity test uses: the loaded kernels (once per process, or the reason there is
//! no GPU), device buffers from host data, a seeded random source, 16-bit float conversions and
//! tolerance checks that name the first mismatching element.

use std::path::PathBuf;

pub use super::dry_target::*;
use super::gpu_lock;
pub use super::typed_bytes::*;
use crate::backend::cuda::blas::F32Mode;
use crate::backend::cuda::claim::Claim;
use crate::backend::cuda::launch::{DeviceBuffer, Grid, KArg};
use crate::backend::cuda::loader::Loaded;
use crate::backend::cuda::ops::CudaCtx;
use crate::backend::cuda::probe;
use crate::backend::cuda::runtime::{self, CudaRuntime};
use crate::tensor::Tensor;

/// GPU 0's runtime (kernels, cuBLAS), the one the executor uses, or why not. NVRTC and cuBLAS
/// come from the pinned wheels' folder, or ORTRAIN_NVRTC_LIB's folder, or the loader's path.
pub fn runtime_or_reason() -> Result<&'static CudaRuntime, String> {
    runtime_on(0)
}

/// GPU `ordinal`'s runtime, or why not (as [`runtime_or_reason`]).
pub fn runtime_on(ordinal: usize) -> Result<&'static CudaRuntime, String> {
    probe().map_err(|e| e.to_string())?;
    let mut dirs = vec![PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cuda-wheels/nvidia/cu13/lib")];
    if let Some(p) = std::env::var_os("ORTRAIN_NVRTC_LIB") {
        let p = PathBuf::from(p);
        dirs.push(if p.is_dir() { p } else { p.parent().map(PathBuf::from).unwrap_or_default() });
    }
    runtime::runtime(ordinal, &dirs).map_err(|e| e.to_string())
}

/// A context for calling an op's kernels directly on the legacy stream, and the claim on the
/// runtime's shared buffers (claim.rs) to hold until the results are downloaded: the tests run on
/// parallel threads, and two direct calls using the one scratch region (GatherGrad's sort, the
/// flash backward's Δ) would otherwise read each other's data.
pub fn direct_ctx(f32_mode: F32Mode, error_flag: u64) -> (CudaCtx<'static>, Claim<'static>) {
    let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
    let claim = rt.claim(std::ptr::null_mut()).unwrap_or_else(|e| panic!("claiming the shared buffers: {e}"));
    (CudaCtx { rt, stream: std::ptr::null_mut(), seed: 1, seed_slot: 0, f32_mode, error_flag, error_base: 0 }, claim)
}

/// The kernels loaded on GPU 0, or why not.
pub fn gpu_or_reason() -> Result<&'static Loaded, String> {
    runtime_or_reason().map(|rt| &rt.loaded)
}

/// As `gpu`, for a test that records CUDA graphs: no other GPU test runs beside it.
pub fn gpu_alone(test: &str) -> Option<&'static Loaded> {
    gpu_lock::hold(true);
    gpu(test)
}

/// The loaded kernels, or `None` after printing why the calling test is skipped. A machine that
/// has a GPU but fails to load the kernels fails the test instead (that is a bug, not a skip).
/// The context is made current on the test's thread, as PyTorch's is on the thread that steps:
/// runtime calls without a launch first (`CudaRuntime::ones`) fail with
/// CUDA_ERROR_INVALID_CONTEXT on a thread that never had it (first seen on an H200).
pub fn gpu(test: &str) -> Option<&'static Loaded> {
    gpu_lock::hold(false);
    match gpu_or_reason() {
        Ok(l) => {
            runtime_or_reason().and_then(|rt| rt.bind().map_err(|e| e.to_string())).unwrap_or_else(|e| panic!("{test}: {e}"));
            Some(l)
        }
        Err(reason) => {
            if probe().is_ok() {
                panic!("{test}: the GPU is there but the kernels did not load: {reason}");
            }
            eprintln!("SKIPPED {test}: {reason}");
            None
        }
    }
}

/// Whether GPU 0 is cuda-emu (cuda-emu/README.md: the kernels run on the CPU), which names its
/// device so.
pub fn emulated() -> bool {
    gpu_or_reason().is_ok_and(|l| l.ctx.name().is_ok_and(|n| n.contains("cuda-emu")))
}

/// The GPU for a test that measures speed, or `None` after printing why it is skipped: no GPU,
/// or the CPU emulator, whose timings say nothing about a GPU.
pub fn gpu_for_timing(test: &str) -> Option<&'static Loaded> {
    let g = gpu(test)?;
    if emulated() {
        eprintln!("SKIPPED {test}: a timing, and this is cuda-emu (the CPU emulator), not a GPU");
        return None;
    }
    Some(g)
}

/// Uploads `data`.
pub fn dev<T: Copy>(g: &Loaded, data: &[T]) -> DeviceBuffer {
    DeviceBuffer::from_slice(&g.ctx, data).unwrap_or_else(|e| panic!("{e}"))
}

/// A zeroed buffer of `n` elements of `T`.
pub fn zeros<T>(g: &Loaded, n: usize) -> DeviceBuffer {
    DeviceBuffer::zeroed(&g.ctx, n * std::mem::size_of::<T>()).unwrap_or_else(|e| panic!("{e}"))
}

/// Downloads a buffer as `T`s.
pub fn host<T: Copy + Default>(b: &DeviceBuffer) -> Vec<T> {
    b.to_vec::<T>().unwrap_or_else(|e| panic!("{e}"))
}

/// Launches and waits, panicking with the kernel's name on any error (a fault included).
pub fn run(g: &Loaded, kernel: &str, grid: Grid, args: &[KArg]) {
    g.launch(kernel, grid, args).unwrap_or_else(|e| panic!("{e}"));
    g.synchronize().unwrap_or_else(|e| panic!("{kernel}: {e}"));
}

/// SplitMix64: reproducible test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [lo, hi).
    pub fn f32(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32)
    }
    pub fn f32s(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32(lo, hi)).collect()
    }
    /// Uniform integer in [lo, hi).
    pub fn int(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next_u64() % (hi - lo) as u64) as i64
    }
}

/// f32 → bf16 bits, round to nearest even (what `cvt.rn.bf16.f32` does; NaN stays NaN).
pub fn bf16_bits(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}
pub fn bf16_value(bits: u16) -> f32 {
    half::bf16::from_bits(bits).to_f32()
}
/// f32 → f16 bits, round to nearest even.
pub fn f16_bits(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}
pub fn f16_value(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// Relative tolerance per kernel dtype suffix: f32 a few ulps of work, f64 tight, 16-bit floats
/// one rounding of the result (their compute is f32).
pub fn rtol(dtype: &str) -> f64 {
    match dtype {
        "f64" => 1e-12,
        "f32" => 1e-5,
        "bf16" => 1.0 / 128.0,
        "f16" => 1.0 / 1024.0,
        _ => 0.0,
    }
}

/// Asserts |got - want| <= atol + rtol·|want| elementwise (NaN matches NaN, infinities must
/// match exactly), naming the first bad element.
pub fn assert_close(what: &str, got: &[f64], want: &[f64], rtol: f64, atol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: {} elements, expected {}", got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() {
            g == w
        } else {
            (g - w).abs() <= atol + rtol * w.abs()
        };
        assert!(ok, "{what}: element {i}: got {g}, expected {w} (rtol {rtol}, atol {atol})");
    }
}

/// The runtime's cuBLAS handle (`g` is the runtime's loaded kernels, from [`gpu`]).
pub fn blas(_g: &Loaded) -> &'static crate::backend::cuda::blas::Blas {
    &runtime_or_reason().unwrap_or_else(|e| panic!("{e}")).blas
}

// ---- parity-b helpers

/// Bytes per element of a float kernel dtype suffix (f32 f64 bf16 f16).
pub fn float_size(dtype: &str) -> usize {
    match dtype {
        "f64" => 8,
        "f32" => 4,
        "bf16" | "f16" => 2,
        _ => panic!("{dtype} is not a float kernel dtype"),
    }
}

/// The compute/statistics type `A` of a float dtype (kernels/prelude.cuh `Num<T>::Acc`).
pub fn acc_of(dtype: &str) -> &'static str {
    if dtype == "f64" {
        "f64"
    } else {
        "f32"
    }
}

/// `v` rounded (to nearest even) to the storage type `dtype`, as f64. The 16-bit types round
/// through f32, as the kernels do (f32 arithmetic, one rounding on store): half 2.7's `from_f64`
/// drops the low 32 mantissa bits before rounding, so an f32 value just above a 16-bit tie
/// (0.76757842 = 0.767578125 + 5 ulps) is taken for the tie and rounded down to even.
pub fn round_to(dtype: &str, v: f64) -> f64 {
    match dtype {
        "f64" => v,
        "f32" => v as f32 as f64,
        "bf16" => half::bf16::from_f32(v as f32).to_f64(),
        "f16" => half::f16::from_f32(v as f32).to_f64(),
        _ => panic!("{dtype} is not a float kernel dtype"),
    }
}

pub fn rounded(dtype: &str, v: &[f64]) -> Vec<f64> {
    v.iter().map(|&x| round_to(dtype, x)).collect()
}

/// `n` values uniform in [lo, hi), rounded to `dtype` (so host and device see the same numbers).
pub fn rand_as(rng: &mut Rng, dtype: &str, n: usize, lo: f32, hi: f32) -> Vec<f64> {
    (0..n).map(|_| round_to(dtype, rng.f32(lo, hi) as f64)).collect()
}

/// Uploads `v` stored as `dtype`.
pub fn dev_as(g: &Loaded, dtype: &str, v: &[f64]) -> DeviceBuffer {
    match dtype {
        "f64" => dev(g, v),
        "f32" => dev(g, &v.iter().map(|&x| x as f32).collect::<Vec<f32>>()),
        "bf16" => dev(g, &v.iter().map(|&x| half::bf16::from_f64(x).to_bits()).collect::<Vec<u16>>()),
        "f16" => dev(g, &v.iter().map(|&x| half::f16::from_f64(x).to_bits()).collect::<Vec<u16>>()),
        _ => panic!("{dtype} is not a float kernel dtype"),
    }
}

/// A zeroed buffer of `n` elements of `dtype`.
pub fn zeros_as(g: &Loaded, dtype: &str, n: usize) -> DeviceBuffer {
    zeros::<u8>(g, n * float_size(dtype))
}

/// Downloads a buffer of `dtype` elements as f64.
pub fn host_as(b: &DeviceBuffer, dtype: &str) -> Vec<f64> {
    match dtype {
        "f64" => host::<f64>(b),
        "f32" => host::<f32>(b).into_iter().map(f64::from).collect(),
        "bf16" => host::<u16>(b).into_iter().map(|x| bf16_value(x) as f64).collect(),
        "f16" => host::<u16>(b).into_iter().map(|x| f16_value(x) as f64).collect(),
        _ => panic!("{dtype} is not a float kernel dtype"),
    }
}

/// An f64 CPU tensor: the references run the CPU kernels in f64 on the (already rounded)
/// inputs, so they carry no rounding of their own worth counting, for every kernel dtype.
pub fn t64(shape: &[usize], v: &[f64]) -> crate::tensor::Tensor {
    crate::tensor::Tensor::new(shape.to_vec(), crate::tensor::Data::F64(v.to_vec())).unwrap_or_else(|e| panic!("{e}"))
}

/// Absolute tolerance floor of elementwise results: f32 arithmetic (the compute type of f32,
/// bf16 and f16) on terms of order 1 near a zero of the result.
pub fn atol(dtype: &str) -> f64 {
    if dtype == "f64" {
        1e-12
    } else {
        2e-6
    }
}

pub fn max_abs(v: &[f64]) -> f64 {
    v.iter().filter(|x| x.is_finite()).fold(0.0, |m, &x| m.max(x.abs()))
}

/// `assert_close` with the absolute tolerance `rtol · max|want|`: for results of sums that can
/// cancel (normalisations, gradients of reductions), whose error is relative to the terms.
pub fn assert_close_scaled(what: &str, got: &[f64], want: &[f64], rtol: f64) {
    assert_close(what, got, want, rtol, rtol * max_abs(want));
}

/// Asserts that `checked` (kernel names whose argument lists a test checked) is exactly the
/// registered kernel list of `family`: the parity tests of that family launch every kernel.
pub fn assert_covers(family: &str, checked: &[String]) {
    let f = crate::backend::cuda::registry::FAMILIES.iter().find(|f| f.name == family).unwrap_or_else(|| panic!("no family {family}"));
    let mut c = checked.to_vec();
    c.sort();
    c.dedup();
    assert_eq!(c, f.kernel_names(), "{}: the kernels the tests launch vs the registered ones", f.file());
}

/// Checks a launch's arguments against the registry (the non-GPU half of every parity test).
pub fn check(kernel: &str, args: &[KArg]) {
    crate::backend::cuda::launch::check_args(kernel, args).unwrap_or_else(|e| panic!("{e}"));
}

// ---- shared by the family tests

/// Checks, for every kernel of `family`, the argument list its tests launch it with
/// (`args_of(op)`) against the registered signature.
pub fn check_family_args(family: &str, args_of: impl Fn(&str) -> Vec<KArg>) {
    let fam = crate::backend::cuda::registry::FAMILIES.iter().find(|f| f.name == family).expect("a registered family");
    for grp in fam.groups {
        for op in grp.ops {
            for t in grp.dtypes {
                let kernel = crate::backend::cuda::registry::kernel_name(op, t);
                crate::backend::cuda::launch::check_args(&kernel, &args_of(op)).unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }
}

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// A 1-D int64 tensor holding `shape` (a shape input).
pub fn shape_tensor(shape: &[usize]) -> Tensor {
    Tensor::from_i64(vec![shape.len()], shape.iter().map(|&d| d as i64).collect())
}
