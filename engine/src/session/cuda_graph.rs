//! A phase of a session's GPU step kept as a CUDA graph (backend/cuda/graph.rs): recorded the
//! first time the caller asks for a graphed run, replayed after. The slot remembers the memory
//! the graph was recorded over (plan, arena, seed slot, weights, bound outputs, gradient seeds
//! and gradients) and refuses to replay over any other: the caller (the Python side's graph
//! cache, engine/cuda_graphs.py) keeps that memory for the graph's life.

use std::sync::Mutex;

use cudarc::driver::sys::CUstream;

use crate::backend::cuda::graph::CudaGraph;
use crate::backend::cuda::runtime::CudaRuntime;
use crate::error::{Error, Result};

struct Recorded {
    graph: CudaGraph,
    over: Vec<u64>,
}

/// Where one phase's graph lives; empty until its first graphed run.
#[derive(Default)]
pub struct GraphSlot {
    inner: Mutex<Option<Recorded>>,
}

/// What a graphed forward phase needs besides the step's arguments.
pub struct Graphed<'a> {
    pub slot: &'a GraphSlot,
    /// Device address of a u64 the step's seed is written to before each replay (Dropout reads
    /// it there, `dropout_slot_T`); kept by the caller for the graph's life.
    pub seed_slot: u64,
}

/// How a phase runs: its kernels launched one by one, or through a graph.
pub enum PhaseRun<'a> {
    Launches,
    Graph(Graphed<'a>),
}

impl GraphSlot {
    /// Nodes of the recorded graph; None before it is recorded.
    pub fn nodes(&self) -> Option<usize> {
        self.inner.lock().ok().and_then(|g| g.as_ref().map(|r| r.graph.nodes()))
    }

    /// Replays the graph on `stream`, recording it first from `body` (which queues the phase's
    /// work on the stream it is given) when the slot is empty. `over`: every address the work
    /// uses that the caller owns, in a fixed order. Returns whether the graph was recorded now.
    ///
    /// # Safety
    /// The memory named in `over` (and the runtime's) must hold what the phase expects, and stay
    /// live and untouched by others until the queued work has run.
    pub unsafe fn run(
        &self,
        rt: &CudaRuntime,
        stream: CUstream,
        over: Vec<u64>,
        body: impl FnOnce(CUstream) -> Result<()>,
    ) -> Result<bool> {
        let mut slot = self.inner.lock().map_err(|_| Error::other("CUDA graph slot poisoned"))?;
        let recorded_now = slot.is_none();
        if let Some(r) = slot.as_ref() {
            if r.over != over {
                return Err(Error::Cuda(format!(
                    "this CUDA graph was recorded over other memory ({} addresses, {} differ): not replayed",
                    r.over.len(),
                    differing(&r.over, &over)
                )));
            }
        } else {
            *slot = Some(Recorded { graph: CudaGraph::record(rt, body)?, over });
        }
        let r = slot.as_ref().ok_or_else(|| Error::other("CUDA graph missing after recording"))?;
        // SAFETY: the graph was recorded over exactly `over` (checked above), which the caller
        // keeps live; launches are serialised by the slot's lock.
        unsafe { r.graph.launch(rt, stream) }?;
        Ok(recorded_now)
    }
}

/// Positions where two address lists differ (a longer list differs at its extra positions).
fn differing(a: &[u64], b: &[u64]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_lists_are_compared_position_by_position() {
        assert_eq!(differing(&[1, 2, 3], &[1, 2, 3]), 0);
        assert_eq!(differing(&[1, 2, 3], &[1, 9, 3]), 1);
        assert_eq!(differing(&[1, 2], &[1, 2, 3, 4]), 2);
    }

    #[test]
    fn an_empty_slot_has_no_graph() {
        assert_eq!(GraphSlot::default().nodes(), None);
    }
}
