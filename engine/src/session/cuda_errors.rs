//! The index-error flags of a session's GPU steps. Kernels that read indices (Gather and its
//! kin, GatherND, the losses' labels, MaxPoolGrad's saved indices) cannot fail: on an index out
//! of range they write 0 (or drop the gradient) and set an i32 flag; so do the dropout kernels on a
//! ratio computed in the step outside [0, 1) (their output is then NaN). Each graph node has its own
//! flag in one device buffer; after a step, an asynchronous copy of the buffer to pinned host
//! memory and an event are queued, and [`ErrorFlags::take`] reads that copy once the event has
//! completed, so checking never waits for the device. Flags stay set until they are reported,
//! then the next step clears them first.

use cudarc::driver::result;
use cudarc::driver::sys::{self, CUevent, CUstream};

use crate::backend::cuda::launch::DeviceBuffer;
use crate::backend::cuda::runtime::CudaRuntime;
use crate::error::{Error, Result};

pub struct ErrorFlags {
    dev: DeviceBuffer,
    /// `n` i32 in pinned host memory (cuMemHostAlloc), the destination of the copies.
    host: *mut i32,
    n: usize,
    event: CUevent,
    /// A copy was queued and has not been read.
    published: bool,
    /// Flags were reported: clear them before the next step's kernels run.
    clear_first: bool,
}

// SAFETY: the host buffer and the event belong to this value alone and are only touched
// through `&mut self` (the session keeps it behind a mutex).
unsafe impl Send for ErrorFlags {}

fn cuda(what: &str) -> impl Fn(result::DriverError) -> Error + '_ {
    move |e| Error::Cuda(format!("index-error flags, {what}: {e}"))
}

impl ErrorFlags {
    /// Flags for `n` nodes, all clear.
    pub fn new(rt: &CudaRuntime, n: usize) -> Result<Self> {
        let n = n.max(1);
        // cleared on the first step's stream (`clear_first`) before any kernel can set a flag
        let dev = DeviceBuffer::uninit(&rt.loaded.ctx, n * 4)?;
        // SAFETY: a plain allocation of n i32; zeroed below before any read.
        let host = unsafe { result::malloc_host(n * 4, 0) }.map_err(cuda("pinned allocation"))? as *mut i32;
        // SAFETY: `host` holds n i32 (allocated just above).
        unsafe { std::ptr::write_bytes(host, 0, n) };
        let event = match result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING) {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: allocated above by malloc_host, not used after this.
                let _ = unsafe { result::free_host(host as *mut _) };
                return Err(cuda("event")(e));
            }
        };
        // `begin` clears on the first step's own stream: ordered before its kernels on any
        // stream, a non-blocking one included
        Ok(ErrorFlags { dev, host, n, event, published: false, clear_first: true })
    }

    /// The device address of node `node`'s flag.
    pub fn flag(&self, node: usize) -> u64 {
        self.dev.ptr() + 4 * node.min(self.n - 1) as u64
    }

    /// Called before a step's kernels are queued on `stream`: clears reported flags.
    pub fn begin(&mut self, stream: CUstream) -> Result<()> {
        if self.clear_first {
            // SAFETY: the buffer holds n i32 of this context; stream-ordered before the step.
            unsafe { result::memset_d8_async(self.dev.ptr(), 0, self.n * 4, stream) }.map_err(cuda("clearing"))?;
            self.clear_first = false;
        }
        Ok(())
    }

    /// Called after a step's kernels are queued: the copy to host memory and the event after it.
    pub fn publish(&mut self, stream: CUstream) -> Result<()> {
        // SAFETY: `host` holds n i32 of pinned memory owned by self; the copy is stream-ordered
        // after the step's kernels, and the host side reads it only once the event completed.
        let host = unsafe { std::slice::from_raw_parts_mut(self.host, self.n) };
        // SAFETY: the device buffer holds n i32; both live as long as self (Drop waits for nothing,
        // but frees the host buffer only after synchronising the event).
        unsafe { result::memcpy_dtoh_async(host, self.dev.ptr(), stream) }.map_err(cuda("copy"))?;
        // SAFETY: the event and the stream are live.
        unsafe { result::event::record(self.event, stream) }.map_err(cuda("event record"))?;
        self.published = true;
        Ok(())
    }

    /// The nodes whose flag the last published step left set, once its copy has landed; empty
    /// while it has not (nothing waits) or when none is set.
    pub fn take(&mut self) -> Result<Vec<usize>> {
        if !self.published {
            return Ok(Vec::new());
        }
        // SAFETY: the event is live.
        match unsafe { result::event::query(self.event) } {
            Ok(()) => {}
            Err(result::DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => return Ok(Vec::new()),
            Err(e) => return Err(cuda("event query")(e)),
        }
        self.published = false;
        // SAFETY: the copy into `host` has completed (the event after it has).
        let host = unsafe { std::slice::from_raw_parts(self.host, self.n) };
        let set: Vec<usize> = host.iter().enumerate().filter(|(_, &f)| f != 0).map(|(i, _)| i).collect();
        if !set.is_empty() {
            self.clear_first = true;
        }
        Ok(set)
    }
}

impl Drop for ErrorFlags {
    fn drop(&mut self) {
        // SAFETY: the event is live; waiting for it means no queued copy still writes `host`.
        unsafe {
            let _ = result::event::synchronize(self.event);
            let _ = result::event::destroy(self.event);
            let _ = result::free_host(self.host as *mut _);
        }
    }
}
