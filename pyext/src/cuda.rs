//! The GPU step from Python: functions over a Session whose tensors are PyTorch CUDA tensors
//! (device addresses from `data_ptr()`), queued on PyTorch's current stream of their GPU (its
//! handle from `torch.cuda.current_stream(device).cuda_stream`), with the arena a CUDA tensor the
//! caller allocates. `device` is the GPU's ordinal (`cuda:<device>`; 0 when not given). Nothing
//! here synchronises the device.

use std::sync::Arc;

use ortrain_engine::backend::cuda::optim::TensorList;
use ortrain_engine::backend::cuda::runtime::{self, CudaRuntime};
use ortrain_engine::optim::AdamHyper;
use ortrain_engine::session::cuda::CudaPending;
use ortrain_engine::session::cuda_graph::{GraphSlot, Graphed, PhaseRun};
use ortrain_engine::session::{Session, Sig};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::session::{dtype, to_py, Addr, PySession};

#[pyclass(name = "CudaPending", module = "ortrain._ortrain")]
pub struct PyCudaPending {
    inner: Option<CudaPending>,
    session: Arc<Session>,
}

/// One phase of a GPU step as a CUDA graph: empty until the first run given it records the
/// graph, replayed by the runs after (over the same memory only: the caller keeps it).
#[pyclass(name = "CudaGraph", module = "ortrain._ortrain", frozen)]
pub struct PyCudaGraph {
    slot: Arc<GraphSlot>,
}

#[pymethods]
impl PyCudaGraph {
    #[new]
    fn new() -> Self {
        PyCudaGraph { slot: Arc::new(GraphSlot::default()) }
    }

    /// Nodes of the recorded graph (kernels, copies, memsets); None before it is recorded.
    #[getter]
    fn nodes(&self) -> Option<usize> {
        self.slot.nodes()
    }
}

fn rt(device: usize) -> PyResult<&'static CudaRuntime> {
    runtime::runtime(device, &[]).map_err(to_py)
}

fn sigs(v: Vec<(String, Vec<usize>)>) -> PyResult<Vec<Sig>> {
    v.into_iter().map(|(d, s)| Ok((dtype(&d)?, s))).collect()
}

/// Arena bytes of the GPU step for inputs of these (dtype, shape); `out_bound[k]`: output k is
/// written into caller memory.
#[pyfunction]
#[pyo3(signature = (session, inputs, backward, out_bound=None))]
fn cuda_arena_bytes(
    session: &PySession,
    inputs: Vec<(String, Vec<usize>)>,
    backward: bool,
    out_bound: Option<Vec<bool>>,
) -> PyResult<usize> {
    session.inner.arena_bytes(&sigs(inputs)?, backward, &out_bound.unwrap_or_default()).map_err(to_py)
}

/// The nodes ("Gather node 'emb'") whose GPU kernels met an index out of range in a step whose
/// results have landed since the last call (their outputs were 0 there, their gradients
/// dropped); empty when none did. Never waits for the device.
#[pyfunction]
fn cuda_index_errors(session: &PySession) -> PyResult<Vec<String>> {
    session.inner.index_errors_cuda().map_err(to_py)
}

/// Per fused attention of the session's graph, (node name, the kernels its last GPU launch
/// chose, or None before its first launch): what explain() reports.
#[pyfunction]
fn cuda_attention_paths(session: &PySession) -> Vec<(String, Option<&'static str>)> {
    session.inner.attention_paths_cuda()
}

/// Queues the forward pass on `stream`: `inputs` (address, dtype, shape) per model input,
/// `weights` one address per weight, `outputs` (optional) per output an address receiving it (0:
/// kept in the arena), `arena` the address of cuda_arena_bytes(...) bytes, `tf32`: f32 matmuls
/// may use TF32 tensor cores (this step's forward and backward). `graph`: run the phase through
/// this CudaGraph (recording it on its first use) with the seed written to the u64 at device
/// address `seed_slot` first.
#[pyfunction]
#[pyo3(signature = (session, inputs, weights, backward, seed, stream, arena, outputs=None, tf32=false, graph=None, seed_slot=0, device=0))]
#[allow(clippy::too_many_arguments)]
fn cuda_forward(
    py: Python<'_>,
    session: &PySession,
    inputs: Vec<(usize, String, Vec<usize>)>,
    weights: Vec<usize>,
    backward: bool,
    seed: u64,
    stream: usize,
    arena: usize,
    outputs: Option<Vec<usize>>,
    tf32: bool,
    graph: Option<&PyCudaGraph>,
    seed_slot: usize,
    device: usize,
) -> PyResult<PyCudaPending> {
    if graph.is_some() && seed_slot == 0 {
        return Err(PyRuntimeError::new_err("a graphed forward pass needs a seed_slot (device address of a u64)"));
    }
    let rt = rt(device)?;
    let mut feed = Vec::with_capacity(inputs.len());
    for (addr, dt, shape) in inputs {
        feed.push(((dtype(&dt)?, shape), addr as u64));
    }
    let w: Vec<u64> = weights.into_iter().map(|a| a as u64).collect();
    let o: Vec<u64> = outputs.unwrap_or_default().into_iter().map(|a| a as u64).collect();
    let (s, st) = (session.inner.clone(), Addr(stream));
    let slot = graph.map(|g| g.slot.clone());
    let pending = py
        .detach(move || {
            let st = st;
            let run = match &slot {
                None => PhaseRun::Launches,
                Some(slot) => PhaseRun::Graph(Graphed { slot, seed_slot: seed_slot as u64 }),
            };
            // SAFETY: the Python caller passes live CUDA tensors of the declared types (inputs,
            // weights, bound outputs) and an arena tensor of the planned size, all kept alive
            // until the queued work has run (graphed: the arena and the seed slot for the graph's
            // life); the stream is PyTorch's current stream.
            unsafe { s.forward_cuda(rt, st.0 as _, arena as u64, &feed, &w, backward, seed, &o, tf32, run) }
        })
        .map_err(to_py)?;
    Ok(PyCudaPending { inner: Some(pending), session: session.inner.clone() })
}

/// Queues the backward pass of `pending` on `stream`: `seeds` one address per output (0: none),
/// `grads` one address per weight (0: not wanted); `graph`: through this CudaGraph (recorded on
/// its first use).
#[pyfunction]
#[pyo3(signature = (session, pending, weights, seeds, grads, stream, graph=None, device=0))]
#[allow(clippy::too_many_arguments)]
fn cuda_backward(
    py: Python<'_>,
    session: &PySession,
    pending: &mut PyCudaPending,
    weights: Vec<usize>,
    seeds: Vec<usize>,
    grads: Vec<usize>,
    stream: usize,
    graph: Option<&PyCudaGraph>,
    device: usize,
) -> PyResult<()> {
    let rt = rt(device)?;
    let mut p = pending
        .inner
        .take()
        .ok_or_else(|| PyRuntimeError::new_err("this forward pass was already used for a backward pass or released"))?;
    let c = |v: Vec<usize>| v.into_iter().map(|a| a as u64).collect::<Vec<u64>>();
    let (w, sd, g) = (c(weights), c(seeds), c(grads));
    let (s, st) = (session.inner.clone(), Addr(stream));
    let slot = graph.map(|g| g.slot.clone());
    let (p, done) = py.detach(move || {
        let st = st;
        // SAFETY: as for cuda_forward; gradient buffers are written only by the queued work
        // (graphed: the seeds' and gradients' memory is kept for the graph's life).
        let done = unsafe { s.backward_cuda(rt, st.0 as _, &mut p, &w, &sd, &g, slot.as_deref()) };
        (p, done)
    });
    if done.is_err() && !p.spent() {
        pending.inner = Some(p); // nothing was queued (a failed recording): the step can still run without it
    }
    done.map_err(to_py)
}

#[pymethods]
impl PyCudaPending {
    /// (device address, dtype, shape) of output k; valid until the backward pass or release().
    fn output(&self, k: usize) -> PyResult<(usize, String, Vec<usize>)> {
        let p = self.inner.as_ref().ok_or_else(|| PyRuntimeError::new_err("this forward pass was released"))?;
        let (a, dt, shape) = self.session.output_cuda(p, k).map_err(to_py)?;
        Ok((a as usize, dt.name().to_string(), shape))
    }

    #[getter]
    fn arena_bytes(&self) -> usize {
        self.inner.as_ref().map_or(0, |p| p.plan.arena_bytes)
    }

    /// Drops the step (a forward pass that needs no backward pass).
    fn release(&mut self) {
        self.inner = None;
    }
}

/// Device bytes ortrain's CUDA runtime of GPU `device` holds outside PyTorch's allocator
/// (scratch and operand buffers, cuBLAS's workspace): what torch.cuda's memory statistics do not
/// see. 0 before that runtime exists.
#[pyfunction]
#[pyo3(signature = (device=0))]
fn cuda_runtime_bytes(device: usize) -> usize {
    runtime::loaded_runtime(device).map_or(0, |rt| rt.own_bytes())
}

/// Queues a copy of `bytes` bytes from device address `src` to `dst` on `stream`.
#[pyfunction]
#[pyo3(signature = (dst, src, bytes, stream, device=0))]
fn cuda_copy(dst: usize, src: usize, bytes: usize, stream: usize, device: usize) -> PyResult<()> {
    // SAFETY: the Python caller passes two live CUDA allocations of at least `bytes` bytes that
    // do not overlap, and PyTorch's current stream.
    unsafe { rt(device)?.copy(stream as _, dst as u64, src as u64, bytes) }.map_err(to_py)
}

/// The engine's view of a multi-tensor launch's table and chunk lists (device addresses).
fn tensor_list(table: usize, chunk_tensor: usize, chunk_start: usize, chunks: usize) -> TensorList {
    TensorList { table: table as u64, chunk_tensor: chunk_tensor as u64, chunk_start: chunk_start as u64, chunks }
}

/// The chunk list of a fused optimizer update over tensors of these sizes: (tensor index, first
/// element) per chunk, for cuda_adam_step.
#[pyfunction]
fn cuda_optim_chunks(sizes: Vec<usize>) -> (Vec<i32>, Vec<i64>) {
    ortrain_engine::backend::cuda::optim::chunk_list(&sizes)
}

/// Queues one Adam/AdamW update (f32 parameters, gradients and moments) on `stream` over the
/// tensors that `table` describes: a device int64 [n, 5] tensor of (param, grad, exp_avg,
/// exp_avg_sq addresses, numel) rows; `chunk_tensor` / `chunk_start` are device copies of
/// cuda_optim_chunks(numels), `chunks` their length; `step` is the step count after this update.
#[pyfunction]
#[pyo3(signature = (table, chunk_tensor, chunk_start, chunks, lr, beta1, beta2, eps, weight_decay, decoupled, maximize, step, stream, device=0))]
#[allow(clippy::too_many_arguments)]
fn cuda_adam_step(
    table: usize,
    chunk_tensor: usize,
    chunk_start: usize,
    chunks: usize,
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    decoupled: bool,
    maximize: bool,
    step: u64,
    stream: usize,
    device: usize,
) -> PyResult<()> {
    let h = AdamHyper { lr, beta1, beta2, eps, weight_decay, decoupled, maximize, step };
    // SAFETY: the Python caller (engine/optimizer.py) passes device tensors it keeps alive in
    // stream order: the table of live, distinct f32 tensors and the chunk lists made for them.
    unsafe {
        ortrain_engine::backend::cuda::optim::adam_f32(rt(device)?, stream as _, &tensor_list(table, chunk_tensor, chunk_start, chunks), &h)
    }
    .map_err(to_py)
}

/// Queues torch.nn.utils.clip_grad_norm_ (L2, max_norm) on `stream` over the f32 gradients that
/// `table` describes: a device int64 [n, 2] tensor of (address, numel) rows; the chunk lists as
/// for cuda_adam_step; `partial` a device f64 tensor of `chunks` elements; the total norm and the
/// clip coefficient are written to the device f32s at `norm` and `coef`.
#[pyfunction]
#[pyo3(signature = (table, chunk_tensor, chunk_start, chunks, max_norm, partial, norm, coef, stream, device=0))]
#[allow(clippy::too_many_arguments)]
fn cuda_clip_grad_norm(
    table: usize,
    chunk_tensor: usize,
    chunk_start: usize,
    chunks: usize,
    max_norm: f32,
    partial: usize,
    norm: usize,
    coef: usize,
    stream: usize,
    device: usize,
) -> PyResult<()> {
    // SAFETY: the Python caller (engine/clip.py) passes device tensors it keeps alive in stream
    // order: the table of live, distinct f32 gradients, the chunk lists made for them, and the
    // partial sums, norm and coefficient buffers, which alias none of them.
    unsafe {
        ortrain_engine::backend::cuda::optim::clip_f32(
            rt(device)?,
            stream as _,
            &tensor_list(table, chunk_tensor, chunk_start, chunks),
            max_norm,
            partial as u64,
            norm as u64,
            coef as u64,
        )
    }
    .map_err(to_py)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCudaPending>()?;
    m.add_class::<PyCudaGraph>()?;
    m.add_function(wrap_pyfunction!(cuda_optim_chunks, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_adam_step, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_clip_grad_norm, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_copy, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_runtime_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_arena_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_forward, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_index_errors, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_attention_paths, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_backward, m)?)?;
    Ok(())
}
