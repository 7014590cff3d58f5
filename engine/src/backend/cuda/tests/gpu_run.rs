//! Training steps of a session through the CUDA executor, as the tests drive it: the plan, its
//! kernels, constants and arena set up once, the weights and seeds uploaded and bound, then
//! any number of steps (forward with host inputs, outputs downloaded, backward into fresh
//! zeroed gradient buffers) on the same device state.

use super::exec::download_f32;
use super::support::*;
use crate::backend::cuda::blas::F32Mode;
use crate::backend::cuda::launch::DeviceBuffer;
use crate::backend::cuda::loader::Loaded;
use crate::backend::cuda::ops::{CudaCtx, CudaKernel};
use crate::exec::cuda::{self as cexec, DeviceArena, DeviceBindings, DeviceConsts, InputSrc};
use crate::exec::Phase;
use crate::plan::Plan;
use crate::session::{Session, Sig};

/// The legacy default stream.
pub(super) const LEGACY: cudarc::driver::sys::CUstream = std::ptr::null_mut();

pub(super) struct GpuRun<'s> {
    s: &'s Session,
    g: &'static Loaded,
    plan: std::sync::Arc<Plan>,
    kernels: Vec<CudaKernel>,
    consts: DeviceConsts,
    _arena: DeviceArena,
    base: u64,
    bind: DeviceBindings,
    /// Elements of each weight (and so of its gradient).
    sizes: Vec<usize>,
    _buffers: Vec<DeviceBuffer>,
    mode: F32Mode,
    stream: cudarc::driver::sys::CUstream,
    /// The step's seed (the random ops' streams): 1 unless `with_seed`.
    seed: u64,
}

impl<'s> GpuRun<'s> {
    /// `s` planned for `sigs`, with `weights` and the output `seeds` (f32 each) bound; the
    /// session's f32 matmuls in `mode`, the phases queued on `stream`.
    pub(super) fn new(
        s: &'s Session,
        sigs: &[Sig],
        weights: &[Vec<f32>],
        seeds: &[Vec<f32>],
        mode: F32Mode,
        stream: cudarc::driver::sys::CUstream,
    ) -> Self {
        let g = gpu_or_reason().expect("under gpu()");
        let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
        let plan = s.plan(sigs, true).expect("plan");
        let kernels = cexec::resolve(&s.graph, &plan).unwrap_or_else(|e| panic!("{e}"));
        let consts = DeviceConsts::upload(rt, &s.graph, &plan).expect("constants");
        let mut arena = DeviceArena::default();
        let base = arena.reserve(rt, plan.arena_bytes).expect("arena");
        let dw: Vec<DeviceBuffer> = weights.iter().map(|w| dev(g, w)).collect();
        let ds: Vec<DeviceBuffer> = seeds.iter().map(|v| dev(g, v)).collect();
        let mut bind = DeviceBindings::new(s.graph.values.len());
        // SAFETY: each buffer holds its value's planned f32 data and lives as long as the run.
        unsafe {
            for (&v, b) in s.weights.iter().zip(&dw) {
                bind.bind(v, b.ptr());
            }
            for (sv, b) in s.seeds.iter().zip(&ds) {
                bind.bind(sv.expect("seeded"), b.ptr());
            }
        }
        let sizes = weights.iter().map(Vec::len).collect();
        let buffers = dw.into_iter().chain(ds).collect();
        GpuRun { s, g, plan, kernels, consts, _arena: arena, base, bind, sizes, _buffers: buffers, mode, stream, seed: 1 }
    }

    /// The same run stepping with another seed: other dropout masks.
    pub(super) fn with_seed(self, seed: u64) -> Self {
        GpuRun { seed, ..self }
    }

    /// How many of the plan's constants stayed on the host (masks the attention computes).
    pub(super) fn masks_on_host(&self) -> usize {
        self.consts.on_host()
    }

    /// One step with `inputs` (host bytes, one per session input): (outputs, the gradient of
    /// every weight; zeros for a weight without one).
    pub(super) fn step(&mut self, inputs: &[&[u8]]) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        let (s, g) = (self.s, self.g);
        let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
        let dg: Vec<DeviceBuffer> = self.sizes.iter().map(|&n| zeros::<f32>(g, n)).collect();
        for (gv, b) in s.grads.iter().zip(&dg) {
            if let Some(gv) = gv {
                // SAFETY: the buffer holds the weight's f32 gradient and outlives this step's
                // work (downloaded below).
                unsafe { self.bind.bind(*gv, b.ptr()) };
            }
        }
        let mut ctx = CudaCtx { rt, stream: self.stream, seed: self.seed, seed_slot: 0, f32_mode: self.mode, error_flag: 0, error_base: 0 };
        let feed: Vec<_> = s.inputs.iter().zip(inputs).map(|(&v, x)| (v, InputSrc::Host(x))).collect();
        let (plan, kernels, consts, base, bind) = (&self.plan, &self.kernels, &self.consts, self.base, &self.bind);
        let run = |phase, feed: &[_], ctx: &mut CudaCtx| {
            cexec::run_phase(&s.graph, plan, kernels, phase, base, bind, consts, feed, ctx).unwrap_or_else(|e| panic!("{e}"))
        };
        run(Phase::Forward, &feed, &mut ctx);
        let outs: Vec<Vec<f32>> = s
            .outputs
            .iter()
            .map(|&o| {
                let a = cexec::address(&s.graph, plan, base, bind, consts, o).expect("output address");
                download_f32(g, a, plan.shape(o).iter().product())
            })
            .collect();
        run(Phase::Backward, &[], &mut ctx);
        (outs, dg.iter().map(host::<f32>).collect())
    }
}
