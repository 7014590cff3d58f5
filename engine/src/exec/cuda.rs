//! Runs a plan on the GPU: the same plan the CPU runs (order, types, arena offsets, aliases),
//! with the arena in device memory, constants uploaded once per plan, caller memory bound as
//! device addresses (PyTorch's CUDA tensors), and each step dispatched to the CUDA kernel table
//! (backend/cuda/ops) on the caller's stream. Nothing here waits for the device: the caller
//! synchronises (or keeps queueing on the same stream, as PyTorch does).

use std::collections::{HashMap, HashSet};

use cudarc::driver::result;

use super::Phase;
use crate::backend::cuda::launch::DeviceBuffer;
use crate::backend::cuda::ops::{self, CudaCtx, CudaKernel, DView};
use crate::backend::cuda::runtime::CudaRuntime;
use crate::error::{Error, Result};
use crate::ir::{Graph, ValueId};
use crate::plan::{Plan, Storage};

/// The device arena one in-flight step uses; reused while its size fits.
#[derive(Default)]
pub struct DeviceArena {
    buf: Option<DeviceBuffer>,
}

impl DeviceArena {
    /// Device address of at least `bytes` bytes (cuMemAlloc's 256-byte alignment covers the
    /// plan's 64-byte offsets).
    pub fn reserve(&mut self, rt: &CudaRuntime, bytes: usize) -> Result<u64> {
        if self.buf.as_ref().is_none_or(|b| b.bytes() < bytes) {
            self.buf = None;
            self.buf = Some(DeviceBuffer::zeroed(&rt.loaded.ctx, bytes)?);
        }
        Ok(self.buf.as_ref().map_or(0, |b| b.ptr()))
    }
}

/// A plan's constants on the device, uploaded once; except causal masks that every reader
/// computes instead ([`ops::computes_mask`]): GPT-2's [B, 1, T, T] f32 mask is 64 MB at batch 16
/// and no kernel reads it. Their address is 0.
pub struct DeviceConsts {
    bufs: HashMap<usize, DeviceBuffer>,
    /// Masks left on the host (computed by their readers).
    computed: HashSet<usize>,
}

impl DeviceConsts {
    pub fn upload(rt: &CudaRuntime, graph: &Graph, plan: &Plan) -> Result<Self> {
        let mut bufs = HashMap::new();
        let computed = computed_masks(graph, plan);
        for (i, s) in plan.storage.iter().enumerate() {
            if let Storage::Const(t) = s {
                if !computed.contains(&i) {
                    bufs.insert(i, DeviceBuffer::from_slice(&rt.loaded.ctx, t.as_bytes())?);
                }
            }
        }
        Ok(DeviceConsts { bufs, computed })
    }

    /// How many constants stayed on the host (causal masks their readers compute).
    pub fn on_host(&self) -> usize {
        self.computed.len()
    }
}

/// The constants whose every reading step is an attention that computes it as its mask.
fn computed_masks(graph: &Graph, plan: &Plan) -> HashSet<usize> {
    let mut verdict: HashMap<usize, bool> = HashMap::new();
    for s in &plan.steps {
        let node = &graph.nodes[s.0];
        let first = crate::ops::attention::q_input(&node.op_type);
        for (slot, v) in node.inputs.iter().enumerate() {
            let Some(v) = v else { continue };
            let Storage::Const(t) = &plan.storage[v.0] else { continue };
            let computes = first.is_some_and(|f| {
                slot == f + 3 && {
                    let ty = |k: usize| node.input(f + k).and_then(|x| Some((plan.dtype(x)?, plan.shape(x))));
                    match (ty(0), ty(1), ty(2), ty(3)) {
                        (Some(q), Some(k), Some(v), Some(m)) => ops::computes_mask(node, [q, k, v, m], t),
                        _ => false,
                    }
                }
            });
            *verdict.entry(v.0).or_insert(true) &= computes;
        }
    }
    verdict.into_iter().filter(|&(_, c)| c).map(|(v, _)| v).collect()
}

/// Caller memory bound for one call: a device address per value id (0 where unbound).
pub struct DeviceBindings {
    ptrs: Vec<u64>,
}

impl DeviceBindings {
    pub fn new(n_values: usize) -> Self {
        DeviceBindings { ptrs: vec![0; n_values] }
    }
    /// # Safety
    /// `ptr` must be a device address in the runtime's context holding the value's planned
    /// type, valid until the work queued by the call has run, and, for values the plan writes,
    /// not used by anyone else meanwhile.
    pub unsafe fn bind(&mut self, v: ValueId, ptr: u64) {
        self.ptrs[v.0] = ptr;
    }
}

/// Where a forward input's bytes come from.
pub enum InputSrc<'a> {
    Host(&'a [u8]),
    /// A device address holding the input's planned bytes.
    Device(u64),
}

/// The op types of `plan` that have no CUDA kernel, sorted and deduplicated.
pub fn missing_kernels(graph: &Graph, plan: &Plan) -> Vec<String> {
    let mut v: Vec<String> = plan.steps.iter().map(|s| graph.nodes[s.0].op_type.clone()).filter(|o| ops::kernel(o).is_none()).collect();
    v.sort();
    v.dedup();
    v
}

/// The kernel of every step, or an error listing every op type without one.
pub fn resolve(graph: &Graph, plan: &Plan) -> Result<Vec<CudaKernel>> {
    let missing = missing_kernels(graph, plan);
    if !missing.is_empty() {
        return Err(Error::other(format!("no CUDA kernel for: {}", missing.join(", "))));
    }
    Ok(plan.steps.iter().filter_map(|s| ops::kernel(&graph.nodes[s.0].op_type)).collect())
}

/// Device address of a value in a run of `plan` with arena `base` (also for reading outputs).
pub fn address(graph: &Graph, plan: &Plan, base: u64, bind: &DeviceBindings, consts: &DeviceConsts, v: ValueId) -> Result<u64> {
    match &plan.storage[v.0] {
        Storage::Arena(off) => Ok(base + *off as u64),
        Storage::Const(_) if consts.computed.contains(&v.0) => Ok(0),
        Storage::Const(_) => consts
            .bufs
            .get(&v.0)
            .map(|b| b.ptr())
            .ok_or_else(|| Error::other(format!("constant '{}' was not uploaded", graph.values[v.0].name))),
        Storage::Bound => match bind.ptrs[v.0] {
            0 => Err(Error::other(format!("no device memory was bound for '{}'", graph.values[v.0].name))),
            p => Ok(p),
        },
        Storage::Alias(src) => address(graph, plan, base, bind, consts, *src),
        Storage::Unused => Err(Error::other(format!("value '{}' has no storage in this plan", graph.values[v.0].name))),
    }
}

/// Queues the copies of a forward phase's `inputs` into their arena slots (arena `base`) on
/// `ctx.stream`. `run_phase` does it first; a step replayed from a CUDA graph does it before the
/// replay (the graph keeps the slots, the inputs' own memory changes per step).
pub fn copy_inputs(graph: &Graph, plan: &Plan, base: u64, inputs: &[(ValueId, InputSrc)], ctx: &CudaCtx) -> Result<()> {
    for (v, src) in inputs {
        if let Storage::Arena(off) = plan.storage[v.0] {
            let want = plan.shape(*v).iter().product::<usize>() * plan.dtype(*v).map_or(0, |d| d.size());
            let dst = base + off as u64;
            // the arena slot holds `want` bytes (the plan's layout; the caller reserved
            // plan.arena_bytes at `base`)
            let r = match src {
                InputSrc::Host(bytes) => {
                    if bytes.len() != want {
                        return Err(Error::Input {
                            name: graph.values[v.0].name.clone(),
                            msg: format!("got {} bytes, the plan expects {want}", bytes.len()),
                        });
                    }
                    // on `ctx.stream`, so the phase's kernels see it: a synchronous copy goes on
                    // the legacy stream and may return before its DMA is done, which a
                    // non-blocking stream does not wait for; from pageable memory the driver
                    // takes the bytes before it returns.
                    // SAFETY: `bytes` holds exactly `want` bytes (checked above), the slot too.
                    unsafe { result::memcpy_htod_async(dst, bytes, ctx.stream) }
                }
                // SAFETY: the caller's contract: `p` holds the input's `want` bytes.
                InputSrc::Device(p) => unsafe { result::memcpy_dtod_async(dst, *p, want, ctx.stream) },
            };
            r.map_err(|e| Error::Cuda(format!("copying input '{}': {e}", graph.values[v.0].name)))?;
        }
    }
    Ok(())
}

/// Queues one phase of `plan` on `ctx.stream`. `base` is the arena (plan.arena_bytes at least);
/// `inputs` are copied into it at the start of the forward phase.
#[allow(clippy::too_many_arguments)]
pub fn run_phase(
    graph: &Graph,
    plan: &Plan,
    kernels: &[CudaKernel],
    phase: Phase,
    base: u64,
    bind: &DeviceBindings,
    consts: &DeviceConsts,
    inputs: &[(ValueId, InputSrc)],
    ctx: &mut CudaCtx,
) -> Result<()> {
    ctx.rt.bind()?;
    let rt = ctx.rt;
    let _claim = rt.claim(ctx.stream)?;
    let range = match phase {
        Phase::Forward => {
            copy_inputs(graph, plan, base, inputs, ctx)?;
            0..plan.split
        }
        Phase::Backward => plan.split..plan.steps.len(),
    };
    for i in range {
        let node = &graph.nodes[plan.steps[i].0];
        if ctx.error_base != 0 {
            ctx.error_flag = ctx.error_base + 4 * plan.steps[i].0 as u64;
        }
        let mut ins = Vec::with_capacity(node.inputs.len());
        for inp in &node.inputs {
            ins.push(match inp {
                None => None,
                Some(v) => Some(DView {
                    dtype: plan.dtype(*v).ok_or_else(|| node.err("untyped input"))?,
                    shape: plan.shape(*v),
                    ptr: address(graph, plan, base, bind, consts, *v)?,
                    host: match &plan.storage[v.0] {
                        Storage::Const(t) => Some(t),
                        _ => None,
                    },
                }),
            });
        }
        let mut outs = Vec::with_capacity(node.outputs.len());
        for &o in &node.outputs {
            outs.push(DView {
                dtype: plan.dtype(o).ok_or_else(|| node.err("untyped output"))?,
                shape: plan.shape(o),
                ptr: address(graph, plan, base, bind, consts, o)?,
                host: None,
            });
        }
        (kernels[i])(node, &ins, &outs, ctx).map_err(|e| match e {
            Error::Node { .. } => e,
            other => node.err(other.to_string()),
        })?;
    }
    Ok(())
}
