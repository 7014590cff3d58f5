//! Matrix products with a fused epilogue through cuBLASLt (`cublasLtMatmul`):
//! `D = alpha · op(A) · op(B) + beta · C + bias`, the bias (one value per output column, of D's
//! type) added as the product is written and C a buffer of its own, so that a Gemm's or a
//! Linear's bias needs no broadcast copy into the output first, and a projection can add the
//! residual stream it is summed into (C, f32) while it writes D in f32 from 16-bit operands.
//! Or `D = GELU'(aux) ⊙ (alpha · op(A) · op(B))` (cuBLASLt's DGELU: the tanh approximation's
//! derivative), the gradient through a GELU of the product that only that gradient reads
//! (ops/matmul_gelu_grad.rs), and with DGELU_BGRAD the sums of D's rows (the bias gradient of
//! the layer before the GELU): the product is never stored, nor D read again for the sums.
//! Or, forward, `D = GELU(alpha · op(A) · op(B) + bias)` with the sum itself written to aux
//! (GELU_AUX_BIAS: a Linear followed by a tanh GELU, ops/linear.rs), the GELU taken of the f32
//! sum as it is written instead of by a pass that reads it back.
//!
//! Row-major as [`Gemm`] describes it, batch 1. cuBLASLt picks the kernel
//! (`cublasLtMatmulAlgoGetHeuristic`, the runtime's workspace, each operand's real alignment);
//! where it has none for a combination (or the bias is not 16-byte aligned), [`LtBlas::matmul`]
//! says so (`Ok(false)`) and the caller runs the cuBLAS path.

use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::sys::CUstream;

use super::blas::{F32Mode, Gemm, GemmType};
use crate::error::{Error, Result};

/// What the product's epilogue does as it writes D.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    /// Nothing: D = alpha · op(A) · op(B) + beta · C.
    Plain,
    /// Adds `g.n` values of D's type at this address, one per column of D.
    Bias(u64),
    /// Multiplies each element of the product by the derivative of the tanh-approximated GELU
    /// at the same element of the matrix at `aux` (D's type, shape and row stride; beta 0);
    /// with `bias_grad` (0: none), also writes the sums of D's rows there (`g.n` values of D's
    /// type: the bias gradient of the layer that GELU followed).
    GeluGrad { aux: u64, bias_grad: u64 },
    /// Adds the bias (`g.n` values of D's type at `bias`; 0: none), writes that sum to the
    /// matrix at `aux` (D's type, shape and row stride; beta 0) and its tanh-approximated GELU
    /// to D.
    Gelu { aux: u64, bias: u64 },
}

/// A cuBLASLt handle. Calls are serialised, as for the cuBLAS handle.
pub struct LtBlas {
    handle: Mutex<sys::cublasLtHandle_t>,
}

// SAFETY: the handle is only used under the mutex, one call at a time.
unsafe impl Send for LtBlas {}
// SAFETY: as above.
unsafe impl Sync for LtBlas {}

fn lt_err(what: &'static str) -> impl Fn(lt::CublasError) -> Error {
    move |e| Error::Cuda(format!("cuBLASLt {what}: {e:?}"))
}

fn data_type(t: GemmType) -> sys::cudaDataType {
    match t {
        GemmType::F32 => sys::cudaDataType::CUDA_R_32F,
        GemmType::F64 => sys::cudaDataType::CUDA_R_64F,
        GemmType::Bf16 => sys::cudaDataType::CUDA_R_16BF,
        GemmType::F16 => sys::cudaDataType::CUDA_R_16F,
    }
}

/// A descriptor destroyed when it goes out of scope.
struct Owned<T: Copy>(T, unsafe fn(T) -> std::result::Result<(), lt::CublasError>);
impl<T: Copy> Drop for Owned<T> {
    fn drop(&mut self) {
        // SAFETY: the descriptor was created by cuBLASLt and is destroyed once, here.
        let _ = unsafe { (self.1)(self.0) };
    }
}

/// A column-major layout of `rows` × `cols` with leading dimension `ld`.
fn layout(t: GemmType, rows: usize, cols: usize, ld: usize) -> Result<Owned<sys::cublasLtMatrixLayout_t>> {
    let l = lt::create_matrix_layout(data_type(t), rows as u64, cols as u64, ld as i64).map_err(lt_err("creating a layout"))?;
    Ok(Owned(l, lt::destroy_matrix_layout))
}

/// The alignment cuBLASLt may assume of a device address: the largest power of two dividing it,
/// at most 256 (its default assumption, which a 64-byte-aligned arena buffer or a PyTorch view
/// with a storage offset breaks: a kernel relying on it would fault).
fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        256
    } else {
        1u32 << ptr.trailing_zeros().min(8)
    }
}

/// Sets a matmul descriptor attribute from a plain value.
fn set<V>(desc: sys::cublasLtMatmulDesc_t, attr: sys::cublasLtMatmulDescAttributes_t, v: &V) -> Result<()> {
    // SAFETY: `v` is a live value of the attribute's type and size, read during the call only.
    unsafe { lt::set_matmul_desc_attribute(desc, attr, v as *const V as *const c_void, std::mem::size_of::<V>()) }
        .map_err(lt_err("setting a matmul attribute"))
}

impl LtBlas {
    /// A handle (cuBLASLt must be loaded: blas::load opens it beside cuBLAS). None where it
    /// cannot be created: every product then takes the cuBLAS path.
    pub fn new() -> Option<LtBlas> {
        let handle = std::panic::catch_unwind(lt::create_handle).ok()?.ok()?;
        Some(LtBlas { handle: Mutex::new(handle) })
    }

    /// Enqueues `D = alpha · op(A) · op(B) + beta · C` with `epilogue` on `stream`: `g`
    /// describes A, B and D (its `c_type` is D's and C's type, `ldc` both row strides); `c` is
    /// read only when `g.beta` is not 0. Returns false, having queued nothing, where cuBLASLt
    /// has no kernel for it (batches, f64, operands rounded to 16 bits by half_gemm.rs; a bias
    /// or GELU input (or output 1) less than 16-byte aligned, of another type than A's or a row
    /// stride not a multiple of 8, which cuBLASLt requires of it).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        stream: CUstream,
        g: &Gemm,
        a: u64,
        b: u64,
        c: u64,
        d: u64,
        epilogue: Epilogue,
        workspace: (u64, usize),
    ) -> Result<bool> {
        let compute = match (g.ab_type, g.f32_mode) {
            (GemmType::F64, _) | (GemmType::F32, F32Mode::Bf16 | F32Mode::F16) => return Ok(false),
            (GemmType::F32, F32Mode::Tf32) => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            _ => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        };
        if g.batch != 1 || g.c_type == GemmType::F64 {
            return Ok(false);
        }
        if g.m == 0 || g.n == 0 {
            return Ok(true);
        }
        match epilogue {
            // the bias vector is read in 16-byte pieces by cuBLASLt's epilogues (PyTorch
            // declines less aligned ones too)
            Epilogue::Bias(bias) if !bias.is_multiple_of(16) => return Ok(false),
            Epilogue::GeluGrad { aux, bias_grad: bias } | Epilogue::Gelu { aux, bias }
                if !aux.is_multiple_of(16)
                    || !bias.is_multiple_of(16)
                    || !g.ldc.is_multiple_of(8)
                    || g.beta != 0.0
                    || g.c_type != g.ab_type =>
            {
                return Ok(false)
            }
            _ => {}
        }
        // Row-major D = op(A)·op(B) is column-major Dᵀ = op(B)ᵀ·op(A)ᵀ, as in blas.rs: cuBLASLt's
        // A is our B (n × k after its op), its B our A (k × m), D column-major n × m; the bias
        // runs along D's column-major rows, our columns.
        use cudarc::cublas::sys::cublasOperation_t as Op;
        let op = |t: bool| if t { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
        let (rows_a, cols_a) = if g.trans_b { (g.k, g.n) } else { (g.n, g.k) };
        let (rows_b, cols_b) = if g.trans_a { (g.m, g.k) } else { (g.k, g.m) };
        let (la, lb) = (layout(g.ab_type, rows_a, cols_a, g.ldb)?, layout(g.ab_type, rows_b, cols_b, g.lda)?);
        let lc = layout(g.c_type, g.n, g.m, g.ldc)?;
        let desc = lt::create_matmul_desc(compute, sys::cudaDataType::CUDA_R_32F).map_err(lt_err("creating a matmul"))?;
        let desc = Owned(desc, lt::destroy_matmul_desc);
        use sys::cublasLtMatmulDescAttributes_t as A;
        set(desc.0, A::CUBLASLT_MATMUL_DESC_TRANSA, &op(g.trans_b))?;
        set(desc.0, A::CUBLASLT_MATMUL_DESC_TRANSB, &op(g.trans_a))?;
        match epilogue {
            Epilogue::Plain | Epilogue::Bias(0) => {}
            Epilogue::Bias(bias) => {
                set(desc.0, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS)?;
                set(desc.0, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &(bias as *const c_void))?;
            }
            Epilogue::GeluGrad { aux, bias_grad: bias } | Epilogue::Gelu { aux, bias } => {
                use sys::cublasLtEpilogue_t as E;
                let kind = match (epilogue, bias) {
                    (Epilogue::GeluGrad { .. }, 0) => E::CUBLASLT_EPILOGUE_DGELU,
                    (Epilogue::GeluGrad { .. }, _) => E::CUBLASLT_EPILOGUE_DGELU_BGRAD,
                    (_, 0) => E::CUBLASLT_EPILOGUE_GELU_AUX,
                    _ => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
                };
                set(desc.0, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &kind)?;
                // D's layout, column-major: the aux matrix's leading dimension is D's, and the
                // bias (or its gradient) runs along D's column-major rows (our columns)
                set(desc.0, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &(aux as *const c_void))?;
                set(desc.0, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &(g.ldc as i64))?;
                if bias != 0 {
                    set(desc.0, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &(bias as *const c_void))?;
                }
            }
        }
        let pref = Owned(lt::create_matmul_pref().map_err(lt_err("creating a preference"))?, lt::destroy_matmul_pref);
        let ws_bytes = workspace.1 as u64;
        // SAFETY: a u64 of the attribute's size, read during the call only.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref.0,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws_bytes as *const u64 as *const c_void,
                8,
            )
        }
        .map_err(lt_err("setting the workspace"))?;
        let c = if g.beta == 0.0 { d } else { c };
        // cuBLASLt's A is our B, its B our A
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        for (attr, ptr) in [
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, b),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, a),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, c),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, d),
        ] {
            let bytes = alignment(ptr);
            // SAFETY: a u32 of the attribute's size, read during the call only.
            unsafe { lt::set_matmul_pref_attribute(pref.0, attr, &bytes as *const u32 as *const c_void, 4) }
                .map_err(lt_err("setting an alignment"))?;
        }
        let handle = self.handle.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: live handle and descriptors; the heuristic reads them only.
        let found = unsafe { lt::get_matmul_algo_heuristic(*handle, desc.0, la.0, lb.0, lc.0, lc.0, pref.0) };
        let heuristic = match found {
            Ok(h) => h,
            Err(lt::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => return Ok(false),
            Err(e) => return Err(lt_err("choosing a kernel")(e)),
        };
        let (alpha, beta) = (g.alpha as f32, g.beta as f32);
        // SAFETY: the handle and descriptors are live; alpha/beta are host f32 values (the
        // default pointer mode) that outlive the call; the device addresses and the layouts
        // describing them are the caller's contract, as for a kernel launch; the workspace is
        // the runtime's, of the size the preference allowed.
        let launched = unsafe {
            lt::matmul(
                *handle,
                desc.0,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                b as *const c_void,
                la.0,
                a as *const c_void,
                lb.0,
                c as *const c_void,
                lc.0,
                d as *mut c_void,
                lc.0,
                &heuristic.algo,
                workspace.0 as *mut c_void,
                workspace.1,
                stream as sys::cudaStream_t,
            )
        };
        match launched {
            Ok(()) => Ok(true),
            Err(lt::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => Ok(false),
            Err(e) => Err(Error::Cuda(format!("cuBLASLt matmul {g:?}: {e:?}"))),
        }
    }
}

impl Drop for LtBlas {
    fn drop(&mut self) {
        let h = *self.handle.get_mut().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the handle was created by `new` and is destroyed once, here.
        let _ = unsafe { lt::destroy_handle(h) };
    }
}
