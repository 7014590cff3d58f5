//! Matrix products on the GPU through cuBLAS (`cublasGemmStridedBatchedEx`): every MatMul,
//! Gemm, FusedMatMul and Linear of a plan is one call, with row-major operands described by a
//! [`Gemm`]. TF32 is off unless asked for (parity with PyTorch's default,
//! `torch.backends.cuda.matmul.allow_tf32 = False`); bf16/f16 operands accumulate in f32. f32
//! operands may also go to tensor cores at bf16 precision or better ([`F32Mode::Bf16`], cuBLAS's
//! `CUBLAS_COMPUTE_32F_FAST_16BF`): the mixed precision of `precision="bf16"`, with f32 tensors
//! in and out; `precision="fp16"` likewise at fp16 ([`F32Mode::F16`], `..._FAST_16F`). cuBLAS picks the kernels: on an H100 it ran TF32 ones (results within 1e-4 of
//! the f32 product, not bf16's 1e-2; gpu_gemm_f32_operands_as_bf16 prints it).
//!
//! cudarc opens cuBLAS by name (`libcublas.so.13`) and panics when it finds none, and PyTorch's
//! CUDA wheels keep it in `site-packages/nvidia/cu13/lib/`, off the loader's path. So [`load`]
//! opens it first by absolute path where needed (with `libcublasLt.so.13` beside it); cudarc's
//! by-name open then finds the loaded copy by its SONAME, as for NVRTC (nvrtc.rs).

use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::Mutex;

use cudarc::cublas::{result as cublas, sys};
use cudarc::driver::sys::CUstream;

use super::blas_lt::Epilogue;
use super::driver::dl_error;
use crate::error::{Error, Result};

#[cfg(not(windows))]
const CUBLAS_LIB: &str = "libcublas.so.13";
#[cfg(not(windows))]
const CUBLAS_LT_LIB: &str = "libcublasLt.so.13";
#[cfg(windows)]
const CUBLAS_LIB: &str = "cublas64_13.dll";
#[cfg(windows)]
const CUBLAS_LT_LIB: &str = "cublasLt64_13.dll";

/// Element types of gemm operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmType {
    F32,
    F64,
    Bf16,
    F16,
}

impl GemmType {
    fn cuda(self) -> sys::cudaDataType {
        match self {
            GemmType::F32 => sys::cudaDataType::CUDA_R_32F,
            GemmType::F64 => sys::cudaDataType::CUDA_R_64F,
            GemmType::Bf16 => sys::cudaDataType::CUDA_R_16BF,
            GemmType::F16 => sys::cudaDataType::CUDA_R_16F,
        }
    }
    pub fn size(self) -> usize {
        match self {
            GemmType::F64 => 8,
            GemmType::F32 => 4,
            GemmType::Bf16 | GemmType::F16 => 2,
        }
    }
}

/// How a gemm multiplies f32 operands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum F32Mode {
    /// f32 products (PyTorch's default).
    #[default]
    Exact,
    /// TF32 tensor cores (PyTorch's `allow_tf32`).
    Tf32,
    /// Tensor cores allowed to round operands to bf16 (cuBLAS may use TF32 or better), f32
    /// accumulation. The runtime's `gemm` rounds the operands itself and runs a bf16 gemm
    /// (half_gemm.rs): cuBLAS picked TF32 kernels for this mode on an H100.
    Bf16,
    /// The same at fp16 (`CUBLAS_COMPUTE_32F_FAST_16F`): the mixed precision of
    /// `precision="fp16"`.
    F16,
}

/// `C[b] = alpha · op(A[b]) · op(B[b]) + beta · C[b]` for b in 0..batch, row-major: C[b] is
/// m×n with row stride `ldc`; A[b] is m×k (k×m when `trans_a`) with row stride `lda`; B[b] is
/// k×n (n×k when `trans_b`) with row stride `ldb`. Batch strides are in elements; 0 repeats
/// one matrix over the batch (broadcasting).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_c: usize,
    pub alpha: f64,
    pub beta: f64,
    /// A and B.
    pub ab_type: GemmType,
    pub c_type: GemmType,
    /// How f32 operands are multiplied (exact unless asked otherwise).
    pub f32_mode: F32Mode,
}

impl Gemm {
    /// Contiguous row-major matrices, batch strides of whole matrices.
    pub fn contiguous(batch: usize, m: usize, n: usize, k: usize, trans_a: bool, trans_b: bool, t: GemmType) -> Gemm {
        Gemm {
            batch,
            m,
            n,
            k,
            trans_a,
            trans_b,
            lda: if trans_a { m } else { k },
            ldb: if trans_b { k } else { n },
            ldc: n,
            stride_a: m * k,
            stride_b: k * n,
            stride_c: m * n,
            alpha: 1.0,
            beta: 0.0,
            ab_type: t,
            c_type: t,
            f32_mode: F32Mode::Exact,
        }
    }
}

/// A cuBLAS handle. Calls are serialised (a handle is not meant for concurrent use).
pub struct Blas {
    handle: Mutex<sys::cublasHandle_t>,
    /// The handle's workspace, ours rather than cuBLAS's pool: a gemm recorded into a CUDA graph
    /// keeps the workspace address it was recorded with, so it must never move or be freed
    /// (PyTorch sets its handles' workspaces for the same reason). Set again after every
    /// `cublasSetStream`, which resets it to the pool.
    workspace: super::launch::DeviceBuffer,
    /// cuBLASLt, for the products with an epilogue (blas_lt.rs); None where it could not be
    /// opened (they then take the cuBLAS path).
    lt: Option<super::blas_lt::LtBlas>,
}

/// 32 MiB: what cuBLAS itself uses per handle on Hopper, and PyTorch's `CUBLAS_WORKSPACE_CONFIG`
/// default there (`:4096:8`).
pub const WORKSPACE_BYTES: usize = 32 << 20;

// SAFETY: the handle is only used under the mutex, one call at a time, which cuBLAS allows
// from any thread.
unsafe impl Send for Blas {}
// SAFETY: as above.
unsafe impl Sync for Blas {}

fn blas_err(what: &str) -> impl Fn(cublas::CublasError) -> Error + '_ {
    move |e| Error::Cuda(format!("cuBLAS {what}: {e:?}"))
}

/// Finds and opens cuBLAS 13 once per process (`ORTRAIN_CUBLAS_LIB`, then the loader's own
/// search, then `dirs`, then `$CUDA_HOME/lib64` and the like).
pub fn load(dirs: &[PathBuf]) -> Result<()> {
    static LOADED: Mutex<Option<Vec<libloading::Library>>> = Mutex::new(None);
    let mut slot = LOADED.lock().unwrap_or_else(|p| p.into_inner());
    if slot.is_some() {
        return Ok(());
    }
    let mut candidates: Vec<Option<PathBuf>> = Vec::new();
    if let Some(v) = std::env::var_os("ORTRAIN_CUBLAS_LIB") {
        let p = PathBuf::from(v);
        candidates.push(Some(if p.is_dir() { p.join(CUBLAS_LIB) } else { p }));
    } else {
        candidates.push(None);
        candidates.extend(dirs.iter().cloned().chain(super::nvrtc::env_dirs()).map(|d| Some(d.join(CUBLAS_LIB))));
    }
    let mut tried = Vec::new();
    for c in candidates {
        let opened: std::result::Result<Vec<libloading::Library>, String> = match &c {
            // SAFETY: cuBLAS has no initialisers with preconditions.
            None => unsafe { libloading::Library::new(CUBLAS_LIB) }.map(|l| vec![l]).map_err(|e| dl_error(&e)),
            Some(p) if !p.is_file() => Err("no such file".into()),
            Some(p) => {
                let lt = p.with_file_name(CUBLAS_LT_LIB);
                // SAFETY: as above, for cuBLASLt (which cuBLAS needs) and cuBLAS itself.
                unsafe { libloading::Library::new(&lt).and_then(|a| libloading::Library::new(p).map(|b| vec![a, b])) }
                    .map_err(|e| dl_error(&e))
            }
        };
        match opened {
            Ok(libs) => {
                *slot = Some(libs);
                return Ok(());
            }
            Err(e) => {
                tried.push(format!("{} ({e})", c.as_ref().map_or_else(|| format!("{CUBLAS_LIB} by name"), |p| p.display().to_string())))
            }
        }
    }
    Err(Error::CudaUnavailable(format!(
        "cuBLAS 13 ({CUBLAS_LIB}) not found; install the nvidia-cublas wheel (PyTorch's CUDA 13 wheels bring it) or set \
         ORTRAIN_CUBLAS_LIB; tried: {}",
        tried.join("; ")
    )))
}

impl Blas {
    /// A handle in the current context (cuBLAS must be loaded: [`load`]) with its own workspace.
    pub fn new(ctx: &std::sync::Arc<cudarc::driver::CudaContext>) -> Result<Blas> {
        let workspace = super::launch::DeviceBuffer::zeroed(ctx, WORKSPACE_BYTES)?;
        let handle = std::panic::catch_unwind(cublas::create_handle)
            .map_err(|_| Error::Cuda(format!("cudarc could not open {CUBLAS_LIB} by name although it is loaded")))?
            .map_err(blas_err("creating a handle"))?;
        Ok(Blas { handle: Mutex::new(handle), workspace, lt: super::blas_lt::LtBlas::new() })
    }

    /// Enqueues `D = alpha · op(A) · op(B) + beta · C` with `epilogue` through cuBLASLt
    /// (blas_lt.rs) with the handle's workspace; false, having queued nothing, where cuBLASLt
    /// cannot.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_epilogue(&self, stream: CUstream, g: &Gemm, a: u64, b: u64, c: u64, d: u64, epilogue: Epilogue) -> Result<bool> {
        let Some(lt) = &self.lt else { return Ok(false) };
        // the cuBLAS handle's lock: its calls and these share the workspace
        let _serial = self.handle.lock().unwrap_or_else(|p| p.into_inner());
        lt.matmul(stream, g, a, b, c, d, epilogue, (self.workspace.ptr(), self.workspace.bytes()))
    }

    /// Enqueues `g` on `stream` with device addresses `a`, `b`, `c`.
    pub fn gemm(&self, stream: CUstream, g: &Gemm, a: u64, b: u64, c: u64) -> Result<()> {
        if g.batch == 0 || g.m == 0 || g.n == 0 {
            return Ok(());
        }
        let int = |v: usize, what: &str| i32::try_from(v).map_err(|_| Error::Cuda(format!("gemm {what} = {v} does not fit cuBLAS's int")));
        // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: swap the operands, and
        // each row-major buffer read column-major is already the transpose.
        let op = |t: bool| if t { sys::cublasOperation_t::CUBLAS_OP_T } else { sys::cublasOperation_t::CUBLAS_OP_N };
        let (m, n, k) = (int(g.n, "n")?, int(g.m, "m")?, int(g.k, "k")?);
        let (lda, ldb, ldc) = (int(g.ldb, "ldb")?, int(g.lda, "lda")?, int(g.ldc, "ldc")?);
        let batch = int(g.batch, "batch")?;
        let compute = match (g.ab_type, g.f32_mode) {
            (GemmType::F64, _) => sys::cublasComputeType_t::CUBLAS_COMPUTE_64F,
            (GemmType::F32, F32Mode::Tf32) => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            (GemmType::F32, F32Mode::Bf16) => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF,
            (GemmType::F32, F32Mode::F16) => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16F,
            _ => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        };
        let (alpha32, beta32) = (g.alpha as f32, g.beta as f32);
        let (alpha, beta): (*const c_void, *const c_void) = if g.ab_type == GemmType::F64 {
            (&g.alpha as *const f64 as *const c_void, &g.beta as *const f64 as *const c_void)
        } else {
            (&alpha32 as *const f32 as *const c_void, &beta32 as *const f32 as *const c_void)
        };
        let handle = self.handle.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the handle is live (owned, under the lock), the workspace a device buffer it
        // owns for its whole life (WORKSPACE_BYTES, 256-byte aligned); alpha/beta point at host values of
        // the compute type that outlive the call (host pointer mode, the default); the device
        // addresses and the sizes/strides describing them are the caller's contract, as for a
        // kernel launch.
        unsafe {
            cublas::set_stream(*handle, stream as sys::cudaStream_t).map_err(blas_err("setting the stream"))?;
            sys::cublasSetWorkspace_v2(*handle, self.workspace.ptr() as *mut c_void, self.workspace.bytes())
                .result()
                .map_err(blas_err("setting the workspace"))?;
            cublas::gemm_strided_batched_ex(
                *handle,
                op(g.trans_b),
                op(g.trans_a),
                m,
                n,
                k,
                alpha,
                b as *const c_void,
                g.ab_type.cuda(),
                lda,
                g.stride_b as i64,
                a as *const c_void,
                g.ab_type.cuda(),
                ldb,
                g.stride_a as i64,
                beta,
                c as *mut c_void,
                g.c_type.cuda(),
                ldc,
                g.stride_c as i64,
                batch,
                compute,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| Error::Cuda(format!("cuBLAS gemm {g:?}: {e:?}")))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        let h = *self.handle.get_mut().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the handle was created by `new` and is destroyed once, here.
        let _ = unsafe { cublas::destroy_handle(h) };
    }
}
