//! What every GPU parity test uses: the loaded kernels (once per process, or the reason there is
//! no GPU), device buffers from host data, a seeded random source, 16-bit float conversions and
//! tolerance checks that name the first mismatching element.

use std::path::PathBuf;

use super::gpu_lock;
use crate::backend::cuda::blas::F32Mode;
use crate::backend::cuda::claim::Claim;
use crate::backend::cuda::launch::{DeviceBuffer, Grid, KArg};
use crate::backend::cuda::loader::Loaded;
use crate::backend::cuda::ops::CudaCtx;
use crate::backend::cuda::probe;
use crate::backend::cuda::runtime::{self, CudaRuntime};

/// GPU 0's runtime (kernels, cuBLAS), the one the executor uses, or why not. NVRTC and cuBLAS
/// come from the pinned wheels' folder, or ORTRAIN_NVRTC_LIB's folder, or the loader's path.
pub fn runtime_or_reason() -> Result<&'static CudaRuntime, String> {
    probe().map_err(|e| e.to_string())?;
    let mut dirs = vec![PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cuda-wheels/nvidia/cu13/lib")];
    if let Some(p) = std::env::var_os("ORTRAIN_NVRTC_LIB") {
        let p = PathBuf::from(p);
        dirs.push(if p.is_dir() { p } else { p.parent().map(PathBuf::from).unwrap_or_default() });
    }
    runtime::runtime(&dirs).map_err(|e| e.to_string())
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

// ---- parity-a helpers

use crate::backend::cuda::abi::{Strides, MAX_DIMS};
use crate::tensor::{DType, Tensor};

/// numpy broadcast of `shapes` (right-aligned; a 1 or a missing dimension stretches).
pub fn bshape(shapes: &[&[usize]]) -> Vec<usize> {
    let r = shapes.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut out = vec![1usize; r];
    for s in shapes {
        for (i, &d) in s.iter().enumerate() {
            let o = &mut out[r - s.len() + i];
            assert!(d == *o || d == 1 || *o == 1, "shapes {shapes:?} do not broadcast");
            if d != 1 {
                *o = d;
            }
        }
    }
    out
}

/// Contiguous element strides of `shape`.
pub fn contiguous(shape: &[usize]) -> Vec<i64> {
    let mut s = vec![1i64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1] as i64;
    }
    s
}

/// `Strides` of a contiguous output `out` (not collapsed) whose operands 0, 1, 2 are contiguous
/// tensors of `shapes` broadcast to it: stride 0 on a dimension of size 1 or missing; bases 0.
pub fn bcast(out: &[usize], shapes: &[&[usize]]) -> Strides {
    assert!(out.len() <= MAX_DIMS && shapes.len() <= 3, "rank {} / {} operands", out.len(), shapes.len());
    let mut s = Strides { rank: out.len() as i32, ..Default::default() };
    for (d, &n) in out.iter().enumerate() {
        s.dims[d] = n as i64;
    }
    for (k, sh) in shapes.iter().enumerate() {
        let (off, cs) = (out.len() - sh.len(), contiguous(sh));
        for i in 0..sh.len() {
            assert!(sh[i] == out[off + i] || sh[i] == 1, "{sh:?} does not broadcast to {out:?}");
            s.stride[k][off + i] = if sh[i] == 1 { 0 } else { cs[i] };
        }
    }
    s
}

/// Bytes per element of a kernel dtype suffix (bool is one byte).
pub fn size_of(t: &str) -> usize {
    match t {
        "f64" | "i64" | "u64" => 8,
        "f32" | "i32" | "u32" => 4,
        "bf16" | "f16" | "u16" => 2,
        "u8" | "i8" | "bool" => 1,
        _ => panic!("unknown dtype {t}"),
    }
}

pub fn is_float(t: &str) -> bool {
    matches!(t, "f32" | "f64" | "bf16" | "f16")
}

/// `vals` stored as kernel dtype `t`: 16-bit floats rounded to nearest even, integers by Rust
/// `as` (so saturating), bool as `!= 0`.
pub fn encode(t: &str, vals: &[f64]) -> Vec<u8> {
    let mut b = Vec::with_capacity(vals.len() * size_of(t));
    for &v in vals {
        match t {
            "f64" => b.extend(v.to_le_bytes()),
            "f32" => b.extend((v as f32).to_le_bytes()),
            "bf16" => b.extend(bf16_bits(v as f32).to_le_bytes()),
            "f16" => b.extend(f16_bits(v as f32).to_le_bytes()),
            "i64" | "u64" => b.extend((v as i64).to_le_bytes()),
            "i32" | "u32" => b.extend((v as i32).to_le_bytes()),
            "u16" => b.extend((v as u16).to_le_bytes()),
            "u8" => b.push(v as u8),
            "i8" => b.push(v as i8 as u8),
            "bool" => b.push((v != 0.0) as u8),
            _ => panic!("unknown dtype {t}"),
        }
    }
    b
}

/// Elements of dtype `t` as f64 (exact except i64/u64 beyond 2^53).
pub fn decode(t: &str, b: &[u8]) -> Vec<f64> {
    let w = size_of(t);
    assert_eq!(b.len() % w, 0);
    b.chunks_exact(w)
        .map(|c| match t {
            "f64" => f64::from_le_bytes(c.try_into().unwrap()),
            "f32" => f32::from_le_bytes(c.try_into().unwrap()) as f64,
            "bf16" => bf16_value(u16::from_le_bytes(c.try_into().unwrap())) as f64,
            "f16" => f16_value(u16::from_le_bytes(c.try_into().unwrap())) as f64,
            "i64" => i64::from_le_bytes(c.try_into().unwrap()) as f64,
            "u64" => u64::from_le_bytes(c.try_into().unwrap()) as f64,
            "i32" => i32::from_le_bytes(c.try_into().unwrap()) as f64,
            "u32" => u32::from_le_bytes(c.try_into().unwrap()) as f64,
            "u16" => u16::from_le_bytes(c.try_into().unwrap()) as f64,
            "u8" | "bool" => c[0] as f64,
            "i8" => c[0] as i8 as f64,
            _ => panic!("unknown dtype {t}"),
        })
        .collect()
}

/// The CPU reference's dtype for kernel dtype `t`: bf16/f16 are computed in F32.
pub fn cpu_dtype(t: &str) -> DType {
    match t {
        "f32" | "bf16" | "f16" => DType::F32,
        "f64" => DType::F64,
        "i64" => DType::I64,
        "i32" => DType::I32,
        "u8" => DType::U8,
        "i8" => DType::I8,
        "bool" => DType::Bool,
        _ => panic!("no CPU dtype for {t}"),
    }
}

/// A CPU tensor of the elements in `bytes` (dtype `t`); 16-bit floats become F32 of the same
/// values (exact).
pub fn cpu_tensor(t: &str, shape: &[usize], bytes: &[u8]) -> Tensor {
    match t {
        "bf16" | "f16" => Tensor::from_f32(shape.to_vec(), decode(t, bytes).into_iter().map(|v| v as f32).collect()),
        _ => Tensor::from_bytes(cpu_dtype(t), shape.to_vec(), bytes).unwrap_or_else(|e| panic!("{e}")),
    }
}

/// A CPU result as dtype-`t` bytes: for bf16/f16 the F32 result rounded to nearest even (what
/// the kernel's store does), otherwise the tensor's own bytes.
pub fn cpu_bytes(t: &str, r: &Tensor) -> Vec<u8> {
    match t {
        "bf16" | "f16" => encode(t, &r.to_f64_vec()),
        _ => {
            assert_eq!(r.dtype(), cpu_dtype(t), "the CPU reference has dtype {:?}, expected {t}", r.dtype());
            r.as_bytes().to_vec()
        }
    }
}

/// Asserts dtype-`t` elements are identical (floats: same value or both NaN, so -0 == 0 is not
/// accepted either: bits must match except NaN payloads), naming the first mismatch.
pub fn assert_same(what: &str, t: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: {} bytes, expected {}", got.len(), want.len());
    let w = size_of(t);
    let (gv, wv) = (decode(t, got), decode(t, want));
    for (i, (g, e)) in got.chunks_exact(w).zip(want.chunks_exact(w)).enumerate() {
        let ok = g == e || (is_float(t) && gv[i].is_nan() && wv[i].is_nan());
        assert!(ok, "{what}: element {i}: got {} (bytes {g:02x?}), expected {} (bytes {e:02x?})", gv[i], wv[i]);
    }
}

/// `assert_close` of dtype-`t` elements with the dtype's `rtol` and the given `atol`; exact
/// (assert_same) for non-float dtypes.
pub fn assert_close_t(what: &str, t: &str, got: &[u8], want: &[u8], atol: f64) {
    if is_float(t) {
        assert_close(what, &decode(t, got), &decode(t, want), rtol(t), atol);
    } else {
        assert_same(what, t, got, want);
    }
}

/// Random elements of a bit-moving width `w` (u8 u16 u32 u64), as i64 (the CPU reference runs
/// the op on I64 tensors: the op only moves values), and the same as dtype-`w` bytes.
pub fn random_bits(rng: &mut Rng, w: &str, n: usize) -> (Vec<i64>, Vec<u8>) {
    let bits = 8 * size_of(w) as u32;
    let v: Vec<i64> = (0..n).map(|_| if bits == 64 { rng.next_u64() as i64 } else { (rng.next_u64() >> (64 - bits)) as i64 }).collect();
    let b = narrow(w, &v);
    (v, b)
}

/// i64 values truncated to width `w`, as bytes.
pub fn narrow(w: &str, v: &[i64]) -> Vec<u8> {
    let k = size_of(w);
    v.iter().flat_map(|x| x.to_le_bytes()[..k].to_vec()).collect()
}

/// An I64 CPU tensor.
pub fn i64_tensor(shape: &[usize], v: Vec<i64>) -> Tensor {
    Tensor::from_i64(shape.to_vec(), v)
}

/// Where a parity-a test runs: on the GPU, or dry where there is none: every launch's argument
/// list is checked against the registry and its geometry for sanity, the CPU references run and
/// output sizes are compared with them, values are not. A mistake on a test's host side (a CPU
/// op's attributes, a shape, a size in bytes) then fails without a GPU.
#[derive(Clone, Copy)]
pub enum Target {
    Gpu(&'static Loaded),
    Dry,
}

/// A device buffer, or its size in a dry run (address 0).
pub enum Buf {
    Dev(DeviceBuffer),
    Dry(usize),
}

impl Buf {
    pub fn ptr(&self) -> u64 {
        match self {
            Buf::Dev(b) => b.ptr(),
            Buf::Dry(_) => 0,
        }
    }
    pub fn bytes(&self) -> usize {
        match self {
            Buf::Dev(b) => b.bytes(),
            Buf::Dry(n) => *n,
        }
    }
}

impl Target {
    /// The GPU for `test`, or a dry run (after `gpu` printed SKIPPED).
    pub fn of(test: &str) -> Target {
        match gpu(test) {
            Some(g) => Target::Gpu(g),
            None => {
                eprintln!("{test}: dry run (launch arguments and CPU references only)");
                Target::Dry
            }
        }
    }
    /// Uploads raw bytes.
    pub fn up(&self, b: &[u8]) -> Buf {
        match self {
            Target::Gpu(g) => Buf::Dev(dev(g, b)),
            Target::Dry => Buf::Dry(b.len()),
        }
    }
    /// A zeroed buffer of `bytes` bytes.
    pub fn zeros(&self, bytes: usize) -> Buf {
        match self {
            Target::Gpu(g) => Buf::Dev(zeros::<u8>(g, bytes)),
            Target::Dry => Buf::Dry(bytes),
        }
    }
    /// Launches and waits (dry: checks the arguments and the geometry).
    pub fn run(&self, kernel: &str, grid: Grid, args: &[KArg]) {
        match self {
            Target::Gpu(g) => run(g, kernel, grid, args),
            Target::Dry => {
                crate::backend::cuda::launch::check_args(kernel, args).unwrap_or_else(|e| panic!("{e}"));
                assert!(grid.blocks > 0 && grid.threads > 0 && grid.threads <= 1024, "{kernel}: bad geometry {grid:?}");
            }
        }
    }
    /// The buffer's bytes (None in a dry run).
    pub fn down(&self, b: &Buf) -> Option<Vec<u8>> {
        match b {
            Buf::Dev(d) => Some(host::<u8>(d)),
            Buf::Dry(_) => None,
        }
    }
    /// `assert_same` of the buffer with `want` (dry: the sizes only).
    pub fn same(&self, what: &str, t: &str, b: &Buf, want: &[u8]) {
        match self.down(b) {
            Some(got) => assert_same(what, t, &got, want),
            None => assert_eq!(b.bytes(), want.len(), "{what}: output of {} bytes, the reference has {}", b.bytes(), want.len()),
        }
    }
    /// `assert_close_t` of the buffer with `want` (dry: the sizes only).
    pub fn close(&self, what: &str, t: &str, b: &Buf, want: &[u8], atol: f64) {
        match self.down(b) {
            Some(got) => assert_close_t(what, t, &got, want, atol),
            None => assert_eq!(b.bytes(), want.len(), "{what}: output of {} bytes, the reference has {}", b.bytes(), want.len()),
        }
    }
}

/// Host mirror of prelude.cuh `strided_offsets` (abi.rs `Strides::offsets`): the offsets of
/// index-space element `i` in operands 0..3. Dry runs emulate the bit-moving kernels with it,
/// so the `Strides` a test builds are checked against the CPU reference without a GPU.
pub fn offsets(s: &Strides, i: i64) -> [i64; 3] {
    s.offsets(i)
}

impl Target {
    pub fn is_dry(&self) -> bool {
        matches!(self, Target::Dry)
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
