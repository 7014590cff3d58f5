//! Python classes over engine::session: Session (an imported model with its gradient graph) and
//! Pending (a forward pass awaiting its backward pass). Tensors cross as (address, dtype, shape)
//! triples taken from torch's data_ptr(): the Python side keeps them alive and contiguous.

use std::sync::Arc;

use ortrain_engine::backend::cpu::bf16::MatmulPrecision;
use ortrain_engine::ir::ValueId;
use ortrain_engine::plan::Storage;
use ortrain_engine::session::{Pending, Session, SessionOptions, Sig, Target};
use ortrain_engine::{DType, Error};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

pyo3::create_exception!(_ortrain, EngineError, pyo3::exceptions::PyRuntimeError);

/// One plan step for Python: (op type, node name, [(output name, dtype, shape)]).
type PlanStep = (String, String, Vec<(String, String, Vec<usize>)>);
/// A step's inputs as (dtype, shape), None for an absent optional one, and whether it is a view.
type StepInputs = (Vec<Option<(String, Vec<usize>)>>, bool);

pub fn to_py(e: Error) -> PyErr {
    EngineError::new_err(e.to_string())
}

/// A raw tensor address crossing the GIL boundary.
#[derive(Clone, Copy)]
pub(crate) struct Addr(pub(crate) usize);
// SAFETY: addresses are plain integers here; the Python caller guarantees the memory stays
// valid for the call (it holds the torch tensors), whichever thread the engine runs on.
unsafe impl Send for Addr {}

pub(crate) fn dtype(name: &str) -> PyResult<DType> {
    DType::from_name(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unsupported element type '{name}' (supported: float32, float64, int64, int32, bool, uint8, int8, bfloat16, float16)"
        ))
    })
}

fn options(matmul_precision: &str, target: Target) -> PyResult<SessionOptions> {
    let matmul_precision = MatmulPrecision::parse(matmul_precision).map_err(PyValueError::new_err)?;
    if matmul_precision == MatmulPrecision::Fp16 && target == Target::Cpu {
        return Err(PyValueError::new_err(
            "matmul_precision='fp16' needs device='cuda' (fp16 matmuls run on cuBLAS); on the CPU use 'bf16'",
        ));
    }
    Ok(SessionOptions { matmul_precision, ..Default::default() })
}

#[pyclass(frozen, name = "Session", module = "ortrain._ortrain")]
pub struct PySession {
    pub(crate) inner: Arc<Session>,
}

#[pyclass(name = "Pending", module = "ortrain._ortrain")]
pub struct PyPending {
    inner: Option<Pending>,
    session: Arc<Session>,
}

#[pymethods]
impl PySession {
    /// Imports an ONNX model; `weights` are the initializer names bound per call, `trainable`
    /// flags which of them get gradients. `seeded` (optional, one flag per output): False for
    /// outputs that carry no gradient. `matmul_precision`: "fp32", "fp16" (CUDA only) or "bf16" (matmul products in
    /// bf16 with f32 accumulation, where the CPU has avx512_bf16 or AMX). `device`: "cpu" or
    /// "cuda", the backend its plans run on (graph passes without kernels there are skipped).
    #[new]
    #[pyo3(signature = (onnx, weights, trainable, seeded = None, matmul_precision = "fp32", device = "cpu"))]
    fn new(
        py: Python<'_>,
        onnx: &Bound<'_, PyBytes>,
        weights: Vec<String>,
        trainable: Vec<bool>,
        seeded: Option<Vec<bool>>,
        matmul_precision: &str,
        device: &str,
    ) -> PyResult<Self> {
        let target = match device {
            "cpu" => Target::Cpu,
            "cuda" => Target::Cuda,
            other => return Err(PyValueError::new_err(format!("device '{other}' is not one of cpu, cuda"))),
        };
        let opts = options(matmul_precision, target)?;
        let bytes = onnx.as_bytes().to_vec();
        let s = py
            .detach(move || Session::from_onnx_with(&bytes, None, &weights, &trainable, seeded.as_deref(), target, opts))
            .map_err(to_py)?;
        Ok(PySession { inner: Arc::new(s) })
    }

    /// Imports an ONNX file; external data files are read from the file's folder.
    #[staticmethod]
    #[pyo3(signature = (path, weights, trainable, matmul_precision = "fp32"))]
    fn load(
        py: Python<'_>,
        path: std::path::PathBuf,
        weights: Vec<String>,
        trainable: Vec<bool>,
        matmul_precision: &str,
    ) -> PyResult<Self> {
        let opts = options(matmul_precision, Target::Cpu)?;
        let s = py
            .detach(move || {
                let bytes = std::fs::read(&path).map_err(|e| Error::onnx(path.display().to_string(), format!("cannot read: {e}")))?;
                Session::from_onnx(&bytes, path.parent(), &weights, &trainable)
            })
            .map_err(to_py)?;
        Ok(PySession { inner: Arc::new(s.with_options(opts)) })
    }

    /// The precision asked for: "fp32", "bf16" or "fp16".
    #[getter]
    fn matmul_precision(&self) -> &'static str {
        self.inner.options.matmul_precision.name()
    }

    /// How matmuls run on this CPU, e.g. "bf16 (avx512_bf16, f32 accumulation)", or "fp32 (bf16
    /// requested, but ...)" when the CPU has no bf16 instructions.
    #[getter]
    fn matmul_path(&self) -> String {
        self.inner.matmul_description()
    }

    #[getter]
    fn input_names(&self) -> Vec<String> {
        self.inner.inputs.iter().map(|v| self.inner.graph.value(*v).name.clone()).collect()
    }

    #[getter]
    fn output_names(&self) -> Vec<String> {
        self.inner.outputs.iter().map(|v| self.inner.graph.value(*v).name.clone()).collect()
    }

    #[getter]
    fn weight_names(&self) -> Vec<String> {
        self.inner.weights.iter().map(|v| self.inner.graph.value(*v).name.clone()).collect()
    }

    /// Which weights receive a gradient (False: frozen or not on the path to any output).
    #[getter]
    fn has_grad(&self) -> Vec<bool> {
        self.inner.grads.iter().map(|g| g.is_some()).collect()
    }

    /// (dtype, shape) of every output for these input types (plans them if needed).
    fn output_types(&self, sigs: Vec<(String, Vec<usize>)>, backward: bool) -> PyResult<Vec<(String, Vec<usize>)>> {
        let sigs: Vec<Sig> = sigs.into_iter().map(|(d, s)| Ok((dtype(&d)?, s))).collect::<PyResult<_>>()?;
        let plan = self.inner.plan(&sigs, backward).map_err(to_py)?;
        self.inner
            .outputs
            .iter()
            .map(|&o| {
                Ok((plan.dtype(o).ok_or_else(|| PyRuntimeError::new_err("output has no type"))?.name().to_string(), plan.shape(o).to_vec()))
            })
            .collect()
    }

    /// Which outputs carry a gradient seed.
    #[getter]
    fn seeded(&self) -> Vec<bool> {
        self.inner.seeds.iter().map(|s| s.is_some()).collect()
    }

    /// Rewrites made by each graph pass at import: [(pass name, count)].
    #[getter]
    fn passes(&self) -> Vec<(String, usize)> {
        self.inner.passes.rewrites.iter().map(|(n, k)| (n.to_string(), *k)).collect()
    }

    #[getter]
    fn node_count(&self) -> (usize, usize) {
        (self.inner.n_fwd, self.inner.graph.nodes.len() - self.inner.n_fwd)
    }

    /// Plans for these input types and returns a summary dict (arena bytes, step counts, ops,
    /// every step with its outputs, the values alive at the peak).
    /// `grads_from_forward`: the plan forward(..., grads=...) runs.
    #[pyo3(signature = (sigs, backward, grads_from_forward=false))]
    fn plan_info(&self, py: Python<'_>, sigs: Vec<(String, Vec<usize>)>, backward: bool, grads_from_forward: bool) -> PyResult<Py<PyAny>> {
        let sigs: Vec<Sig> = sigs.into_iter().map(|(d, s)| Ok((dtype(&d)?, s))).collect::<PyResult<_>>()?;
        let plan = self.inner.plan_with(&sigs, backward, &[], grads_from_forward).map_err(to_py)?;
        let d = pyo3::types::PyDict::new(py);
        d.set_item("arena_bytes", plan.arena_bytes)?;
        d.set_item("forward_steps", plan.split)?;
        d.set_item("backward_steps", plan.steps.len() - plan.split)?;
        d.set_item("folded_nodes", plan.folded_nodes)?;
        d.set_item("view_nodes", plan.views)?;
        d.set_item("ops", plan.op_histogram(&self.inner.graph))?;
        d.set_item("text", plan.describe(&self.inner.graph))?;
        let g = &self.inner.graph;
        let dtype_of = |v: ValueId| plan.dtype(v).map(|d| d.name().to_string()).unwrap_or_default();
        // per step also its inputs (None for an absent optional one) and whether it is a view
        // that shares its input's memory instead of running (bench/gpu_roofline.py's traffic model)
        let (steps, step_io): (Vec<PlanStep>, Vec<StepInputs>) = plan
            .steps
            .iter()
            .map(|n| {
                let node = &g.nodes[n.0];
                let outs = node.outputs.iter().map(|&v| (g.values[v.0].name.clone(), dtype_of(v), plan.shape(v).to_vec())).collect();
                let ins = node.inputs.iter().map(|v| v.map(|v| (dtype_of(v), plan.shape(v).to_vec()))).collect();
                let view = node.outputs.iter().all(|o| matches!(plan.storage[o.0], Storage::Alias(_) | Storage::Unused));
                ((node.op_type.clone(), node.name.clone(), outs), (ins, view))
            })
            .unzip();
        d.set_item("steps", steps)?;
        d.set_item("step_inputs", step_io)?;
        // the inputs' value names, for tools that follow a value from producer to readers
        let input_names: Vec<Vec<Option<String>>> =
            plan.steps.iter().map(|n| g.nodes[n.0].inputs.iter().map(|v| v.map(|v| g.values[v.0].name.clone())).collect()).collect();
        d.set_item("step_input_names", input_names)?;
        let (step, live, values) = plan.peak();
        let at_peak: Vec<(String, String, String, Vec<usize>, usize)> = values
            .iter()
            .map(|&(v, bytes)| {
                let op = g.values[v.0].producer.map(|p| g.nodes[p.0].op_type.clone()).unwrap_or_else(|| "input".into());
                (g.values[v.0].name.clone(), op, dtype_of(v), plan.shape(v).to_vec(), bytes)
            })
            .collect();
        d.set_item("peak_step", (step, if step < plan.split { "forward" } else { "backward" }))?;
        d.set_item("peak_live_bytes", live)?;
        d.set_item("peak_values", at_peak)?;
        Ok(d.into_any().unbind())
    }

    /// Timings summed since the last reset: a list of (phase, op type, node name, calls,
    /// seconds) per node, and a dict phase -> (runs, seconds).
    #[allow(clippy::type_complexity)]
    fn profile(&self) -> (Vec<(String, String, String, u64, f64)>, std::collections::HashMap<String, (u64, f64)>) {
        let p = self.inner.profile();
        let nodes = p
            .by_node
            .into_iter()
            .map(|((phase, n), st)| {
                let node = &self.inner.graph.nodes[n];
                (phase.to_string(), node.op_type.clone(), node.name.clone(), st.calls, st.total.as_secs_f64())
            })
            .collect();
        let phases = p.phases.into_iter().map(|(k, st)| (k.to_string(), (st.calls, st.total.as_secs_f64()))).collect();
        (nodes, phases)
    }

    fn reset_profile(&self) {
        self.inner.reset_profile();
    }

    /// Runs the forward pass. `inputs`: (address, dtype, shape) per model input; `weights`: one
    /// address per weight; `outputs` (optional): per output an address receiving it (0: kept in
    /// the engine's memory). Returns a Pending holding the outputs (and activations if backward).
    /// `grads` (optional, with `backward`): one address per weight (0: none) receiving its
    /// gradient, bound from the forward pass on; backward() must then get the same addresses.
    #[pyo3(signature = (inputs, weights, backward, seed, outputs=None, grads=None))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        inputs: Vec<(usize, String, Vec<usize>)>,
        weights: Vec<usize>,
        backward: bool,
        seed: u64,
        outputs: Option<Vec<usize>>,
        grads: Option<Vec<usize>>,
    ) -> PyResult<PyPending> {
        let mut feed = Vec::with_capacity(inputs.len());
        for (addr, dt, shape) in inputs {
            let dt = dtype(&dt)?;
            let n: usize = shape.iter().product::<usize>() * dt.size();
            feed.push((Addr(addr), n, (dt, shape)));
        }
        let w: Vec<Addr> = weights.into_iter().map(Addr).collect();
        let o: Vec<Addr> = outputs.unwrap_or_default().into_iter().map(Addr).collect();
        let gr: Vec<Addr> = grads.unwrap_or_default().into_iter().map(Addr).collect();
        let s = self.inner.clone();
        let pending = py
            .detach(move || {
                ortrain_engine::exec::on_pool(move || {
                    let views: Vec<(Sig, &[u8])> = feed
                        .iter()
                        // SAFETY: the caller holds each input tensor alive and contiguous with
                        // exactly `n` bytes at `addr` for the duration of this call.
                        .map(|(a, n, sig)| {
                            (sig.clone(), if *n == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(a.0 as *const u8, *n) } })
                        })
                        .collect();
                    let wp: Vec<*mut u8> = w.iter().map(|a| a.0 as *mut u8).collect();
                    let op: Vec<*mut u8> = o.iter().map(|a| a.0 as *mut u8).collect();
                    let gp: Vec<*mut u8> = gr.iter().map(|a| a.0 as *mut u8).collect();
                    // SAFETY: weight addresses are the live torch parameters of the declared shapes;
                    // output and gradient addresses (0: none) are tensors the caller keeps alive
                    // with this step, of the planned types, written only by it.
                    unsafe { s.forward_with_grads(&views, &wp, backward, seed, &op, &gp) }
                })
            })
            .map_err(to_py)?;
        Ok(PyPending { inner: Some(pending), session: self.inner.clone() })
    }

    /// Runs the backward pass of `pending`: `seeds` one address per output (0: none), `grads`
    /// one address per weight (0: not wanted), written in place.
    fn backward(&self, py: Python<'_>, pending: &mut PyPending, weights: Vec<usize>, seeds: Vec<usize>, grads: Vec<usize>) -> PyResult<()> {
        let p = pending
            .inner
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("this forward pass was already used for a backward pass or released"))?;
        let (w, sd, g): (Vec<Addr>, Vec<Addr>, Vec<Addr>) =
            (weights.into_iter().map(Addr).collect(), seeds.into_iter().map(Addr).collect(), grads.into_iter().map(Addr).collect());
        let s = self.inner.clone();
        py.detach(move || {
            ortrain_engine::exec::on_pool(move || {
                let c = |v: &[Addr]| v.iter().map(|a| a.0 as *mut u8).collect::<Vec<_>>();
                // SAFETY: the caller holds weights, seeds and gradient buffers alive, of the planned
                // types; gradient buffers are fresh tensors written only here.
                unsafe { s.backward(p, &c(&w), &c(&sd), &c(&g)) }
            })
        })
        .map_err(to_py)
    }
}

#[pymethods]
impl PyPending {
    /// (address, dtype, shape) of output k; valid until backward() or release().
    fn output(&mut self, k: usize) -> PyResult<(usize, String, Vec<usize>)> {
        let p = self.inner.as_mut().ok_or_else(|| PyRuntimeError::new_err("this forward pass was released"))?;
        let (ptr, dt, shape) = self.session.output_ptr(p, k).map_err(to_py)?;
        Ok((ptr as usize, dt.name().to_string(), shape))
    }

    /// Copies output k into memory at `dst` (which must hold its bytes).
    fn copy_output(&mut self, py: Python<'_>, k: usize, dst: usize) -> PyResult<()> {
        let (src, dt, shape) = self.output(k)?;
        let n = shape.iter().product::<usize>() * dtype(&dt)?.size();
        let (s, d) = (Addr(src), Addr(dst));
        py.detach(move || {
            // SAFETY: src holds the output's n bytes in the pending arena; the caller passes a
            // distinct buffer of at least n bytes at dst.
            unsafe { std::ptr::copy_nonoverlapping(s.0 as *const u8, d.0 as *mut u8, n) }
        });
        Ok(())
    }

    #[getter]
    fn forward_ms(&self) -> f64 {
        self.inner.as_ref().map_or(0.0, |p| p.forward_time.as_secs_f64() * 1e3)
    }

    #[getter]
    fn arena_bytes(&self) -> usize {
        self.inner.as_ref().map_or(0, |p| p.plan.arena_bytes)
    }

    /// Bytes the executor really holds for this step's arena.
    #[getter]
    fn arena_capacity(&self) -> usize {
        self.inner.as_ref().map_or(0, |p| p.arena.capacity_bytes())
    }

    /// Frees the activations (a forward pass that needs no backward pass).
    fn release(&mut self) {
        if let Some(p) = self.inner.take() {
            self.session.release(p);
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySession>()?;
    m.add_class::<PyPending>()?;
    m.add("EngineError", m.py().get_type::<EngineError>())?;
    Ok(())
}
