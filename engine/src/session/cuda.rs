//! A Session's training step on the GPU: the same plans as on the CPU, run by the CUDA
//! executor on the caller's stream, with every address a device address: inputs, weights,
//! gradient seeds and gradients are PyTorch's CUDA tensors (zero-copy), and the arena is memory
//! the caller allocates (from PyTorch's caching allocator, so torch.cuda's memory statistics
//! include it and stream ordering makes its reuse safe). Per plan, the kernel table lookups and
//! the constants' device copies are made once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::CUstream;

use super::cuda_errors::ErrorFlags;
use super::cuda_graph::{GraphSlot, PhaseRun};
use super::{Session, Sig};
use crate::backend::cpu::bf16::MatmulPrecision;
use crate::backend::cuda::blas::F32Mode;
use crate::backend::cuda::ops::{CudaCtx, CudaKernel};
use crate::backend::cuda::runtime::CudaRuntime;
use crate::error::{Error, Result};
use crate::exec::cuda::{self as cexec, DeviceBindings, DeviceConsts, InputSrc};
use crate::exec::Phase;
use crate::ir::ValueId;
use crate::plan::Plan;
use crate::tensor::DType;

/// What a plan needs on the GPU besides its arena.
pub struct CudaPlan {
    kernels: Vec<CudaKernel>,
    consts: DeviceConsts,
}

/// Per-session GPU state: the CUDA side of each plan, keyed by the plan's address (plans are
/// cached by the session for its whole life, so the address is stable).
#[derive(Default)]
pub struct CudaState {
    plans: Mutex<HashMap<usize, Arc<CudaPlan>>>,
    /// One index-error flag per node (made with the first GPU step).
    errors: Mutex<Option<ErrorFlags>>,
    /// The GPU (device ordinal) of the first step: the constants and flags above live there.
    device: OnceLock<usize>,
}

/// A forward pass on the GPU whose backward pass may still come.
pub struct CudaPending {
    pub plan: Arc<Plan>,
    cplan: Arc<CudaPlan>,
    base: u64,
    seed: u64,
    f32_mode: F32Mode,
    /// The forward's bindings (weights, outputs written into caller memory), kept for reading
    /// outputs and extended by the backward pass.
    bind: DeviceBindings,
    /// The seed slot of a graphed forward pass (0: launched); its backward graph reads the same.
    seed_slot: u64,
    /// The backward phase was queued: the step cannot run again.
    spent: bool,
}

impl CudaPending {
    /// Whether the backward phase was queued (also when an error came after it).
    pub fn spent(&self) -> bool {
        self.spent
    }
}

impl Session {
    /// Checks that `rt` is the GPU this session's device state lives on (binds it on the first
    /// step).
    fn check_device(&self, rt: &CudaRuntime) -> Result<()> {
        let first = *self.cuda.device.get_or_init(|| rt.ordinal);
        if first != rt.ordinal {
            return Err(Error::other(format!(
                "this engine session keeps its GPU state (constants, error flags) on cuda:{first}, so it cannot run a step on cuda:{}; a model moved to another GPU needs accelerate() anew",
                rt.ordinal
            )));
        }
        Ok(())
    }

    fn cuda_plan(&self, rt: &CudaRuntime, plan: &Arc<Plan>) -> Result<Arc<CudaPlan>> {
        let key = Arc::as_ptr(plan) as usize;
        let mut plans = self.cuda.plans.lock().map_err(|_| Error::other("CUDA plan cache poisoned"))?;
        if let Some(p) = plans.get(&key) {
            return Ok(p.clone());
        }
        let kernels = cexec::resolve(&self.graph, plan)?;
        let consts = DeviceConsts::upload(rt, &self.graph, plan)?;
        let p = Arc::new(CudaPlan { kernels, consts });
        plans.insert(key, p.clone());
        Ok(p)
    }

    /// Runs `f` on the session's index-error flags, made on first use.
    fn with_flags<R>(&self, rt: &CudaRuntime, f: impl FnOnce(&mut ErrorFlags) -> Result<R>) -> Result<R> {
        let mut guard = self.cuda.errors.lock().map_err(|_| Error::other("CUDA error flags poisoned"))?;
        if guard.is_none() {
            *guard = Some(ErrorFlags::new(rt, self.graph.nodes.len())?);
        }
        f(guard.as_mut().expect("made above"))
    }

    /// The nodes ("Gather node 'emb'") whose kernels met an index out of range in a GPU step
    /// whose results have landed since the last call; empty when none did or none has landed
    /// yet. Never waits for the device.
    pub fn index_errors_cuda(&self) -> Result<Vec<String>> {
        let mut guard = self.cuda.errors.lock().map_err(|_| Error::other("CUDA error flags poisoned"))?;
        let Some(flags) = guard.as_mut() else { return Ok(Vec::new()) };
        Ok(flags.take()?.into_iter().filter_map(|i| self.graph.nodes.get(i)).map(|n| format!("{} node '{}'", n.op_type, n.name)).collect())
    }

    /// Per fused Attention node of the graph, its name and the kernels its last GPU launch chose
    /// (backend/cuda/ops/attention.rs `path`), or None before its first launch.
    pub fn attention_paths_cuda(&self) -> Vec<(String, Option<&'static str>)> {
        // the runtime of whichever GPU launched it (a step may also run outside forward_cuda,
        // without binding the session to a device)
        let path = |n| crate::backend::cuda::runtime::loaded_runtimes().find_map(|rt| rt.attention_path(n));
        self.graph.nodes.iter().filter(|n| n.op_type == "Attention").map(|n| (n.name.clone(), path(n))).collect()
    }

    /// The arena bytes a GPU step with these inputs needs (the caller allocates them).
    pub fn arena_bytes(&self, sigs: &[Sig], backward: bool, out_bound: &[bool]) -> Result<usize> {
        let bound = if out_bound.iter().any(|&b| b) { out_bound } else { &[] };
        Ok(self.plan_bound(sigs, backward, bound)?.arena_bytes)
    }

    /// Queues the forward phase on `stream`. `inputs` are (type, device address) per user input,
    /// `weights` device addresses in `self.weights` order, `outputs[k]` (0: none) device memory
    /// receiving output k, `arena` at least `arena_bytes(...)` bytes of device memory. `tf32`:
    /// f32 matmuls (forward and this step's backward) may use TF32 tensor cores; a session made
    /// with `precision="bf16"` runs them on tensor cores at bf16 precision or better whatever
    /// `tf32` says. `run`: the kernels launched one by one, or the phase replayed from a CUDA
    /// graph (recorded on its first graphed run): the inputs are copied into the arena and the
    /// seed written to the seed slot first, then one graph launch.
    ///
    /// # Safety
    /// Every address must be device memory of the runtime's context holding the value's type
    /// and shape, alive and unmodified by others until the queued work has run (the arena and
    /// bound outputs until the backward phase has run too; graphed: the arena, the seed slot,
    /// the weights and bound outputs for as long as the graph may be replayed).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn forward_cuda(
        &self,
        rt: &CudaRuntime,
        stream: CUstream,
        arena: u64,
        inputs: &[(Sig, u64)],
        weights: &[u64],
        backward: bool,
        seed: u64,
        outputs: &[u64],
        tf32: bool,
        run: PhaseRun,
    ) -> Result<CudaPending> {
        self.check_device(rt)?;
        let sigs: Vec<Sig> = inputs.iter().map(|(s, _)| s.clone()).collect();
        let out_bound: Vec<bool> = outputs.iter().map(|&p| p != 0).collect();
        let plan = self.plan_bound(&sigs, backward, if out_bound.iter().any(|&b| b) { &out_bound } else { &[] })?;
        if arena == 0 && plan.arena_bytes > 0 {
            return Err(Error::other(format!("the GPU step needs an arena of {} bytes", plan.arena_bytes)));
        }
        let cplan = self.cuda_plan(rt, &plan)?;
        let mut bind = DeviceBindings::new(self.graph.values.len());
        self.bind_weights_cuda(&mut bind, weights)?;
        for (&o, &p) in self.outputs.iter().zip(outputs).filter(|(_, &p)| p != 0) {
            // SAFETY: the caller's contract: p holds output o's planned bytes, exclusively ours.
            unsafe { bind.bind(o, p) };
        }
        let feed: Vec<(ValueId, InputSrc)> = self.inputs.iter().copied().zip(inputs.iter().map(|(_, p)| InputSrc::Device(*p))).collect();
        let f32_mode = match (self.options.matmul_precision, tf32) {
            (MatmulPrecision::Bf16, _) => F32Mode::Bf16,
            (MatmulPrecision::Fp16, _) => F32Mode::F16,
            (MatmulPrecision::Fp32, true) => F32Mode::Tf32,
            (MatmulPrecision::Fp32, false) => F32Mode::Exact,
        };
        let error_base = self.with_flags(rt, |f| {
            f.begin(stream)?;
            Ok(f.flag(0))
        })?;
        match &run {
            PhaseRun::Launches => {
                let mut ctx = CudaCtx { rt, stream, seed, seed_slot: 0, f32_mode, error_flag: 0, error_base };
                cexec::run_phase(&self.graph, &plan, &cplan.kernels, Phase::Forward, arena, &bind, &cplan.consts, &feed, &mut ctx)?;
            }
            PhaseRun::Graph(g) => {
                rt.bind()?;
                let ctx = CudaCtx { rt, stream, seed, seed_slot: 0, f32_mode, error_flag: 0, error_base };
                cexec::copy_inputs(&self.graph, &plan, arena, &feed, &ctx)?;
                rt.write_u64(stream, g.seed_slot, seed)?;
                let mut over = vec![Arc::as_ptr(&plan) as u64, arena, g.seed_slot, f32_mode as u64];
                over.extend(weights.iter().chain(outputs));
                let seed_slot = g.seed_slot;
                // SAFETY: forwarded from this function's contract; the seed slot is the caller's.
                unsafe {
                    g.slot.run(rt, stream, over, |rec| {
                        let mut ctx = CudaCtx { rt, stream: rec, seed, seed_slot, f32_mode, error_flag: 0, error_base };
                        cexec::run_phase(&self.graph, &plan, &cplan.kernels, Phase::Forward, arena, &bind, &cplan.consts, &[], &mut ctx)
                    })
                }?;
            }
        }
        if !backward {
            self.with_flags(rt, |f| f.publish(stream))?;
        }
        let seed_slot = match &run {
            PhaseRun::Graph(g) => g.seed_slot,
            PhaseRun::Launches => 0,
        };
        Ok(CudaPending { plan, cplan, base: arena, seed, f32_mode, bind, seed_slot, spent: false })
    }

    fn bind_weights_cuda(&self, bind: &mut DeviceBindings, weights: &[u64]) -> Result<()> {
        if weights.len() != self.weights.len() {
            return Err(Error::other(format!("expected {} weight addresses, got {}", self.weights.len(), weights.len())));
        }
        for (&v, &p) in self.weights.iter().zip(weights) {
            // SAFETY: the caller's contract on forward_cuda/backward_cuda.
            unsafe { bind.bind(v, p) };
        }
        Ok(())
    }

    /// Device address, type and shape of output `k` of a pending GPU step.
    pub fn output_cuda(&self, p: &CudaPending, k: usize) -> Result<(u64, DType, Vec<usize>)> {
        let v = *self.outputs.get(k).ok_or_else(|| Error::other(format!("no output {k}")))?;
        let a = cexec::address(&self.graph, &p.plan, p.base, &p.bind, &p.cplan.consts, v)?;
        let dt = p.plan.dtype(v).ok_or_else(|| Error::other("output has no type"))?;
        Ok((a, dt, p.plan.shape(v).to_vec()))
    }

    /// Queues the backward phase of a pending GPU step: `seeds[k]` the gradient of output k
    /// (0: none), `grads[i]` the memory receiving weight i's gradient (0: none). `graph`: replay
    /// the phase from this slot's graph (recorded on first use) instead of launching its kernels.
    ///
    /// # Safety
    /// As for `forward_cuda`; gradient addresses are written exclusively by the queued work.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn backward_cuda(
        &self,
        rt: &CudaRuntime,
        stream: CUstream,
        p: &mut CudaPending,
        weights: &[u64],
        seeds: &[u64],
        grads: &[u64],
        graph: Option<&GraphSlot>,
    ) -> Result<()> {
        self.check_device(rt)?;
        self.bind_weights_cuda(&mut p.bind, weights)?;
        for (s, &a) in self.seeds.iter().zip(seeds) {
            if let (Some(s), false) = (s, a == 0) {
                // SAFETY: forwarded from this function's contract.
                unsafe { p.bind.bind(*s, a) };
            }
        }
        for (g, &a) in self.grads.iter().zip(grads) {
            if let (Some(g), false) = (g, a == 0) {
                // SAFETY: forwarded from this function's contract.
                unsafe { p.bind.bind(*g, a) };
            }
        }
        let error_base = self.with_flags(rt, |f| Ok(f.flag(0)))?;
        let (plan, kernels, consts, bind, base) = (&p.plan, &p.cplan.kernels, &p.cplan.consts, &p.bind, p.base);
        let (seed, f32_mode) = (p.seed, p.f32_mode);
        // a recorded backward reads the seed where its forward did (no op draws there today)
        let seed_slot = if graph.is_some() { p.seed_slot } else { 0 };
        let queue = |stream: CUstream| {
            let mut ctx = CudaCtx { rt, stream, seed, seed_slot, f32_mode, error_flag: 0, error_base };
            cexec::run_phase(&self.graph, plan, kernels, Phase::Backward, base, bind, consts, &[], &mut ctx)
        };
        match graph {
            None => {
                p.spent = true; // kernels may be queued even if one fails
                queue(stream)?
            }
            Some(slot) => {
                let mut over = vec![Arc::as_ptr(plan) as u64, base, seed_slot, f32_mode as u64];
                over.extend(weights.iter().chain(seeds).chain(grads));
                // SAFETY: forwarded from this function's contract.
                unsafe { slot.run(rt, stream, over, queue) }?;
                p.spent = true;
            }
        }
        self.with_flags(rt, |f| f.publish(stream))
    }
}
