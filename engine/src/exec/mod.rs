//! Runs a plan: resolves every value to memory (arena offset, constant, or caller-bound
//! pointer), builds kernel views and calls the kernels of one phase in order, optionally timing
//! each step for profiles.

use std::time::{Duration, Instant};

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod fault;
mod pairs;
pub mod profile;

use crate::backend::cpu::{on_this_thread, CpuCtx, In, Out};
use crate::error::{Error, Result};
use crate::ir::{Graph, Node, ValueId};
use crate::plan::memory::ALIGN;
use crate::plan::{Plan, Storage};

/// Runs `f` on one of rayon's pool threads while the caller waits (directly when the caller is
/// one). The kernels' parallel loops then start on a pool thread, whose idle siblings steal
/// their parts, instead of each loop being sent into the pool from outside while the caller
/// sleeps: the tutorial's engine time outside its LM head went from about 25.3 to 23.9 ms a step
/// (medians of six interleaved pairs, Zen 4, 2 threads). The Python binding runs each phase so.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        rayon::scope(|_| f())
    }
}

/// The arena one in-flight step uses; reused across calls while its size fits.
pub struct Arena {
    buf: Vec<u64>,
}

impl Arena {
    pub fn new() -> Self {
        Arena { buf: Vec::new() }
    }
    /// Makes room for `bytes` (64-byte aligned start). Returns the base pointer.
    pub fn reserve(&mut self, bytes: usize) -> *mut u8 {
        let words = (bytes + ALIGN) / 8 + 1;
        if self.buf.len() < words {
            self.buf = vec![0u64; words];
        }
        let p = self.buf.as_mut_ptr() as *mut u8;
        let pad = p.align_offset(ALIGN);
        // SAFETY: the buffer has ALIGN spare bytes, so base + pad stays inside it.
        unsafe { p.add(pad) }
    }
    pub fn capacity_bytes(&self) -> usize {
        self.buf.len() * 8
    }
}

impl Default for Arena {
    fn default() -> Self {
        Self::new()
    }
}

/// Caller memory bound for one call: a pointer per value id (null where unbound).
pub struct Bindings {
    ptrs: Vec<*mut u8>,
}

impl Bindings {
    pub fn new(n_values: usize) -> Self {
        Bindings { ptrs: vec![std::ptr::null_mut(); n_values] }
    }
    /// # Safety
    /// `ptr` must point to memory holding the value's planned type (numel × element size
    /// bytes, aligned for the element), valid for the whole call, and, for values the plan
    /// writes (bound outputs), not read or written by anyone else during the call.
    pub unsafe fn bind(&mut self, v: ValueId, ptr: *mut u8) {
        self.ptrs[v.0] = ptr;
    }
}

/// One step's node with its input and output views.
type StepViews<'a> = (&'a Node, Vec<Option<In<'a>>>, Vec<Out<'a>>);

pub enum Phase {
    Forward,
    Backward,
}

fn pointer(graph: &Graph, plan: &Plan, base: *mut u8, bind: &Bindings, v: ValueId) -> Result<*mut u8> {
    match &plan.storage[v.0] {
        // SAFETY: planned offsets lie inside the reserved arena of plan.arena_bytes.
        Storage::Arena(off) => Ok(unsafe { base.add(*off) }),
        Storage::Const(t) => Ok(t.as_bytes().as_ptr() as *mut u8),
        Storage::Bound => {
            let p = bind.ptrs[v.0];
            if p.is_null() {
                Err(Error::other(format!("no memory was bound for '{}'", graph.values[v.0].name)))
            } else {
                Ok(p)
            }
        }
        Storage::Alias(src) => pointer(graph, plan, base, bind, *src),
        Storage::Unused => Err(Error::other(format!("value '{}' has no storage in this plan", graph.values[v.0].name))),
    }
}

/// Pointer to a value's bytes after (or during) a run; for reading outputs.
pub fn value_ptr(graph: &Graph, plan: &Plan, arena: &mut Arena, bind: &Bindings, v: ValueId) -> Result<*mut u8> {
    let base = arena.reserve(plan.arena_bytes);
    pointer(graph, plan, base, bind, v)
}

/// Runs one phase of `plan`. `inputs` are the user inputs' bytes, copied into the arena at the
/// start of the forward phase. `timings`, if given, receives each step's duration.
#[allow(clippy::too_many_arguments)]
pub fn run_phase(
    graph: &Graph,
    plan: &Plan,
    phase: Phase,
    arena: &mut Arena,
    bind: &Bindings,
    inputs: &[(ValueId, &[u8])],
    ctx: &mut CpuCtx,
    mut timings: Option<&mut Vec<(usize, Duration)>>,
) -> Result<()> {
    let base = arena.reserve(plan.arena_bytes);
    let range = match phase {
        Phase::Forward => {
            for &(v, bytes) in inputs {
                if let Storage::Arena(off) = plan.storage[v.0] {
                    let want = plan.shape(v).iter().product::<usize>() * plan.dtype(v).map_or(0, |d| d.size());
                    if bytes.len() != want {
                        return Err(Error::Input {
                            name: graph.values[v.0].name.clone(),
                            msg: format!("got {} bytes, the plan expects {want}", bytes.len()),
                        });
                    }
                    // SAFETY: the arena slot holds `want` bytes and does not overlap `bytes`.
                    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), base.add(off), want) };
                }
            }
            0..plan.split
        }
        Phase::Backward => plan.split..plan.steps.len(),
    };
    let fault = fault::target();
    let views = |i: usize| -> Result<StepViews> {
        let node = &graph.nodes[plan.steps[i].0];
        let mut ins = Vec::with_capacity(node.inputs.len());
        for inp in &node.inputs {
            match inp {
                None => ins.push(None),
                Some(v) => {
                    let p = pointer(graph, plan, base, bind, *v)?;
                    let dtype = plan.dtype(*v).ok_or_else(|| node.err("untyped input"))?;
                    // SAFETY: p points to the value's planned bytes, alive for this step; no
                    // output of this step overlaps it (the memory plan separates live buffers).
                    ins.push(Some(unsafe { In::from_raw(dtype, plan.shape(*v), p) }));
                }
            }
        }
        let mut outs = Vec::with_capacity(node.outputs.len());
        for &o in &node.outputs {
            let p = pointer(graph, plan, base, bind, o)?;
            let dtype = plan.dtype(o).ok_or_else(|| node.err("untyped output"))?;
            // SAFETY: p points to the output's planned bytes, written only by this step.
            outs.push(unsafe { Out::from_raw(dtype, plan.shape(o), p) });
        }
        Ok((node, ins, outs))
    };
    let run = |i: usize, node: &Node, ins: &[Option<In>], outs: &mut [Out], ctx: &mut CpuCtx| -> Result<Duration> {
        let t0 = Instant::now();
        crate::backend::cpu::widen::call(plan.kernels[i], node, ins, outs, ctx).map_err(|e| match e {
            Error::Node { .. } => e,
            other => node.err(other.to_string()),
        })?;
        fault::apply(fault.as_deref(), node, outs);
        Ok(t0.elapsed())
    };
    let threads = rayon::current_num_threads();
    let mut i = range.start;
    while i < range.end {
        let (node, ins, mut outs) = views(i)?;
        // the next step's views are built only when both steps are products that might pair
        let next_is_product = || i + 1 < range.end && pairs::is_product(&graph.nodes[plan.steps[i + 1].0].op_type);
        if threads > 1 && pairs::is_product(&node.op_type) && next_is_product() {
            let (node_b, ins_b, mut outs_b) = views(i + 1)?;
            if pairs::side_by_side((node, &ins, &outs), (node_b, &ins_b, &outs_b)) {
                // products only: they use no random numbers, so the second one's context
                // needs nothing but the matmul path
                let mut ctx_b = CpuCtx::new(0).with_matmul(ctx.matmul);
                let wall = Instant::now();
                let (ra, rb) = rayon::join(
                    || on_this_thread(|| run(i, node, &ins, &mut outs, ctx)),
                    || on_this_thread(|| run(i + 1, node_b, &ins_b, &mut outs_b, &mut ctx_b)),
                );
                let (da, db) = (ra?, rb?);
                if let Some(t) = timings.as_deref_mut() {
                    // each step's share of the wall time the two took together
                    let (wall, sum) = (wall.elapsed().as_secs_f64(), (da + db).as_secs_f64().max(1e-12));
                    t.push((i, Duration::from_secs_f64(wall * da.as_secs_f64() / sum)));
                    t.push((i + 1, Duration::from_secs_f64(wall * db.as_secs_f64() / sum)));
                }
                i += 2;
                continue;
            }
        }
        let d = run(i, node, &ins, &mut outs, ctx)?;
        if let Some(t) = timings.as_deref_mut() {
            t.push((i, d));
        }
        i += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn on_pool_runs_the_work_on_a_pool_thread_and_returns_its_result() {
        assert!(rayon::current_thread_index().is_none(), "the test harness thread is not a pool thread");
        let (index, sum) = super::on_pool(|| (rayon::current_thread_index(), (1..=10).sum::<i32>()));
        assert!(index.is_some());
        assert_eq!(sum, 55);
        // from a pool thread, on that same thread
        let nested = super::on_pool(|| {
            let outer = rayon::current_thread_index();
            super::on_pool(|| rayon::current_thread_index() == outer)
        });
        assert!(nested);
    }
}
