//! Launching a registered kernel with raw device addresses, and plain device buffers. The
//! executor and the GPU tests work with addresses (PyTorch tensors' `data_ptr`, offsets into a
//! planned arena), not with cudarc's typed slices, so a launch takes a list of [`KArg`] values;
//! it is checked against the kernel's registered signature (registry.rs, the same signature the
//! CUBIN layout test checks), so a wrong argument list is an error naming the kernel and the
//! position, never a corrupt launch.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaFunction};

use super::abi::{Arg, AttnShape, Reduce, Strides, Win2d};
use super::registry;
use crate::error::{Error, Result};

/// One kernel argument, by value.
#[derive(Clone, Copy, Debug)]
pub enum KArg {
    /// A device address.
    Ptr(u64),
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
    F64(f64),
    Strides(Strides),
    Reduce(Reduce),
    AttnShape(AttnShape),
    Win2d(Win2d),
}

impl KArg {
    pub fn kind(&self) -> Arg {
        match self {
            KArg::Ptr(_) => Arg::Ptr,
            KArg::I32(_) => Arg::I32,
            KArg::I64(_) => Arg::I64,
            KArg::U64(_) => Arg::U64,
            KArg::F32(_) => Arg::F32,
            KArg::F64(_) => Arg::F64,
            KArg::Strides(_) => Arg::Strides,
            KArg::Reduce(_) => Arg::Reduce,
            KArg::AttnShape(_) => Arg::AttnShape,
            KArg::Win2d(_) => Arg::Win2d,
        }
    }
    fn as_param(&mut self) -> *mut c_void {
        match self {
            KArg::Ptr(v) | KArg::U64(v) => v as *mut u64 as *mut c_void,
            KArg::I32(v) => v as *mut i32 as *mut c_void,
            KArg::I64(v) => v as *mut i64 as *mut c_void,
            KArg::F32(v) => v as *mut f32 as *mut c_void,
            KArg::F64(v) => v as *mut f64 as *mut c_void,
            KArg::Strides(v) => v as *mut Strides as *mut c_void,
            KArg::Reduce(v) => v as *mut Reduce as *mut c_void,
            KArg::AttnShape(v) => v as *mut AttnShape as *mut c_void,
            KArg::Win2d(v) => v as *mut Win2d as *mut c_void,
        }
    }
}

/// Launch geometry: a 1-D grid of `blocks` blocks of `threads` threads, `shared` bytes of
/// dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    pub blocks: u32,
    pub threads: u32,
    pub shared: u32,
}

impl Grid {
    pub fn new(blocks: u32, threads: u32) -> Self {
        Grid { blocks, threads, shared: 0 }
    }
    /// Enough 256-thread blocks for a grid-stride loop over `n` elements, capped at `max_blocks`
    /// (the loop covers the rest) and at least one.
    pub fn elementwise(n: i64, max_blocks: u32) -> Self {
        let blocks = (n.max(1) as u64).div_ceil(256).min(max_blocks.max(1) as u64) as u32;
        Grid::new(blocks, 256)
    }
}

/// Checks `args` against the registered signature of `kernel`.
pub fn check_args(kernel: &str, args: &[KArg]) -> Result<()> {
    let sig = registry::signature(kernel).ok_or_else(|| Error::Cuda(format!("no CUDA kernel named {kernel}")))?;
    check_against(kernel, sig, args)
}

/// Checks `args` against a signature already looked up (the runtime caches it per kernel).
pub fn check_against(kernel: &str, sig: &[Arg], args: &[KArg]) -> Result<()> {
    if sig.len() != args.len() {
        return Err(Error::Cuda(format!("{kernel} takes {} arguments, {} given", sig.len(), args.len())));
    }
    for (i, (want, got)) in sig.iter().zip(args).enumerate() {
        if *want != got.kind() {
            return Err(Error::Cuda(format!("{kernel}: argument {i} must be {want:?}, not {:?}", got.kind())));
        }
    }
    Ok(())
}

/// Launches `func` (the kernel `kernel`) on `stream` (a raw stream handle: PyTorch's current
/// stream in the executor; null is the legacy default stream) after checking the arguments.
// the stream is an opaque handle passed to the driver, never dereferenced here
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn launch(func: &CudaFunction, kernel: &str, stream: sys::CUstream, grid: Grid, args: &[KArg]) -> Result<()> {
    check_args(kernel, args)?;
    let static_shared = if grid.shared > 0 { static_shared(func, kernel)? } else { 0 };
    launch_unchecked_args(func, kernel, static_shared, stream, grid, args)
}

/// The static shared memory of `func` (the kernel `kernel`), with the 1 KiB sm_80+ reserves:
/// beside a launch's dynamic shared memory it counts toward the 48 KiB a block has unasked.
pub(crate) fn static_shared(func: &CudaFunction, kernel: &str) -> Result<u32> {
    // SAFETY: the function handle is live (owned by `func`'s module); the query writes one int.
    let bytes = unsafe {
        result::function::get_function_attribute(func.cu_function(), sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
    }
    .map_err(|e| Error::Cuda(format!("{kernel}: its static shared memory: {e}")))?;
    Ok(bytes.max(0) as u32)
}

/// As [`launch`], for arguments the caller has checked against the kernel's signature and the
/// kernel's `static_shared` memory (0 serves launches without dynamic shared memory).
// the stream is an opaque handle passed to the driver, never dereferenced here
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub(crate) fn launch_unchecked_args(
    func: &CudaFunction,
    kernel: &str,
    static_shared: u32,
    stream: sys::CUstream,
    grid: Grid,
    args: &[KArg],
) -> Result<()> {
    // gridDim.x is at most 2^31 - 1 blocks, a block at most 1024 threads
    if grid.blocks == 0 || grid.blocks > i32::MAX as u32 || grid.threads == 0 || grid.threads > 1024 {
        return Err(Error::Cuda(format!("{kernel}: bad launch geometry {grid:?}")));
    }
    // on the stack: a launch allocates nothing (kernels take at most 14 parameters)
    const MAX_ARGS: usize = 16;
    if args.len() > MAX_ARGS {
        return Err(Error::Cuda(format!("{kernel}: {} arguments, at most {MAX_ARGS}", args.len())));
    }
    let mut values = [KArg::I32(0); MAX_ARGS];
    values[..args.len()].copy_from_slice(args);
    let mut params = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
    for (p, v) in params.iter_mut().zip(values.iter_mut()).take(args.len()) {
        if let KArg::Strides(s) = v {
            s.fill_dividers();
        }
        *p = v.as_param();
    }
    let params = &mut params[..args.len()];
    // more than 48 KiB of shared memory in a block, static and dynamic together, must be asked
    // for per function (Hopper: 227 KiB)
    if grid.shared > 0 && grid.shared + static_shared > 48 * 1024 {
        // SAFETY: the function handle is live (owned by `func`'s module); the attribute only
        // raises the function's dynamic shared memory limit.
        unsafe {
            result::function::set_function_attribute(
                func.cu_function(),
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                grid.shared as i32,
            )
        }
        .map_err(|e| Error::Cuda(format!("{kernel}: {} bytes of shared memory: {e}", grid.shared)))?;
    }
    // SAFETY: `params` holds one pointer per kernel parameter, each to a live value of the
    // parameter's registered type (checked above; the registry's layouts are checked against the
    // CUBIN by engine/tests/cuda_kernels.rs), and `values` outlives the call. Device addresses
    // inside are the caller's responsibility, as for any launch.
    unsafe { result::launch_kernel(func.cu_function(), (grid.blocks, 1, 1), (grid.threads, 1, 1), grid.shared, stream, params) }
        .map_err(|e| Error::Cuda(format!("launching {kernel} {grid:?}: {e}")))
}

/// Waits for the legacy default stream of the current context (where cudarc's "synchronous"
/// memset and copies run).
fn legacy_stream_done() -> std::result::Result<(), result::DriverError> {
    // SAFETY: the null handle is the legacy default stream of the context current on this
    // thread (the callers bound it).
    unsafe { result::stream::synchronize(std::ptr::null_mut()) }
}

/// A device allocation of `bytes` bytes in the context's device, freed on drop (synchronous
/// cuMemAlloc/cuMemFree: for tests and one-off buffers; the executor's memory is one arena).
pub struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ptr: u64,
    bytes: usize,
}

impl DeviceBuffer {
    /// A buffer of unspecified contents, for memory that is written before it is read (on the
    /// stream that reads it).
    pub fn uninit(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        ctx.bind_to_thread().map_err(|e| Error::Cuda(format!("binding the context: {e}")))?;
        // SAFETY: the context is current on this thread; a zero-byte request allocates one byte
        // so every buffer has a distinct, valid address.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }.map_err(|e| Error::Cuda(format!("allocating {bytes} bytes: {e}")))?;
        Ok(DeviceBuffer { ctx: ctx.clone(), ptr, bytes })
    }
    /// A buffer of zeros, complete before any later work on any stream: cuMemsetD8 on device
    /// memory may return before it is done, on the legacy stream, which PyTorch's non-blocking
    /// side streams do not wait for; so the legacy stream is synchronised (allocation time only).
    pub fn zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        // owned from here, so a failed memset frees it (drop)
        let buf = Self::uninit(ctx, bytes)?;
        // SAFETY: `ptr` was just allocated with at least `bytes.max(1)` bytes.
        unsafe { result::memset_d8_sync(buf.ptr, 0, bytes.max(1)) }.map_err(|e| Error::Cuda(format!("zeroing {bytes} bytes: {e}")))?;
        legacy_stream_done().map_err(|e| Error::Cuda(format!("zeroing {bytes} bytes: {e}")))?;
        Ok(buf)
    }
    /// A buffer holding a copy of `data`, complete before any later work on any stream (a copy
    /// from pageable memory may return before its DMA is done: as for `zeroed`).
    pub fn from_slice<T: Copy>(ctx: &Arc<CudaContext>, data: &[T]) -> Result<Self> {
        let b = Self::uninit(ctx, std::mem::size_of_val(data))?;
        if !data.is_empty() {
            // SAFETY: the buffer has exactly `size_of_val(data)` bytes; T is plain data (Copy).
            unsafe { result::memcpy_htod_sync(b.ptr, data) }.map_err(|e| Error::Cuda(format!("copying to the device: {e}")))?;
            legacy_stream_done().map_err(|e| Error::Cuda(format!("copying to the device: {e}")))?;
        }
        Ok(b)
    }
    /// Copies the buffer back as `T`s (waits for all work on the device).
    pub fn to_vec<T: Copy + Default>(&self) -> Result<Vec<T>> {
        let n = self.bytes / std::mem::size_of::<T>();
        let mut out = vec![T::default(); n];
        self.ctx.synchronize().map_err(|e| Error::Cuda(format!("waiting for the device: {e}")))?;
        if n > 0 {
            // SAFETY: `out` has room for n·size_of::<T>() ≤ self.bytes bytes, all of them device
            // memory this buffer owns; T is plain data.
            unsafe { result::memcpy_dtoh_sync(&mut out, self.ptr) }.map_err(|e| Error::Cuda(format!("copying from the device: {e}")))?;
        }
        Ok(out)
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn arg(&self) -> KArg {
        KArg::Ptr(self.ptr)
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from malloc_sync in this context and is freed once, here.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}
