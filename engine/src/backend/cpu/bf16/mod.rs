//! bf16 matmuls for the CPU backend (the `matmul_precision = "bf16"` mode, like PyTorch's CPU
//! autocast for matmuls): `C(f32) = alpha·A·B + beta·C` where A and B are f32 in memory, rounded
//! to bf16 (nearest even) while being packed into cache-blocked panels, and multiplied with f32
//! accumulation. Everything around the matmuls (weights, activations, gradients) stays f32.
//!
//! The kernel is chosen at run time from CPU features, never from compile-time target flags:
//! - `Amx`: Intel Xeon with amx_bf16 and amx_tile (tile state enabled and permitted by Linux);
//! - `Avx512Bf16`: `vdpbf16ps` (AMD Zen 4, Intel Cooper Lake and newer);
//! - neither: `MatmulPath::Fp32`; the matmul kernels use the f32 `gemm` crate path, so a bf16
//!   session computes exactly as an fp32 one, and says so in `MatmulPath::describe`.
//!
//! `ORTRAIN_CPU_BF16=off` runs as if the CPU had no bf16 instructions, `ORTRAIN_CPU_BF16=avx512_bf16`
//! skips AMX; a path the CPU lacks is never taken. Before its first use in a process the AMX
//! kernel makes a few exact products in a forked child (trial.rs); a crash, hang or wrong result
//! there keeps it off (avx512_bf16 runs instead) and `explain` says why.
//!
//! Why these kernels: on an AMD EPYC Zen 4 (avx512_bf16, no AMX) the 14 × 32 `vdpbf16ps` kernel
//! alone runs at 227 GFLOP/s on one thread from L1, 2.2x the 104 of the same shape of f32 FMAs,
//! and the whole GEMM beats the `gemm` crate's f32 on the tutorial's LM-head shapes (m × n × k,
//! operand layouts as the matmul kernels pass them; GFLOP/s, 2 threads on a machine shared with
//! other jobs, so the second core was often busy: medians of 11, two runs;
//! `cargo test --release -p ortrain-engine bf16_gemm_speed -- --ignored --nocapture`):
//!
//! | shape                              | bf16          | f32 gemm     | packing (ms) |
//! |------------------------------------|---------------|--------------|--------------|
//! | forward  X·Wt     700 × 28782 × 200 | 149, 166      | 100, 99      | 2-3          |
//! | grad W   Xᵀ·dY    200 × 28782 × 700 | 148, 139      | 79, 82       | 9-11         |
//! | grad X   dY·Wtᵀ   700 × 200 × 28782 | 159, 160      | 100, 102     | 9-10         |
//!
//! Packing (reading the f32 operands once, writing bf16 panels) is memory bound: the gradient
//! shapes read the 80 MB dY each.

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod driver;
#[cfg(target_arch = "x86_64")]
mod pack;
#[cfg(all(test, target_arch = "x86_64"))]
mod tests;
#[cfg(target_arch = "x86_64")]
mod trial;

use std::sync::OnceLock;

/// The matmul precision a session asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MatmulPrecision {
    #[default]
    Fp32,
    Bf16,
    /// Products of fp16-rounded operands (or better) with f32 accumulation: CUDA sessions only
    /// (cuBLAS's `CUBLAS_COMPUTE_32F_FAST_16F`); the Python side adds the dynamic loss scaler.
    Fp16,
}

impl MatmulPrecision {
    pub const NAMES: [&'static str; 3] = ["fp32", "bf16", "fp16"];

    /// Parses "fp32" | "bf16" | "fp16"; the error names the allowed values.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "fp32" => Ok(MatmulPrecision::Fp32),
            "bf16" => Ok(MatmulPrecision::Bf16),
            "fp16" => Ok(MatmulPrecision::Fp16),
            _ => Err(format!("matmul_precision={s:?} is not one of: {}", Self::NAMES.join(", "))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            MatmulPrecision::Fp32 => "fp32",
            MatmulPrecision::Bf16 => "bf16",
            MatmulPrecision::Fp16 => "fp16",
        }
    }
}

/// The bf16 instruction set in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Isa {
    Amx,
    Avx512Bf16,
}

impl Bf16Isa {
    pub fn name(self) -> &'static str {
        match self {
            Bf16Isa::Amx => "amx",
            Bf16Isa::Avx512Bf16 => "avx512_bf16",
        }
    }
}

/// How MatMul/Gemm kernels multiply: resolved once from the requested precision and the CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MatmulPath {
    #[default]
    Fp32,
    Bf16(Bf16Isa),
}

impl MatmulPath {
    pub fn resolve(p: MatmulPrecision) -> Self {
        match (p, detect()) {
            (MatmulPrecision::Bf16, Some(isa)) => MatmulPath::Bf16(isa),
            _ => MatmulPath::Fp32,
        }
    }

    /// One line for `explain`: what runs, and why when bf16 was asked for and is not used.
    pub fn describe(self, requested: MatmulPrecision) -> String {
        match (self, requested) {
            (MatmulPath::Bf16(isa), _) => format!(
                "bf16 ({}, f32 accumulation{})",
                isa.name(),
                amx_unused().map_or(String::new(), |why| format!("; AMX not used: {why}"))
            ),
            (MatmulPath::Fp32, MatmulPrecision::Bf16) => {
                "fp32 (bf16 requested, but this CPU has neither avx512_bf16 nor AMX, or ORTRAIN_CPU_BF16=off)".into()
            }
            (MatmulPath::Fp32, MatmulPrecision::Fp32) => "fp32".into(),
            (MatmulPath::Fp32, MatmulPrecision::Fp16) => "fp32 (fp16 matmuls run on CUDA only)".into(),
        }
    }
}

/// The bf16 instruction set this process uses, if any (checked once).
pub fn detect() -> Option<Bf16Isa> {
    static D: OnceLock<Option<Bf16Isa>> = OnceLock::new();
    *D.get_or_init(|| {
        let want = std::env::var("ORTRAIN_CPU_BF16").unwrap_or_default();
        if want == "off" {
            return None;
        }
        detect_cpu(want == "avx512_bf16")
    })
}

#[cfg(target_arch = "x86_64")]
fn detect_cpu(no_amx: bool) -> Option<Bf16Isa> {
    // packing (both paths) and the avx512 kernel need these
    let avx512 = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512bf16");
    if !avx512 {
        return None;
    }
    if !no_amx && amx::available() {
        return Some(Bf16Isa::Amx);
    }
    Some(Bf16Isa::Avx512Bf16)
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_cpu(_: bool) -> Option<Bf16Isa> {
    None
}

/// Why the CPU's AMX is not used, when it has AMX and detection has looked at it.
#[cfg(target_arch = "x86_64")]
fn amx_unused() -> Option<&'static str> {
    match amx::known_status() {
        Some(amx::Status::Unusable(why)) => Some(why),
        Some(amx::Status::OsDisabled) => Some("the OS does not enable AMX tile state"),
        _ => None,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn amx_unused() -> Option<&'static str> {
    None
}

/// The bits of `x` rounded to bf16, to nearest even (NaN stays a quiet NaN): how the packers
/// round matmul operands.
pub fn round_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// A row-major view of an f32 matrix: element (i, j) at `ptr + i·rs + j·cs`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef {
    pub ptr: *const f32,
    pub rs: isize,
    pub cs: isize,
}
// SAFETY: a read-only view; `gemm`'s caller keeps the memory valid and unmodified for the call.
unsafe impl Send for MatRef {}
// SAFETY: as above.
unsafe impl Sync for MatRef {}

/// `C[m×n] = alpha · A[m×k] · B[k×n] + beta · C` with bf16 products and f32 accumulation; C is
/// row-major with row stride `ldc` and is not read when `beta == 0`. Multithreaded over rayon's
/// current pool when `parallel` and the product is large enough.
///
/// # Safety
/// A and B cover their m×k and k×n views, valid and unmodified for the call; C covers m rows of
/// n floats at stride ldc and overlaps neither. `isa` must come from `detect()`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm(
    isa: Bf16Isa,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: MatRef,
    b: MatRef,
    beta: f32,
    c: *mut f32,
    ldc: usize,
    parallel: bool,
) {
    #[cfg(target_arch = "x86_64")]
    {
        let g = driver::Problem { m, n, k, alpha, a, b, beta, c, ldc };
        // below ~1 MFLOP a rayon fork costs more than it saves
        let par = parallel && m.saturating_mul(n).saturating_mul(k) >= 1 << 19;
        // SAFETY: the caller's contract; `isa` was detected, which checked every feature the
        // packers and the chosen kernel use.
        unsafe {
            match isa {
                Bf16Isa::Avx512Bf16 => driver::run(&avx512::Avx512Bf16, &g, par),
                Bf16Isa::Amx => driver::run(&amx::Amx::<amx::Hw>::new(), &g, par),
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, m, n, k, alpha, a, b, beta, c, ldc, parallel);
        unreachable!("no bf16 instruction set is ever detected off x86_64");
    }
}
