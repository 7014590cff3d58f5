//! What every GPU parity test uses: the loaded kernels (once per process, or the reason there is
//! no GPU), device buffers from host data, a seeded random source, 16-bit float conversions and
//! tolerance checks that name the first mismatching element.

use std::path::PathBuf;
use std::sync::OnceLock;

use crate::backend::cuda::launch::{DeviceBuffer, Grid, KArg};
use crate::backend::cuda::loader::{self, Loaded};
use crate::backend::cuda::{cache, nvrtc, probe};

/// The kernels loaded on GPU 0, or why not.
pub fn gpu_or_reason() -> Result<&'static Loaded, String> {
    static LOADED: OnceLock<Result<Loaded, String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            probe().map_err(|e| e.to_string())?;
            let wheels = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cuda-wheels/nvidia/cu13/lib");
            let nv = nvrtc::load(&[wheels]).map_err(|e| format!("a GPU but no NVRTC: {e}"))?;
            loader::load_all(0, nv, cache::default_dir().as_deref()).map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| e.clone())
}

/// The loaded kernels, or `None` after printing why the calling test is skipped. A machine that
/// has a GPU but fails to load the kernels fails the test instead (that is a bug, not a skip).
pub fn gpu(test: &str) -> Option<&'static Loaded> {
    match gpu_or_reason() {
        Ok(l) => Some(l),
        Err(reason) => {
            if probe().is_ok() {
                panic!("{test}: the GPU is there but the kernels did not load: {reason}");
            }
            eprintln!("SKIPPED {test}: {reason}");
            None
        }
    }
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

/// `v` rounded (to nearest even) to the storage type `dtype`, as f64.
pub fn round_to(dtype: &str, v: f64) -> f64 {
    match dtype {
        "f64" => v,
        "f32" => v as f32 as f64,
        "bf16" => half::bf16::from_f64(v).to_f64(),
        "f16" => half::f16::from_f64(v).to_f64(),
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
