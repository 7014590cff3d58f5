//! Who may use the runtime's shared buffers (the scratch and operand regions, runtime.rs) now.
//! They are one region each for the whole process, so work that uses them must not overlap:
//! a phase of a step (exec/cuda.rs `run_phase`) or a graph replay claims them for as long as
//! it queues work. Two threads that queue on one stream then queue whole phases one after the
//! other (two tests at once did interleave their kernels, and one test's LM head read the
//! other's logits: found by cuda-emu); and when the stream changes (two PyTorch streams), the
//! new stream first waits for everything queued on the previous one, by an event.
//!
//! A stream being recorded into a CUDA graph runs nothing, so its claim orders nothing; the
//! graph's launch claims the buffers on the stream it runs on.

use std::sync::{Mutex, MutexGuard};

use cudarc::driver::result::{event, stream};
use cudarc::driver::sys::{self, CUevent, CUstream};

use crate::error::{Error, Result};

#[derive(Default)]
pub struct Claims {
    inner: Mutex<Last>,
}

#[derive(Default)]
struct Last {
    /// The stream of the last claim that queued work (as an address), if any.
    stream: Option<usize>,
    /// Recorded on that stream when another one claims (made on first use).
    event: Option<Handle>,
}

struct Handle(CUevent);

// SAFETY: an event handle may be used from any thread; it is only used under the mutex.
unsafe impl Send for Handle {}

/// Held while work that uses the shared buffers is being queued.
pub struct Claim<'a> {
    _last: MutexGuard<'a, Last>,
}

impl Claims {
    /// Claims the shared buffers for work queued on `on` (the null stream is the legacy one).
    // the stream is an opaque handle passed to the driver, never dereferenced here
    #[allow(clippy::not_unsafe_ptr_arg_deref)]
    pub fn claim(&self, on: CUstream) -> Result<Claim<'_>> {
        let mut last = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: `on` is the caller's live stream (or null).
        let recording = unsafe { stream::is_capturing(on) }
            .map_err(|e| Error::Cuda(format!("asking whether the stream is recording: {e}")))?
            != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        if recording {
            return Ok(Claim { _last: last });
        }
        if let Some(prev) = last.stream.filter(|&p| p != on as usize) {
            let e = match &last.event {
                Some(h) => h.0,
                None => {
                    let e = event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                        .map_err(|e| Error::Cuda(format!("creating the event that orders streams: {e}")))?;
                    last.event = Some(Handle(e));
                    e
                }
            };
            // SAFETY: `e` is our live event; `prev` is live: streams that claim outlive the
            // runtime (PyTorch never destroys its streams; tests keep theirs), since a record
            // on a destroyed stream's handle is undefined behaviour. A failed record is skipped.
            if unsafe { event::record(e, prev as CUstream) }.is_ok() {
                // SAFETY: `on` and `e` are live; the wait is queued on `on`.
                unsafe { stream::wait_event(on, e, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
                    .map_err(|e| Error::Cuda(format!("ordering a stream after the previous one: {e}")))?;
            }
        }
        last.stream = Some(on as usize);
        Ok(Claim { _last: last })
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: made by `claim`, destroyed once, here.
        let _ = unsafe { event::destroy(self.0) };
    }
}
