//! A training session: one imported model with its gradient graph, plans cached per input
//! shape signature, and in-flight steps (forward done, backward pending) that own their arena.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::autodiff;
use crate::backend::cpu::bf16::{MatmulPath, MatmulPrecision};
use crate::backend::cpu::CpuCtx;
use crate::error::{Error, Result};
use crate::exec::profile::Profile;
use crate::exec::{self, Arena, Bindings, Phase};
use crate::ir::{Graph, ValueId, ValueKind};
use crate::onnx::{import_bytes, ImportOptions};
pub use crate::passes::Target;
use crate::plan::{self, Plan, PlanRequest};
use crate::tensor::DType;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
mod cuda_errors;
#[cfg(feature = "cuda")]
pub mod cuda_graph;

/// One input's element type and shape.
pub type Sig = (DType, Vec<usize>);

/// A plan's key: (input types, backward, outputs bound, gradients bound from the forward on).
type PlanKey = (Vec<Sig>, bool, Vec<bool>, bool);

/// How a session runs.
#[derive(Clone, Copy, Debug, Default)]
pub struct SessionOptions {
    /// Fp32 (default), or Bf16: every MatMul/Gemm/FusedMatMul on f32 operands (forward and
    /// gradient) multiplies bf16-rounded operands with f32 accumulation, like PyTorch's autocast
    /// for matmuls; weights, activations and gradients stay f32. Without avx512_bf16 or AMX the
    /// session runs fp32 and `matmul_description` says so.
    pub matmul_precision: MatmulPrecision,
    /// Runs the graph as imported: no graph pass (what `ORTRAIN_DISABLE_PASSES=all` does to
    /// every session, for this one alone): the unfused reference a test compares fused graphs
    /// with, while other sessions of the process keep their passes.
    pub unfused: bool,
}

pub struct Session {
    pub graph: Graph,
    pub n_fwd: usize,
    pub inputs: Vec<ValueId>,
    pub outputs: Vec<ValueId>,
    /// Gradient seed per output (None for outputs that are not float).
    pub seeds: Vec<Option<ValueId>>,
    /// Bound weights, in the order the caller named them.
    pub weights: Vec<ValueId>,
    /// Gradient of each weight (None: frozen, or it does not affect the outputs).
    pub grads: Vec<Option<ValueId>>,
    pub options: SessionOptions,
    /// The backend the plans run on (what `from_onnx_for` was given).
    pub target: Target,
    matmul: MatmulPath,
    /// Plans per (input types, backward, outputs bound, gradients bound from the forward on).
    plans: Mutex<HashMap<PlanKey, Arc<Plan>>>,
    arenas: Mutex<Vec<Arena>>,
    profile: Mutex<Profile>,
    /// What the graph passes rewrote at import.
    pub passes: crate::passes::PassReport,
    #[cfg(feature = "cuda")]
    cuda: cuda::CudaState,
}

/// A forward pass whose backward pass may still come: it owns the arena holding the
/// activations the backward pass reads.
pub struct Pending {
    pub plan: Arc<Plan>,
    pub arena: Arena,
    ctx: CpuCtx,
    pub forward_time: Duration,
    /// Outputs written into caller memory: (value, address), bound again for the backward pass.
    out_binds: Vec<(ValueId, usize)>,
    /// Gradient memory bound from the forward phase on (`forward_with_grads`): (value, address).
    grad_binds: Vec<(ValueId, usize)>,
}

impl Session {
    /// Imports `onnx` and builds gradients of every float output with respect to the trainable
    /// weights. `weights` names the initializers the caller binds per call (all others become
    /// constants); `trainable[i]` says whether `weights[i]` gets a gradient.
    pub fn from_onnx(onnx: &[u8], base_dir: Option<&Path>, weights: &[String], trainable: &[bool]) -> Result<Session> {
        Self::from_onnx_seeded(onnx, base_dir, weights, trainable, None)
    }

    /// As `from_onnx`; `seeded[k]` false makes output k carry no gradient (an output the caller
    /// reads but never differentiates, such as logits next to the loss computed from them).
    pub fn from_onnx_seeded(
        onnx: &[u8],
        base_dir: Option<&Path>,
        weights: &[String],
        trainable: &[bool],
        seeded: Option<&[bool]>,
    ) -> Result<Session> {
        Self::from_onnx_for(onnx, base_dir, weights, trainable, seeded, Target::Cpu)
    }

    /// As `from_onnx_seeded`, for plans that will run on `target` (graph passes whose fused ops
    /// have no kernel there are skipped).
    pub fn from_onnx_for(
        onnx: &[u8],
        base_dir: Option<&Path>,
        weights: &[String],
        trainable: &[bool],
        seeded: Option<&[bool]>,
        target: Target,
    ) -> Result<Session> {
        Self::from_onnx_with(onnx, base_dir, weights, trainable, seeded, target, SessionOptions::default())
    }

    /// As `from_onnx_for`, with `options` (the graph passes see the matmul precision: the
    /// opt-in `autocast` pass keeps activations in 16 bits for bf16/fp16 sessions).
    pub fn from_onnx_with(
        onnx: &[u8],
        base_dir: Option<&Path>,
        weights: &[String],
        trainable: &[bool],
        seeded: Option<&[bool]>,
        target: Target,
        options: SessionOptions,
    ) -> Result<Session> {
        if weights.len() != trainable.len() {
            return Err(Error::other("weights and trainable flags differ in length"));
        }
        let mut graph = import_bytes(onnx, base_dir, &ImportOptions::default())?;
        let mut weight_ids = Vec::with_capacity(weights.len());
        for name in weights {
            let v = graph
                .find(name)
                .filter(|v| graph.value(*v).kind == ValueKind::Weight)
                .ok_or_else(|| Error::Input { name: name.clone(), msg: "no initializer of this name in the model".into() })?;
            weight_ids.push(v);
        }
        // initializers the caller does not bind are constants
        let unbound: Vec<_> = graph.weights.iter().filter(|(v, _)| !weight_ids.contains(v)).cloned().collect();
        for (v, data) in unbound {
            let data = data.ok_or_else(|| Error::Input {
                name: graph.value(v).name.clone(),
                msg: "initializer has no data and is not bound".into(),
            })?;
            graph.values[v.0].kind = ValueKind::Const(data);
        }
        // bound weights are read from the caller's memory on every call: the imported copy of their
        // data would only double the model's memory
        graph.weights = graph.weights.into_iter().filter(|(v, _)| weight_ids.contains(v)).map(|(v, _)| (v, None)).collect();
        let half = match options.matmul_precision {
            MatmulPrecision::Fp32 => None,
            MatmulPrecision::Bf16 => Some(DType::BF16),
            MatmulPrecision::Fp16 => Some(DType::F16),
        };
        let mut passes = if options.unfused {
            crate::passes::PassReport::default()
        } else {
            crate::passes::run(&mut graph, crate::passes::PassCtx { target, half })?
        };
        let n_fwd = graph.nodes.len();
        let outputs = graph.outputs.clone();
        let mut seeds = Vec::with_capacity(outputs.len());
        if seeded.is_some_and(|s| s.len() != outputs.len()) {
            return Err(Error::other(format!("seeded flags: {} for {} outputs", seeded.map_or(0, |s| s.len()), outputs.len())));
        }
        for (k, &o) in outputs.iter().enumerate() {
            if seeded.is_some_and(|s| !s[k]) {
                seeds.push(None);
                continue;
            }
            let name = format!("grad:{}", graph.value(o).name);
            // outputs of integer type carry no gradient; the type is only known per plan, so
            // every output gets a seed and integer ones are simply never bound
            seeds.push(Some(graph.add_value(&name, ValueKind::Input, None, None)));
        }
        let wrt: Vec<ValueId> = weight_ids.iter().zip(trainable).filter(|(_, &t)| t).map(|(&v, _)| v).collect();
        let g = autodiff::build(&mut graph, &outputs, &seeds, &wrt)?;
        if !options.unfused {
            crate::passes::run_on_train_graph(&mut graph, n_fwd, target, &mut passes)?;
        }
        let mut grads = vec![None; weight_ids.len()];
        let mut k = 0;
        for (i, &t) in trainable.iter().enumerate() {
            if t {
                grads[i] = g.grads[k];
                k += 1;
            }
        }
        let inputs = graph.inputs.clone();
        let session = Session {
            graph,
            n_fwd,
            inputs,
            outputs,
            seeds,
            weights: weight_ids,
            grads,
            options: SessionOptions::default(),
            target,
            matmul: MatmulPath::Fp32,
            plans: Mutex::new(HashMap::new()),
            arenas: Mutex::new(Vec::new()),
            profile: Mutex::new(Profile::default()),
            passes,
            #[cfg(feature = "cuda")]
            cuda: cuda::CudaState::default(),
        };
        Ok(session.with_options(options))
    }

    /// The session with these options (the matmul path is resolved here, from the CPU).
    pub fn with_options(mut self, options: SessionOptions) -> Session {
        self.matmul = MatmulPath::resolve(options.matmul_precision);
        self.options = options;
        self
    }

    /// How matmuls run: fp32, or bf16 with the instruction set chosen for this CPU.
    pub fn matmul_path(&self) -> MatmulPath {
        self.matmul
    }

    /// `matmul_path` in words, with the reason when bf16 was requested and is not used; for a
    /// CUDA session, the cuBLAS compute mode of f32 matmuls.
    pub fn matmul_description(&self) -> String {
        match (self.target, self.options.matmul_precision) {
            (Target::Cpu, requested) => self.matmul.describe(requested),
            (Target::Cuda, MatmulPrecision::Bf16) => {
                "bf16 on cuBLAS tensor cores (f32 tensors, operands rounded to bf16, f32 accumulation)".into()
            }
            (Target::Cuda, MatmulPrecision::Fp32) => "fp32 (cuBLAS; TF32 only where torch.backends.cuda.matmul.allow_tf32 is set)".into(),
            (Target::Cuda, MatmulPrecision::Fp16) => {
                "fp16 on cuBLAS tensor cores (f32 tensors, operands rounded to fp16, f32 accumulation)".into()
            }
        }
    }

    /// The plan for these input types; `backward` adds the gradient phase.
    pub fn plan(&self, sigs: &[Sig], backward: bool) -> Result<Arc<Plan>> {
        self.plan_bound(sigs, backward, &[])
    }

    /// As `plan`, with `out_bound[k]` true for outputs the caller's memory receives.
    pub fn plan_bound(&self, sigs: &[Sig], backward: bool, out_bound: &[bool]) -> Result<Arc<Plan>> {
        self.plan_with(sigs, backward, out_bound, false)
    }

    /// As `plan_bound`; `grads_from_forward`: the gradients' memory is bound from the forward
    /// phase on (see `PlanRequest::bound_from_forward`).
    pub fn plan_with(&self, sigs: &[Sig], backward: bool, out_bound: &[bool], grads_from_forward: bool) -> Result<Arc<Plan>> {
        let grads_from_forward = grads_from_forward && backward;
        let key = (sigs.to_vec(), backward, out_bound.to_vec(), grads_from_forward);
        if let Some(p) = self.plans.lock().map_err(|_| Error::other("plan cache poisoned"))?.get(&key) {
            return Ok(p.clone());
        }
        if sigs.len() != self.inputs.len() {
            return Err(Error::other(format!("the model takes {} inputs, got {}", self.inputs.len(), sigs.len())));
        }
        let mut input_types: HashMap<ValueId, Sig> = self.inputs.iter().copied().zip(sigs.iter().cloned()).collect();
        for &w in &self.weights {
            let v = self.graph.value(w);
            if let (Some(dt), Some(dims)) = (v.dtype, &v.shape) {
                let shape = dims.iter().map(|d| if let crate::ir::Dim::Known(k) = d { *k } else { 0 }).collect();
                input_types.insert(w, (dt, shape));
            }
        }
        let grads: Vec<ValueId> = self.grads.iter().flatten().copied().collect();
        let bound_fwd: Vec<ValueId> = self.outputs.iter().zip(out_bound).filter(|(_, &b)| b).map(|(&o, _)| o).collect();
        let req = PlanRequest {
            graph: &self.graph,
            n_fwd: self.n_fwd,
            forward_outputs: self.outputs.clone(),
            backward_outputs: if backward { grads.clone() } else { vec![] },
            bound_outputs: if backward { grads.into_iter().chain(bound_fwd).collect() } else { bound_fwd },
            input_types,
            seeds: self.seeds.iter().zip(&self.outputs).filter_map(|(s, o)| s.map(|s| (s, *o))).collect(),
            bound_from_forward: if grads_from_forward { self.grads.iter().flatten().copied().collect() } else { vec![] },
        };
        let p = Arc::new(plan::build(&req)?);
        self.plans.lock().map_err(|_| Error::other("plan cache poisoned"))?.insert(key, p.clone());
        Ok(p)
    }

    /// Runs the forward phase. `inputs` are the user inputs' raw bytes with their types;
    /// `weights` the bound weights' pointers in `self.weights` order.
    ///
    /// # Safety
    /// Every weight pointer must point to the weight's data (its declared type and shape),
    /// valid and unmodified for the call.
    /// `outputs[k]`, where given and not null, is caller memory receiving output k (its planned
    /// type), kept bound through the backward pass.
    pub unsafe fn forward(
        &self,
        inputs: &[(Sig, &[u8])],
        weights: &[*mut u8],
        backward: bool,
        seed: u64,
        outputs: &[*mut u8],
    ) -> Result<Pending> {
        // SAFETY: forwarded from this function's contract; no gradient memory.
        unsafe { self.forward_with_grads(inputs, weights, backward, seed, outputs, &[]) }
    }

    /// As `forward`, with `grads[i]` (where given and not null) the memory receiving weight i's
    /// gradient, bound from now on: values that only become that gradient scaled by a scalar
    /// (LinearCrossEntropy's unit-seed dW) are written there in this phase instead of the arena.
    /// `backward` must then get the same gradient memory.
    ///
    /// # Safety
    /// As for `forward`; gradient pointers hold the weights' types, are kept alive with the
    /// step and are written only by this step's two phases.
    pub unsafe fn forward_with_grads(
        &self,
        inputs: &[(Sig, &[u8])],
        weights: &[*mut u8],
        backward: bool,
        seed: u64,
        outputs: &[*mut u8],
        grads: &[*mut u8],
    ) -> Result<Pending> {
        let sigs: Vec<Sig> = inputs.iter().map(|(s, _)| s.clone()).collect();
        if outputs.len() > self.outputs.len() {
            return Err(Error::other(format!("{} output buffers for {} outputs", outputs.len(), self.outputs.len())));
        }
        let out_bound: Vec<bool> = outputs.iter().map(|p| !p.is_null()).collect();
        let grad_binds: Vec<(ValueId, usize)> = if backward {
            self.grads.iter().zip(grads).filter_map(|(g, &p)| if p.is_null() { None } else { g.map(|g| (g, p as usize)) }).collect()
        } else {
            vec![]
        };
        if !grad_binds.is_empty() && grad_binds.len() != self.grads.iter().flatten().count() {
            return Err(Error::other("gradient memory bound at forward must cover every gradient"));
        }
        let early = !grad_binds.is_empty();
        let plan = self.plan_with(&sigs, backward, if out_bound.iter().any(|&b| b) { &out_bound } else { &[] }, early)?;
        let mut arena = self.arenas.lock().ok().and_then(|mut a| a.pop()).unwrap_or_default();
        let mut ctx = CpuCtx::new(seed).with_matmul(self.matmul);
        let mut bind = self.bind_weights(weights)?;
        let out_binds: Vec<(ValueId, usize)> =
            self.outputs.iter().zip(outputs).filter(|(_, p)| !p.is_null()).map(|(&o, &p)| (o, p as usize)).collect();
        for &(o, p) in out_binds.iter().chain(&grad_binds) {
            // SAFETY: the caller's contract: p holds value o's planned bytes, exclusively ours.
            unsafe { bind.bind(o, p as *mut u8) };
        }
        let feed: Vec<(ValueId, &[u8])> = self.inputs.iter().copied().zip(inputs.iter().map(|(_, b)| *b)).collect();
        let t0 = std::time::Instant::now();
        let mut timings = Vec::with_capacity(plan.split);
        exec::run_phase(&self.graph, &plan, Phase::Forward, &mut arena, &bind, &feed, &mut ctx, Some(&mut timings))?;
        self.record("forward", &plan, &timings);
        Ok(Pending { plan, arena, ctx, forward_time: t0.elapsed(), out_binds, grad_binds })
    }

    fn bind_weights(&self, weights: &[*mut u8]) -> Result<Bindings> {
        if weights.len() != self.weights.len() {
            return Err(Error::other(format!("expected {} weight pointers, got {}", self.weights.len(), weights.len())));
        }
        let mut bind = Bindings::new(self.graph.values.len());
        for (&v, &p) in self.weights.iter().zip(weights) {
            // SAFETY: the caller's contract on `forward`/`backward`.
            unsafe { bind.bind(v, p) };
        }
        Ok(bind)
    }

    /// Pointer to output `k` in the pending step's memory (valid while `pending` lives).
    pub fn output_ptr(&self, pending: &mut Pending, k: usize) -> Result<(*const u8, DType, Vec<usize>)> {
        let v = *self.outputs.get(k).ok_or_else(|| Error::other(format!("no output {k}")))?;
        let mut bind = Bindings::new(self.graph.values.len());
        for &(o, p) in &pending.out_binds {
            // SAFETY: bound at forward time; the caller keeps that memory alive with the step.
            unsafe { bind.bind(o, p as *mut u8) };
        }
        let p = exec::value_ptr(&self.graph, &pending.plan, &mut pending.arena, &bind, v)?;
        let dt = pending.plan.dtype(v).ok_or_else(|| Error::other("output has no type"))?;
        Ok((p as *const u8, dt, pending.plan.shape(v).to_vec()))
    }

    /// Runs the backward phase of a pending step: `seeds[k]` is the gradient of output k (null
    /// for outputs without one), `grads[i]` the memory receiving weight i's gradient (null for
    /// weights without one). Returns the arena to the pool.
    ///
    /// # Safety
    /// As for `forward`; seed pointers hold the outputs' types, gradient pointers the weights'
    /// types and are written exclusively by this call.
    pub unsafe fn backward(&self, mut pending: Pending, weights: &[*mut u8], seeds: &[*mut u8], grads: &[*mut u8]) -> Result<()> {
        let mut bind = self.bind_weights(weights)?;
        for &(o, p) in &pending.out_binds {
            // SAFETY: bound at forward time; the caller keeps that memory alive with the step.
            unsafe { bind.bind(o, p as *mut u8) };
        }
        for (s, &p) in self.seeds.iter().zip(seeds) {
            if let (Some(s), false) = (s, p.is_null()) {
                // SAFETY: forwarded from this function's contract.
                unsafe { bind.bind(*s, p) };
            }
        }
        for (g, &p) in self.grads.iter().zip(grads) {
            if let (Some(g), false) = (g, p.is_null()) {
                if pending.grad_binds.iter().any(|&(v, q)| v == *g && q != p as usize) {
                    self.release(pending);
                    return Err(Error::other("backward got other gradient memory than its forward pass"));
                }
                // SAFETY: forwarded from this function's contract.
                unsafe { bind.bind(*g, p) };
            }
        }
        for &(g, p) in &pending.grad_binds {
            // SAFETY: bound at forward time (`forward_with_grads`'s contract).
            unsafe { bind.bind(g, p as *mut u8) };
        }
        let mut timings = Vec::with_capacity(pending.plan.steps.len() - pending.plan.split);
        let r = exec::run_phase(
            &self.graph,
            &pending.plan,
            Phase::Backward,
            &mut pending.arena,
            &bind,
            &[],
            &mut pending.ctx,
            Some(&mut timings),
        );
        if r.is_ok() {
            self.record("backward", &pending.plan, &timings);
        }
        self.release(pending);
        r
    }

    fn record(&self, phase: &'static str, plan: &Plan, timings: &[(usize, Duration)]) {
        if let Ok(mut p) = self.profile.lock() {
            p.record(plan, phase, timings);
        }
    }

    /// The timings collected since the last reset (every forward and backward phase is timed
    /// per step; the cost is two clock reads per step).
    pub fn profile(&self) -> Profile {
        self.profile.lock().map(|p| p.clone()).unwrap_or_default()
    }

    pub fn reset_profile(&self) {
        if let Ok(mut p) = self.profile.lock() {
            *p = Profile::default();
        }
    }

    /// Returns a pending step's arena to the pool (a forward pass without backward).
    pub fn release(&self, pending: Pending) {
        if let Ok(mut a) = self.arenas.lock() {
            if a.len() < 4 {
                a.push(pending.arena);
            }
        }
    }
}
