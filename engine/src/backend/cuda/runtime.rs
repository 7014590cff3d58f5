//! One GPU, ready to run plans: its kernels loaded into its primary context (the one PyTorch
//! uses), a cuBLAS handle, and the resolved kernel functions, once per process and GPU. The
//! executor and the op dispatchers (ops/) launch through it on the caller's stream (one of
//! PyTorch's streams of that GPU).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use cudarc::driver::{result as driver, sys::CUstream, CudaFunction};

use super::abi::Arg;
use super::blas::{self, Blas, F32Mode, Gemm, GemmType};
use super::blas_lt::Epilogue;
use super::claim::{Claim, Claims};
use super::launch::{self, Grid, KArg};
use super::loader::{self, Loaded};
use super::{cache, half_gemm, nvrtc};
use crate::error::{Error, Result};

/// A resolved kernel: its function, registered signature and static shared memory.
type Resolved = (CudaFunction, &'static [Arg], u32);

pub struct CudaRuntime {
    /// The GPU's device ordinal (PyTorch's `cuda:<ordinal>`).
    pub ordinal: usize,
    pub loaded: Loaded,
    pub blas: Blas,
    /// Resolved kernels by name.
    functions: Mutex<HashMap<String, Resolved>>,
    /// Multiprocessors: the grid-size cap of grid-stride kernels is a few blocks per SM.
    pub sms: u32,
    /// Scratch memory for kernels' temporaries (row statistics, per-sample losses), grown on
    /// demand. One region, reused by every launch: work that uses it holds a claim (`claim`,
    /// claim.rs), which orders it after the previous user's, whatever thread or stream that
    /// was; growing frees the old region with a synchronising cuMemFree.
    scratch: Mutex<Option<super::launch::DeviceBuffer>>,
    /// The 16-bit copies of a mixed-precision gemm's operands (half_gemm.rs); apart from
    /// `scratch`, which a dispatcher may hold across its gemms. Grown and reused the same way.
    operands: Mutex<Option<super::launch::DeviceBuffer>>,
    /// An attention mask made from key padding for the kernels that read masks
    /// (ops/attention.rs); apart from `scratch`, which those kernels and their f32 copies of
    /// 16-bit operands (widen.rs) use while they read it. Grown and reused the same way.
    masks: Mutex<Option<super::launch::DeviceBuffer>>,
    /// A vector of ones per float width (4: f32, 8: f64), for sums as matrix products.
    /// Per GemmType (f32, f64, bf16, f16): a buffer of ones and its length.
    ones: Mutex<[Option<(super::launch::DeviceBuffer, usize)>; 4]>,
    /// Set once a CUDA graph has been recorded: graphs keep the scratch and ones addresses they
    /// were recorded with, so from then on a buffer replaced by a larger one is kept (`retired`)
    /// instead of freed. The growth is geometric, so that costs less than the last buffer.
    graphs: AtomicBool,
    retired: Mutex<Vec<super::launch::DeviceBuffer>>,
    /// Orders the users of `scratch` and `operands` (claim.rs).
    claims: Claims,
    /// The stream CUDA graphs are recorded on (made on first use; recording cannot use
    /// PyTorch's default stream, the legacy NULL stream), one recording at a time.
    capture: Mutex<Option<CaptureStream>>,
    /// Which kernels each Attention node's last launch chose (explain()), keyed by the node's
    /// address in its session's graph.
    attention_paths: Mutex<HashMap<usize, &'static str>>,
}

/// A non-blocking stream of our own, only ever used to record graphs (never to run work).
pub struct CaptureStream(pub CUstream);

// SAFETY: a stream handle may be used from any thread of the process; the runtime hands it out
// only under its mutex.
unsafe impl Send for CaptureStream {}

/// The most GPUs one process drives (device ordinals 0..MAX_DEVICES).
pub const MAX_DEVICES: usize = 64;

/// Each GPU's runtime, made on first use of that GPU.
static RTS: [OnceLock<CudaRuntime>; MAX_DEVICES] = [const { OnceLock::new() }; MAX_DEVICES];

/// Every runtime something has created, by device ordinal (never creates one).
pub fn loaded_runtimes() -> impl Iterator<Item = &'static CudaRuntime> {
    RTS.iter().filter_map(OnceLock::get)
}

/// GPU `ordinal`'s runtime if something has created it (never creates it).
pub fn loaded_runtime(ordinal: usize) -> Option<&'static CudaRuntime> {
    RTS.get(ordinal).and_then(OnceLock::get)
}

/// GPU `ordinal`'s runtime (PyTorch's `cuda:<ordinal>`), created on first use; `dirs` are
/// extra folders holding NVRTC and cuBLAS (the Python package passes
/// `site-packages/nvidia/cu13/lib`). A failure is returned every time (with its reason) and
/// retried on the next call.
pub fn runtime(ordinal: usize, dirs: &[PathBuf]) -> Result<&'static CudaRuntime> {
    static INIT: Mutex<()> = Mutex::new(());
    let slot =
        RTS.get(ordinal).ok_or_else(|| Error::Cuda(format!("cuda:{ordinal}: ortrain drives GPUs cuda:0 to cuda:{}", MAX_DEVICES - 1)))?;
    if let Some(rt) = slot.get() {
        return Ok(rt);
    }
    let _guard = INIT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(rt) = slot.get() {
        return Ok(rt);
    }
    let nv = nvrtc::load(dirs)?;
    let loaded = loader::load_all(ordinal, nv, cache::default_dir().as_deref())?;
    loaded.ctx.bind_to_thread().map_err(|e| Error::Cuda(format!("binding the context: {e}")))?;
    blas::load(dirs)?;
    let blas = Blas::new(&loaded.ctx)?;
    let sms = loaded
        .ctx
        .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| Error::Cuda(format!("multiprocessor count: {e}")))? as u32;
    Ok(slot.get_or_init(|| CudaRuntime {
        ordinal,
        loaded,
        blas,
        functions: Mutex::new(HashMap::new()),
        sms,
        scratch: Mutex::new(None),
        operands: Mutex::new(None),
        masks: Mutex::new(None),
        ones: Mutex::new([None, None, None, None]),
        graphs: AtomicBool::new(false),
        retired: Mutex::new(Vec::new()),
        claims: Claims::default(),
        capture: Mutex::new(None),
        attention_paths: Mutex::new(HashMap::new()),
    }))
}

impl CudaRuntime {
    /// Launches `kernel` on `stream` (arguments checked against the registry).
    pub fn launch(&self, stream: CUstream, kernel: &str, grid: Grid, args: &[KArg]) -> Result<()> {
        let (f, sig, static_shared) = {
            let mut fns = self.functions.lock().unwrap_or_else(|p| p.into_inner());
            match fns.get(kernel) {
                Some(f) => f.clone(),
                None => {
                    let sig = super::registry::signature(kernel).ok_or_else(|| Error::Cuda(format!("no CUDA kernel named {kernel}")))?;
                    let func = self.loaded.function(kernel)?;
                    let shared = launch::static_shared(&func, kernel)?;
                    let f = (func, sig, shared);
                    fns.insert(kernel.to_string(), f.clone());
                    f
                }
            }
        };
        launch::check_against(kernel, sig, args)?;
        launch::launch_unchecked_args(&f, kernel, static_shared, stream, grid, args)
    }
    /// Records which kernels `node` (an Attention) launched: ops/attention.rs `Path`.
    pub fn note_attention(&self, node: &crate::ir::Node, path: &'static str) {
        self.attention_paths.lock().unwrap_or_else(|p| p.into_inner()).insert(node as *const _ as usize, path);
    }
    /// What [`Self::note_attention`] last recorded for `node`, if it has been launched.
    pub fn attention_path(&self, node: &crate::ir::Node) -> Option<&'static str> {
        self.attention_paths.lock().unwrap_or_else(|p| p.into_inner()).get(&(node as *const _ as usize)).copied()
    }
    /// Whether `kernel` has been launched in this process (tests: which kernel a dispatcher chose).
    pub fn has_launched(&self, kernel: &str) -> bool {
        self.functions.lock().unwrap_or_else(|p| p.into_inner()).contains_key(kernel)
    }
    /// Claims the scratch and operand buffers for work queued on `stream` until the claim is
    /// dropped (claim.rs): every phase of a step and every graph replay holds one.
    pub fn claim(&self, stream: CUstream) -> Result<Claim<'_>> {
        self.claims.claim(stream)
    }
    /// Device address of at least `bytes` bytes of scratch memory (see the field's note), 256-byte
    /// aligned; valid until the next call.
    pub fn scratch(&self, bytes: usize) -> Result<u64> {
        self.grown(&self.scratch, bytes)
    }
    /// `slot`'s buffer, replaced by one of at least `bytes` bytes (a power of two, 64 KiB or
    /// more) when it is smaller.
    fn grown(&self, slot: &Mutex<Option<super::launch::DeviceBuffer>>, bytes: usize) -> Result<u64> {
        let mut s = slot.lock().unwrap_or_else(|p| p.into_inner());
        if s.as_ref().is_none_or(|b| b.bytes() < bytes) {
            // allocated before the old one goes: a failed allocation leaves the runtime as it was
            // contents unspecified: scratch and operand copies are written before they are read
            let grown = super::launch::DeviceBuffer::uninit(&self.loaded.ctx, bytes.next_power_of_two().max(1 << 16))?;
            if let Some(old) = s.replace(grown) {
                self.retire(old);
            }
        }
        Ok(s.as_ref().map_or(0, |b| b.ptr()))
    }
    /// Device address of at least `n` ones of the float type `t`. Filled on `stream` when
    /// (re)allocated, so work queued after on the same stream reads ones.
    // the stream is an opaque handle passed to the driver, never dereferenced here
    #[allow(clippy::not_unsafe_ptr_arg_deref)]
    pub fn ones(&self, stream: CUstream, t: GemmType, n: usize) -> Result<u64> {
        // 1.0 as each type's bits: f32, f64, bf16 (f32's upper half), f16
        let (slot, kernel, bits) = match t {
            GemmType::F32 => (0, "fill_u32", 1f32.to_bits() as u64),
            GemmType::F64 => (1, "fill_u64", 1f64.to_bits()),
            GemmType::Bf16 => (2, "fill_u16", 0x3F80),
            GemmType::F16 => (3, "fill_u16", 0x3C00),
        };
        let mut ones = self.ones.lock().unwrap_or_else(|p| p.into_inner());
        if ones[slot].as_ref().is_none_or(|(_, have)| *have < n) {
            // during a recording the fill below would only be recorded: a recording that then
            // failed would leave this buffer registered but never filled
            // SAFETY: `stream` is the caller's live stream (or the null legacy stream).
            let capturing = unsafe { driver::stream::is_capturing(stream) }
                .map_err(|e| Error::Cuda(format!("asking whether the stream is recording: {e}")))?;
            if capturing != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
                return Err(Error::Cuda("the vector of ones must grow outside a CUDA graph recording".into()));
            }
            let count = n.next_power_of_two().max(1 << 12);
            // the fill below writes all of it, on `stream` (a memset on the legacy stream would
            // not be ordered with it on a non-blocking PyTorch stream)
            let buf = super::launch::DeviceBuffer::uninit(&self.loaded.ctx, count * t.size())?;
            self.launch(stream, kernel, self.elementwise_grid(count), &[KArg::Ptr(buf.ptr()), KArg::I64(count as i64), KArg::U64(bits)])?;
            if let Some((old, _)) = ones[slot].replace((buf, count)) {
                self.retire(old);
            }
        }
        Ok(ones[slot].as_ref().map_or(0, |(b, _)| b.ptr()))
    }
    /// Device bytes the runtime holds itself, outside PyTorch's allocator (so not in
    /// torch.cuda's statistics): the scratch, operand and ones buffers, those kept for graphs,
    /// and cuBLAS's workspace.
    pub fn own_bytes(&self) -> usize {
        let held = |m: &Mutex<Option<super::launch::DeviceBuffer>>| m.lock().map_or(0, |b| b.as_ref().map_or(0, |b| b.bytes()));
        let ones = self.ones.lock().map_or(0, |o| o.iter().flatten().map(|(b, _)| b.bytes()).sum::<usize>());
        let retired = self.retired.lock().map_or(0, |r| r.iter().map(|b| b.bytes()).sum::<usize>());
        held(&self.scratch) + held(&self.operands) + held(&self.masks) + ones + retired + blas::WORKSPACE_BYTES
    }
    /// Frees a replaced scratch or ones buffer, or keeps it when graphs may read it.
    fn retire(&self, old: super::launch::DeviceBuffer) {
        if self.graphs.load(Ordering::Acquire) {
            self.retired.lock().unwrap_or_else(|p| p.into_inner()).push(old);
        }
    }
    /// The stream to record a graph on, held for the recording (made on first use). Marks the
    /// runtime as having graphs: buffers they may read are kept from then on.
    pub fn capture_stream(&self) -> Result<MutexGuard<'_, Option<CaptureStream>>> {
        self.graphs.store(true, Ordering::Release);
        let mut guard = self.capture.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            self.bind()?;
            let s = driver::stream::create(driver::stream::StreamKind::NonBlocking)
                .map_err(|e| Error::Cuda(format!("creating the stream CUDA graphs are recorded on: {e}")))?;
            *guard = Some(CaptureStream(s));
        }
        Ok(guard)
    }
    /// Writes `value` into the u64 at device address `slot`, queued on `stream` (a kernel, so
    /// the value travels as an argument: no host memory has to outlive the call).
    pub fn write_u64(&self, stream: CUstream, slot: u64, value: u64) -> Result<()> {
        self.launch(stream, "fill_u64", Grid::elementwise(1, 1), &[KArg::Ptr(slot), KArg::I64(1), KArg::U64(value)])
    }
    /// A grid-stride launch over `n` elements: 256-thread blocks, at most 8 per SM.
    pub fn elementwise_grid(&self, n: usize) -> Grid {
        Grid::elementwise(n as i64, self.sms * 8)
    }
    /// Queues `g` on `stream`; the f32 gemms of mixed-precision sessions as 16-bit gemms
    /// (half_gemm.rs: both operands rounded into the operand scratch first).
    pub fn gemm(&self, stream: CUstream, g: &Gemm, a: u64, b: u64, c: u64) -> Result<()> {
        let Some(t) = half_gemm::half_type(g) else {
            return self.blas.gemm(stream, g, a, b, c);
        };
        let (na, nb, b_off) = (half_gemm::span_a(g), half_gemm::span_b(g), half_gemm::b_offset(g, t));
        let ws = self.grown(&self.operands, b_off + nb * t.size())?;
        for (src, dst, n) in [(a, ws, na), (b, ws + b_off as u64, nb)] {
            self.round_f32(stream, t, src, dst, n)?;
        }
        self.blas.gemm(stream, &Gemm { ab_type: t, f32_mode: F32Mode::Exact, ..*g }, ws, ws + b_off as u64, c)
    }
    /// Queues `D = alpha · op(A) · op(B) + beta · C` with `epilogue` (a bias, or a GELU's
    /// gradient) as one cuBLASLt product (blas_lt.rs); false, having queued nothing, where
    /// cuBLASLt cannot (the caller then runs the product and the rest apart).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_epilogue(&self, stream: CUstream, g: &Gemm, a: u64, b: u64, c: u64, d: u64, epilogue: Epilogue) -> Result<bool> {
        self.blas.gemm_epilogue(stream, g, a, b, c, d, epilogue)
    }
    /// Rounds `n` f32 values at `src` to the 16-bit type `t` (nearest even, as `gemm` rounds a
    /// mixed-precision session's operands) at `dst`, queued on `stream`.
    pub fn round_f32(&self, stream: CUstream, t: GemmType, src: u64, dst: u64, n: usize) -> Result<()> {
        let cast = format!("cast_f32_{}", half_suffix(t)?);
        if n == 0 {
            return Ok(());
        }
        self.launch(stream, &cast, self.elementwise_grid(n), &[KArg::Ptr(src), KArg::Ptr(dst), KArg::I64(n as i64)])
    }
    /// Rounds the `rows` × `cols` f32 matrix at `src` (row stride `ld_src`) to the 16-bit type
    /// `t` at `dst` with row stride `ld_dst` ≥ cols (the columns past `cols` zeroed), on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub fn round_f32_rows(
        &self,
        stream: CUstream,
        t: GemmType,
        src: u64,
        dst: u64,
        rows: usize,
        cols: usize,
        ld_src: usize,
        ld_dst: usize,
    ) -> Result<()> {
        let kernel = format!("cast_rows_f32_{}", half_suffix(t)?);
        if ld_dst < cols {
            return Err(Error::Cuda(format!("rounding rows of {cols} into a row stride of {ld_dst}")));
        }
        if rows == 0 || ld_dst == 0 {
            return Ok(());
        }
        let i = |v: usize| KArg::I64(v as i64);
        let grid = Grid::new(rows.min(1 << 20) as u32, 256);
        self.launch(stream, &kernel, grid, &[KArg::Ptr(src), KArg::Ptr(dst), i(rows), i(cols), i(ld_src), i(ld_dst)])
    }
    /// Device address of at least `bytes` bytes of the memory `gemm` rounds operands into, for
    /// a caller that rounds operands once (`round_f32`) and multiplies them several times as
    /// 16-bit gemms. Valid until the next call of this or of a rounding `gemm` (an f32 gemm of
    /// a mixed-precision mode), which write the same memory.
    pub fn operand_scratch(&self, bytes: usize) -> Result<u64> {
        self.grown(&self.operands, bytes)
    }
    /// Device address of at least `bytes` bytes for an attention mask made from key padding
    /// (`masks`). Valid until the next call.
    pub fn mask_scratch(&self, bytes: usize) -> Result<u64> {
        self.grown(&self.masks, bytes)
    }
    /// Queues a device-to-device copy of `bytes` bytes on `stream`.
    ///
    /// # Safety
    /// `dst` and `src` must be live, non-overlapping device allocations of this context holding
    /// at least `bytes` bytes, until the copy has run.
    pub unsafe fn copy(&self, stream: CUstream, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.bind()?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, stream) }.map_err(|e| Error::Cuda(format!("device copy: {e}")))
    }
    /// Makes the runtime's context current on this thread (PyTorch's primary context).
    pub fn bind(&self) -> Result<()> {
        self.loaded.ctx.bind_to_thread().map_err(|e| Error::Cuda(format!("binding the context: {e}")))
    }
}

/// The kernel suffix of a 16-bit float that f32 operands are rounded to.
pub(crate) fn half_suffix(t: GemmType) -> Result<&'static str> {
    match t {
        GemmType::Bf16 => Ok("bf16"),
        GemmType::F16 => Ok("f16"),
        other => Err(Error::Cuda(format!("no rounding of f32 to {other:?}"))),
    }
}
