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

/// A cuBLAS handle in GPU 0's context (cuBLAS found by name, beside NVRTC, or in the pinned
/// wheels' folder); panics with the reason on a GPU machine without cuBLAS.
pub fn blas(g: &Loaded) -> &'static crate::backend::cuda::blas::Blas {
    use crate::backend::cuda::blas;
    static BLAS: OnceLock<blas::Blas> = OnceLock::new();
    BLAS.get_or_init(|| {
        g.ctx.bind_to_thread().expect("binding the context");
        let mut dirs = vec![PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cuda-wheels/nvidia/cu13/lib")];
        if let Some(p) = std::env::var_os("ORTRAIN_NVRTC_LIB") {
            let p = PathBuf::from(p);
            dirs.push(if p.is_dir() { p } else { p.parent().map(PathBuf::from).unwrap_or_default() });
        }
        blas::load(&dirs).unwrap_or_else(|e| panic!("{e}"));
        blas::Blas::new().unwrap_or_else(|e| panic!("{e}"))
    })
}
