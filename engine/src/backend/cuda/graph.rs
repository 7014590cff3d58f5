//! CUDA graphs: the work one phase of a step queues, recorded once by stream capture and
//! replayed with a single `cuGraphLaunch` (the tutorial's step is ~230 launches of a few µs of
//! GPU work each: host-bound without a graph). A graph keeps every address and kernel argument
//! it was recorded with, so the caller replays it only over the same memory (session/cuda.rs
//! checks that) and anything that changes per step is read from device memory (the dropout
//! seed, `dropout_slot_T`).
//!
//! Recording runs on the runtime's own non-blocking stream (PyTorch's default stream is the
//! legacy NULL stream, which cannot be captured) in thread-local mode: an operation that cannot
//! be recorded (an allocation, a synchronous copy) fails the recording with an error, never the
//! process, and the caller runs the step without a graph instead. Nothing runs while recording:
//! the caller launches the graph afterwards to do the step's work.

use cudarc::driver::result::graph;
use cudarc::driver::sys::{self, CUgraph, CUgraphExec, CUstream};

use super::runtime::CudaRuntime;
use crate::error::{Error, Result};

/// A recorded, instantiated graph (destroyed on drop; a launch still running completes first,
/// as the driver frees an executable graph in flight only after it has run).
pub struct CudaGraph {
    graph: CUgraph,
    exec: CUgraphExec,
    nodes: usize,
}

// SAFETY: graph handles may be used from any thread; the owner serialises launches of one graph
// (session/cuda.rs keeps it behind a mutex), as the driver requires.
unsafe impl Send for CudaGraph {}
// SAFETY: shared references only read `nodes`; launching needs the owner's lock (see above).
unsafe impl Sync for CudaGraph {}

fn driver_err(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Cuda(format!("CUDA graph, {what}: {e}"))
}

impl CudaGraph {
    /// Records the work `body` queues on the stream it is given (no work runs), then
    /// instantiates it. An error of `body` is returned as it is; an operation that cannot be
    /// recorded is an error naming the recording.
    pub fn record(rt: &CudaRuntime, body: impl FnOnce(CUstream) -> Result<()>) -> Result<CudaGraph> {
        let guard = rt.capture_stream()?;
        let stream = guard.as_ref().map(|s| s.0).ok_or_else(|| Error::Cuda("no stream to record a CUDA graph on".into()))?;
        rt.bind()?;
        // SAFETY: `stream` is our live stream, used by no one else while the guard is held; the
        // mode confines the capture's restrictions to this thread.
        unsafe { sys::cuStreamBeginCapture_v2(stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) }
            .result()
            .map_err(driver_err("starting the recording"))?;
        // a panic in `body` must still end the capture: a stream (and, in thread-local mode, a
        // thread) left capturing would fail every later recording and PyTorch's own calls
        let recorded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(stream)))
            .unwrap_or_else(|_| Err(Error::Cuda("CUDA graph: the step panicked while being recorded".into())));
        let mut g: CUgraph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above on the same stream (always, also after an error
        // of `body`, so the stream leaves capture mode); writes the graph handle or null.
        let ended = unsafe { sys::cuStreamEndCapture(stream, &mut g) }.result();
        let destroy = |g: CUgraph| {
            if !g.is_null() {
                // SAFETY: a graph handle made by the capture above, destroyed once.
                let _ = unsafe { graph::destroy(g) };
            }
        };
        if let Err(e) = recorded {
            destroy(g);
            return Err(e);
        }
        if let Err(e) = ended {
            destroy(g);
            return Err(Error::Cuda(format!(
                "CUDA graph: the step could not be recorded ({e}): an operation that cannot be part of a graph ran during it"
            )));
        }
        if g.is_null() {
            return Err(Error::Cuda("CUDA graph: the recording produced no graph".into()));
        }
        let mut nodes = 0usize;
        // SAFETY: `g` is a valid graph; a null node array asks for the count only.
        if let Err(e) = unsafe { sys::cuGraphGetNodes(g, std::ptr::null_mut(), &mut nodes) }.result() {
            destroy(g);
            return Err(driver_err("counting its nodes")(e));
        }
        // SAFETY: `g` is a valid graph made above.
        let exec = match unsafe { graph::instantiate(g, sys::CUgraphInstantiate_flags(0)) } {
            Ok(x) => x,
            Err(e) => {
                destroy(g);
                return Err(driver_err("instantiating")(e));
            }
        };
        Ok(CudaGraph { graph: g, exec, nodes })
    }

    /// Queues the recorded work on `stream`, after the work already queued there.
    ///
    /// # Safety
    /// Every address the graph was recorded with must still be live device memory holding what
    /// the recorded work expects; launches of one graph must not race from several threads.
    pub unsafe fn launch(&self, rt: &CudaRuntime, stream: CUstream) -> Result<()> {
        rt.bind()?;
        let _claim = rt.claim(stream)?;
        // SAFETY: the executable graph is live (owned); the memory it reads and writes is the
        // caller's contract.
        unsafe { graph::launch(self.exec, stream) }.map_err(driver_err("launching"))
    }

    /// Nodes in the graph (kernels, copies, memsets, cuBLAS's kernels).
    pub fn nodes(&self) -> usize {
        self.nodes
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: both handles were made by `record` and are destroyed once, here.
        unsafe {
            let _ = graph::exec_destroy(self.exec);
            let _ = graph::destroy(self.graph);
        }
    }
}
