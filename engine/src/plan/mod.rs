//! Planning for concrete input shapes: which nodes run (pruned to what the requested outputs
//! need), in which phase (forward, then backward), the type of every value, which values are
//! constants (folded here, on the host), and where every other value lives (arena offset, or
//! memory bound by the caller). The result is plain data that `exec` runs.

mod attention_masks;
mod in_place;
pub mod memory;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;

use crate::backend::cpu::{self, CpuCtx, In, Kernel, Out};
use crate::error::{Error, MissingList, Result};
use crate::ir::{Dim, Graph, NodeId, ValueId, ValueKind};
use crate::ops::{self, InferIn, TypeOut};
use crate::tensor::{DType, Tensor};
use memory::Buffer;

/// Where a value lives while a plan runs.
#[derive(Clone, Debug)]
pub enum Storage {
    /// Not needed by this plan.
    Unused,
    /// In the arena at this byte offset.
    Arena(usize),
    /// A constant (imported, or folded at plan time).
    Const(Arc<Tensor>),
    /// Memory the caller binds per call (weights, gradient seeds, gradients written in place).
    Bound,
    /// The same bytes as another value (a view op's output sharing its input's memory).
    Alias(ValueId),
}

/// What to plan for.
pub struct PlanRequest<'a> {
    pub graph: &'a Graph,
    /// Nodes before this index are forward nodes; the rest are backward nodes.
    pub n_fwd: usize,
    /// Values the forward phase must produce (returned to the caller after phase 1).
    pub forward_outputs: Vec<ValueId>,
    /// Values the backward phase must produce (empty: forward only).
    pub backward_outputs: Vec<ValueId>,
    /// Of those, the ones written straight into caller memory.
    pub bound_outputs: Vec<ValueId>,
    /// Concrete types of user inputs (copied into the arena) and weights (bound).
    pub input_types: HashMap<ValueId, (DType, Vec<usize>)>,
    /// Gradient seeds (bound per call) and the output each one is the gradient of.
    pub seeds: Vec<(ValueId, ValueId)>,
    /// Bound backward outputs whose caller memory is bound from the forward phase on. Where
    /// one is `Mul(u, s)` of a forward value `u` of its own type that nothing else reads and a
    /// scalar `s` (LinearCrossEntropy's unit-seed gradients times the loss seed), `u` is
    /// written straight into that memory and the Mul scales it in place: `u` takes no arena
    /// space between the phases.
    pub bound_from_forward: Vec<ValueId>,
}

pub struct Plan {
    pub steps: Vec<NodeId>,
    /// steps[..split] run in phase 1 (forward), steps[split..] in phase 2 (backward).
    pub split: usize,
    pub kernels: Vec<Kernel>,
    pub types: Vec<Option<TypeOut>>,
    pub storage: Vec<Storage>,
    pub arena_bytes: usize,
    /// User inputs, copied into the arena at the start of phase 1.
    pub copied_inputs: Vec<ValueId>,
    pub folded_nodes: usize,
    /// View nodes (Reshape and friends) that share their input's memory instead of running.
    pub views: usize,
    /// Steps that scale their first operand in place (`PlanRequest::bound_from_forward`).
    pub in_place: Vec<usize>,
    /// Every arena buffer: the value owning it, its size and the steps it is alive.
    pub buffers: Vec<(ValueId, Buffer)>,
}

impl Plan {
    pub fn shape(&self, v: ValueId) -> &[usize] {
        self.types[v.0].as_ref().map(|t| t.shape.as_slice()).unwrap_or(&[])
    }
    pub fn dtype(&self, v: ValueId) -> Option<DType> {
        self.types[v.0].as_ref().map(|t| t.dtype)
    }
    /// Op type -> number of steps, for summaries.
    pub fn op_histogram(&self, graph: &Graph) -> Vec<(String, usize)> {
        let mut h: HashMap<&str, usize> = HashMap::new();
        for s in &self.steps {
            *h.entry(graph.nodes[s.0].op_type.as_str()).or_default() += 1;
        }
        let mut v: Vec<(String, usize)> = h.into_iter().map(|(k, n)| (k.to_string(), n)).collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        v
    }
    /// The step at which the arena's buffers alive together weigh the most, that weight, and
    /// the values alive then, largest first. The arena is at least that weight (more where
    /// the placement leaves gaps).
    pub fn peak(&self) -> (usize, usize, Vec<(ValueId, usize)>) {
        let n = self.steps.len().max(1);
        // bytes starting minus bytes ending at each step
        let mut delta = vec![0i128; n + 1];
        for (_, b) in &self.buffers {
            delta[b.first.min(n - 1)] += memory::align_up(b.bytes) as i128;
            delta[b.last.min(n - 1) + 1] -= memory::align_up(b.bytes) as i128;
        }
        let (mut sum, mut best) = (0i128, (0usize, 0i128));
        for (i, d) in delta.iter().take(n).enumerate() {
            sum += d;
            if sum > best.1 {
                best = (i, sum);
            }
        }
        let best = (best.0, best.1 as usize);
        let mut alive: Vec<(ValueId, usize)> =
            self.buffers.iter().filter(|(_, b)| b.first <= best.0 && best.0 <= b.last).map(|(v, b)| (*v, b.bytes)).collect();
        alive.sort_by(|a, b| b.1.cmp(&a.1).then(a.0 .0.cmp(&b.0 .0)));
        (best.0, best.1, alive)
    }
    pub fn describe(&self, graph: &Graph) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "steps: {} forward + {} backward ({} nodes folded at plan time)",
            self.split,
            self.steps.len() - self.split,
            self.folded_nodes
        );
        let _ = writeln!(s, "arena: {} bytes ({:.1} MiB)", self.arena_bytes, self.arena_bytes as f64 / (1 << 20) as f64);
        let ops: Vec<String> = self.op_histogram(graph).iter().map(|(k, n)| format!("{k}×{n}")).collect();
        let _ = writeln!(s, "ops: {}", ops.join(" "));
        s
    }
}

/// Nodes (among `range`) that the `targets` depend on, as a mask over all nodes.
fn ancestors(graph: &Graph, targets: &[ValueId], range: std::ops::Range<usize>, mask: &mut [bool]) {
    let mut stack: Vec<ValueId> = targets.to_vec();
    let mut seen = vec![false; graph.values.len()];
    while let Some(v) = stack.pop() {
        if std::mem::replace(&mut seen[v.0], true) {
            continue;
        }
        if let Some(p) = graph.values[v.0].producer {
            if range.contains(&p.0) && !mask[p.0] {
                mask[p.0] = true;
                stack.extend(graph.nodes[p.0].inputs.iter().flatten().copied());
            }
        }
    }
}

pub fn build(req: &PlanRequest) -> Result<Plan> {
    let g = req.graph;
    let n_nodes = g.nodes.len();
    let mut needed = vec![false; n_nodes];
    ancestors(g, &req.backward_outputs, req.n_fwd..n_nodes, &mut needed);
    // forward values the backward nodes read, plus the forward outputs
    let mut fwd_targets = req.forward_outputs.clone();
    for n in (req.n_fwd..n_nodes).filter(|&n| needed[n]) {
        fwd_targets.extend(g.nodes[n].inputs.iter().flatten().filter(|v| g.values[v.0].producer.is_some_and(|p| p.0 < req.n_fwd)));
    }
    ancestors(g, &fwd_targets, 0..req.n_fwd, &mut needed);

    // types and constant folding, in node order
    let mut types: Vec<Option<TypeOut>> = vec![None; g.values.len()];
    let mut consts: Vec<Option<Arc<Tensor>>> = vec![None; g.values.len()];
    for (i, v) in g.values.iter().enumerate() {
        match &v.kind {
            ValueKind::Const(t) => {
                types[i] = Some(TypeOut::new(t.dtype(), t.shape.clone()));
                consts[i] = Some(t.clone());
            }
            ValueKind::Input | ValueKind::Weight => {
                if let Some((dt, shape)) = req.input_types.get(&ValueId(i)) {
                    check_declared(v, *dt, shape)?;
                    types[i] = Some(TypeOut::new(*dt, shape.clone()));
                } else if v.kind == ValueKind::Weight {
                    if let (Some(dt), Some(shape)) = (v.dtype, known_shape(&v.shape)) {
                        types[i] = Some(TypeOut::new(dt, shape));
                    }
                }
            }
            ValueKind::Computed => {}
        }
    }
    let mut steps = Vec::new();
    let mut folded = 0;
    let mut views = 0;
    // view outputs share their input's memory: value -> the value owning the bytes
    let mut alias: Vec<Option<ValueId>> = vec![None; g.values.len()];
    let mut ctx = CpuCtx::new(0);
    let consumers = g.consumers();
    let mask_only = attention_masks::mask_only_values(g, &consumers, &needed);
    // readers left of each value: a folded value every reader of which was folded too is
    // dropped (a big folded mask's intermediates are not all held until the plan is built)
    let mut readers_left: Vec<usize> = consumers.iter().map(|r| r.iter().filter(|(c, _)| needed[c.0]).count()).collect();
    for n in (0..n_nodes).filter(|&n| needed[n]) {
        let node = &g.nodes[n];
        let op = ops::lookup(&node.op_type).ok_or_else(|| Error::Unsupported {
            op_type: node.op_type.clone(),
            node: node.name.clone(),
            msg: "unknown op".into(),
        })?;
        for v in node.inputs.iter().flatten() {
            if types[v.0].is_none() {
                if let Some((_, out)) = req.seeds.iter().find(|s| s.0 == *v) {
                    types[v.0] = types[out.0].clone();
                }
            }
        }
        let mut ins = Vec::with_capacity(node.inputs.len());
        for inp in &node.inputs {
            match inp {
                None => ins.push(None),
                Some(v) => {
                    let t = types[v.0].as_ref().ok_or_else(|| {
                        let val = &g.values[v.0];
                        match val.kind {
                            ValueKind::Input => Error::Input { name: val.name.clone(), msg: "no tensor was given for this input".into() },
                            _ => node.err(format!("input '{}' has no known type", val.name)),
                        }
                    })?;
                    ins.push(Some(InferIn { dtype: t.dtype, shape: &t.shape, value: consts[v.0].as_deref() }));
                }
            }
        }
        let outs = op.infer(node, &ins)?;
        let is_view = op.is_view_for(node, &ins);
        if outs.len() < node.outputs.len() {
            return Err(node.err(format!("shape inference gave {} outputs for {}", outs.len(), node.outputs.len())));
        }
        let all_const =
            node.inputs.iter().enumerate().all(|(i, v)| v.is_none_or(|v| consts[v.0].is_some() || ops::reads_type_only(&node.op_type, i)));
        let foldable = all_const && !op.is_random() && node.outputs.iter().all(|o| !req.bound_outputs.contains(o));
        let limit = attention_masks::fold_limit(&mask_only, &node.outputs);
        let folded_vals = if foldable { fold(node, &ins, &outs, limit, &mut ctx)? } else { None };
        for (k, &o) in node.outputs.iter().enumerate() {
            types[o.0] = Some(outs[k].clone());
        }
        match folded_vals {
            Some(vals) => {
                for (&o, t) in node.outputs.iter().zip(vals) {
                    consts[o.0] = Some(Arc::new(t));
                }
                for &v in node.inputs.iter().flatten() {
                    readers_left[v.0] -= 1;
                    if readers_left[v.0] == 0
                        && g.values[v.0].kind == ValueKind::Computed
                        && !req.forward_outputs.contains(&v)
                        && !req.backward_outputs.contains(&v)
                    {
                        consts[v.0] = None;
                    }
                }
                folded += 1;
            }
            None => {
                let root = view_source(is_view, node, &types, &req.bound_outputs).map(|src| alias[src.0].unwrap_or(src));
                // forward outputs are read after the call, when caller memory is no longer bound
                let readable = |r: ValueId| !(is_bound(req, r) && req.forward_outputs.contains(&node.outputs[0]));
                match root {
                    Some(r) if consts[r.0].is_none() && readable(r) => {
                        alias[node.outputs[0].0] = Some(r);
                        views += 1;
                    }
                    _ => steps.push(NodeId(n)),
                }
            }
        }
    }
    let split = steps.iter().filter(|s| s.0 < req.n_fwd).count();

    let mut missing: Vec<String> = Vec::new();
    let mut kernels = Vec::with_capacity(steps.len());
    for s in &steps {
        let node = &g.nodes[s.0];
        match cpu::kernel(&node.op_type) {
            Some(k) => kernels.push(k),
            None => missing.push(format!("{} ({})", node.op_type, node.name)),
        }
    }
    if !missing.is_empty() {
        return Err(Error::MissingKernels(MissingList(missing)));
    }
    let in_place = in_place::apply(req, &steps, split, &types, &consts, &mut alias, &mut kernels);

    // storage and lifetimes
    let mut storage = vec![Storage::Unused; g.values.len()];
    let mut first = vec![usize::MAX; g.values.len()];
    let mut last = vec![0usize; g.values.len()];
    let mut copied_inputs = Vec::new();
    let owner = |v: ValueId| alias[v.0].unwrap_or(v);
    for (i, s) in steps.iter().enumerate() {
        let node = &g.nodes[s.0];
        for (k, v) in node.inputs.iter().enumerate() {
            let Some(v) = *v else { continue };
            if let Some(c) = &consts[v.0] {
                storage[v.0] = Storage::Const(c.clone());
                continue;
            }
            // a read of the type only (CastLike's target) leaves the value's memory free
            if ops::reads_type_only(&node.op_type, k) && first[owner(v).0] != usize::MAX {
                continue;
            }
            let v = owner(v);
            last[v.0] = last[v.0].max(i);
            first[v.0] = first[v.0].min(i);
        }
        for o in &node.outputs {
            first[o.0] = first[o.0].min(i);
            last[o.0] = last[o.0].max(i);
        }
    }
    for &o in &req.forward_outputs {
        let o = if consts[o.0].is_some() { o } else { owner(o) };
        if let Some(c) = &consts[o.0] {
            storage[o.0] = Storage::Const(c.clone());
        } else if first[o.0] == usize::MAX {
            first[o.0] = 0;
            last[o.0] = split.saturating_sub(1);
        } else {
            last[o.0] = last[o.0].max(split.saturating_sub(1));
        }
    }
    let mut buffers = Vec::new();
    let mut owners = Vec::new();
    for (i, v) in g.values.iter().enumerate() {
        // aliases (in-place operands, plan/in_place.rs) live in their owner's memory
        if first[i] == usize::MAX || matches!(storage[i], Storage::Const(_)) || alias[i].is_some() {
            continue;
        }
        if is_bound(req, ValueId(i)) {
            storage[i] = Storage::Bound;
            continue;
        }
        let t = types[i].as_ref().ok_or_else(|| Error::other(format!("value '{}' has no type", v.name)))?;
        if v.kind == ValueKind::Input {
            first[i] = 0;
            copied_inputs.push(ValueId(i));
        }
        buffers.push(Buffer { bytes: t.shape.iter().product::<usize>() * t.dtype.size(), first: first[i], last: last[i] });
        owners.push(i);
    }
    let mp = memory::plan(&buffers);
    for (k, &i) in owners.iter().enumerate() {
        storage[i] = Storage::Arena(mp.offsets[k]);
    }
    let buffers: Vec<(ValueId, Buffer)> = owners.iter().map(|&i| ValueId(i)).zip(buffers).collect();
    for (i, a) in alias.iter().enumerate() {
        if let Some(a) = a {
            storage[i] = Storage::Alias(*a);
        }
    }
    Ok(Plan {
        steps,
        split,
        kernels,
        types,
        storage,
        arena_bytes: mp.arena_bytes,
        copied_inputs,
        folded_nodes: folded,
        views,
        in_place,
        buffers,
    })
}

/// Values living in memory the caller binds per call.
fn is_bound(req: &PlanRequest, v: ValueId) -> bool {
    req.graph.values[v.0].kind == ValueKind::Weight || req.bound_outputs.contains(&v) || req.seeds.iter().any(|s| s.0 == v)
}

/// The input whose memory a view node's output may share: the op is a view (`is_view`: for these arguments), element type and
/// count agree, and the output is not written into caller memory.
fn view_source(is_view: bool, node: &crate::ir::Node, types: &[Option<TypeOut>], bound: &[ValueId]) -> Option<ValueId> {
    if !is_view || node.outputs.len() != 1 || bound.contains(&node.outputs[0]) {
        return None;
    }
    let src = node.input(0)?;
    let (ti, to) = (types[src.0].as_ref()?, types[node.outputs[0].0].as_ref()?);
    let numel = |t: &TypeOut| t.shape.iter().product::<usize>();
    (ti.dtype == to.dtype && numel(ti) == numel(to)).then_some(src)
}

fn known_shape(s: &Option<Vec<Dim>>) -> Option<Vec<usize>> {
    s.as_ref()?.iter().map(|d| if let Dim::Known(k) = d { Some(*k) } else { None }).collect()
}

fn check_declared(v: &crate::ir::Value, dt: DType, shape: &[usize]) -> Result<()> {
    if let Some(want) = v.dtype {
        if want != dt {
            return Err(Error::Input { name: v.name.clone(), msg: format!("expected element type {}, got {}", want.name(), dt.name()) });
        }
    }
    if let Some(dims) = &v.shape {
        let ok = dims.len() == shape.len() && dims.iter().zip(shape).all(|(d, &s)| !matches!(d, Dim::Known(k) if *k != s));
        if !ok {
            let want: Vec<String> = dims
                .iter()
                .map(|d| match d {
                    Dim::Known(k) => k.to_string(),
                    Dim::Sym(s) => s.clone(),
                })
                .collect();
            return Err(Error::Input { name: v.name.clone(), msg: format!("expected shape [{}], got {:?}", want.join(", "), shape) });
        }
    }
    Ok(())
}

/// Runs a node on the host over constant inputs, unless its outputs hold more than `limit`
/// elements (huge constant computations are left to run time: plan/attention_masks.rs).
fn fold(node: &crate::ir::Node, ins: &[Option<InferIn>], outs: &[TypeOut], limit: usize, ctx: &mut CpuCtx) -> Result<Option<Vec<Tensor>>> {
    let Some(k) = cpu::kernel(&node.op_type) else {
        return Ok(None);
    };
    let total: usize = outs.iter().map(|o| o.shape.iter().product::<usize>()).sum();
    if total > limit {
        return Ok(None);
    }
    let mut results: Vec<Tensor> = outs.iter().take(node.outputs.len()).map(|o| Tensor::zeros(o.dtype, o.shape.clone())).collect();
    // a type-only input (Shape/Size of a runtime value, CastLike's target) gets a view with no
    // data behind it
    let views: Vec<Option<In>> = ins
        .iter()
        .map(|i| {
            i.map(|i| match i.value {
                Some(t) => In::of(t),
                // SAFETY: constant-free inputs here are type-only reads (ops::reads_type_only):
                // their kernels read dtype and shape, never the data.
                None => unsafe { In::from_raw(i.dtype, i.shape, std::ptr::NonNull::<u64>::dangling().as_ptr() as *const u8) },
            })
        })
        .collect();
    {
        let shapes: Vec<Vec<usize>> = results.iter().map(|t| t.shape.clone()).collect();
        let mut out_views: Vec<Out> = results
            .iter_mut()
            .zip(&shapes)
            .map(|(t, shape)| {
                let dtype = t.dtype();
                let ptr = t.as_bytes_mut().as_mut_ptr();
                // SAFETY: each result tensor is uniquely borrowed for the views' lifetime and its
                // buffer holds exactly numel(shape) elements of its dtype.
                unsafe { Out::from_raw(dtype, shape, ptr) }
            })
            .collect();
        cpu::widen::call(k, node, &views, &mut out_views, ctx)?;
    }
    Ok(Some(results))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, Dim};
    use crate::tensor::Data;

    /// x (input) → Relu → u (forward, read by the loss too); backward: gu = Mul(u, seed), a
    /// bound gradient; a second forward value v = Relu(x) is also read after its Mul (by an Add).
    fn graph() -> (Graph, ValueId, ValueId, ValueId, ValueId, ValueId) {
        let mut g = Graph::default();
        let shape = Some(vec![Dim::Known(4), Dim::Known(8)]);
        let x = g.add_value("x", ValueKind::Input, Some(DType::F32), shape);
        let u = g.add_node("u", "Relu", vec![Some(x)], Attrs::default(), 1)[0];
        let v = g.add_node("v", "Relu", vec![Some(x)], Attrs::default(), 1)[0];
        let loss = g.add_node("loss", "ReduceSum", vec![Some(u)], Attrs::default(), 1)[0];
        let seed = g.add_value("grad:loss", ValueKind::Input, Some(DType::F32), Some(vec![]));
        let gu = g.add_node("gu", "Mul", vec![Some(u), Some(seed)], Attrs::default(), 1)[0];
        let gv = g.add_node("gv", "Mul", vec![Some(v), Some(seed)], Attrs::default(), 1)[0];
        let gw = g.add_node("gw", "Add", vec![Some(gv), Some(v)], Attrs::default(), 1)[0];
        (g, x, loss, seed, gu, gw)
    }

    fn request(g: &Graph, x: ValueId, loss: ValueId, seed: ValueId, grads: &[ValueId], early: bool) -> Plan {
        let req = PlanRequest {
            graph: g,
            n_fwd: 3,
            forward_outputs: vec![loss],
            backward_outputs: grads.to_vec(),
            bound_outputs: grads.to_vec(),
            input_types: [(x, (DType::F32, vec![4, 8]))].into_iter().collect(),
            seeds: vec![(seed, loss)],
            bound_from_forward: if early { grads.to_vec() } else { vec![] },
        };
        build(&req).expect("plan")
    }

    #[test]
    fn a_scaled_forward_value_lives_in_its_gradient_memory() {
        let (g, x, loss, seed, gu, gw) = graph();
        let plain = request(&g, x, loss, seed, &[gu, gw], false);
        let early = request(&g, x, loss, seed, &[gu, gw], true);
        assert!(plain.in_place.is_empty());
        assert_eq!(early.in_place.len(), 1, "only gu = Mul(u, seed) qualifies (v is read after its Mul)");
        let u = g.nodes[0].outputs[0];
        assert!(matches!(early.storage[u.0], Storage::Alias(a) if a == gu));
        assert!(matches!(plain.storage[u.0], Storage::Arena(_)));
        assert!(early.arena_bytes < plain.arena_bytes, "u left the arena: {} vs {}", early.arena_bytes, plain.arena_bytes);
        let step = early.in_place[0];
        assert_eq!(g.nodes[early.steps[step].0].outputs[0], gu);
    }

    /// Hugging Face's mask from positions (LessOrEqual of [B,1,1,T] and [B,1,T,1] constants,
    /// then Where to 0 / -inf), over the general fold limit, read by an Attention (or by an Add).
    fn masked_attention(b: usize, t: usize, reader: &str) -> (Graph, ValueId, ValueId) {
        let mut g = Graph::default();
        let pos = |shape: Vec<usize>| Tensor::from_i64(shape, (0..b * t).map(|i| (i % t) as i64).collect());
        let keys = g.add_const("keys", pos(vec![b, 1, 1, t]));
        let queries = g.add_const("queries", pos(vec![b, 1, t, 1]));
        let zero = g.add_const("zero", Tensor::scalar_f32(0.0));
        let ninf = g.add_const("ninf", Tensor::scalar_f32(f32::NEG_INFINITY));
        let dims = |v: &[usize]| Some(v.iter().map(|&d| Dim::Known(d)).collect());
        let q = g.add_value("q", ValueKind::Input, Some(DType::F32), dims(&[b, 1, t, 8]));
        let kt = g.add_value("kt", ValueKind::Input, Some(DType::F32), dims(&[b, 1, 8, t]));
        let le = g.add_node("le", "LessOrEqual", vec![Some(keys), Some(queries)], Attrs::default(), 1)[0];
        let mask = g.add_node("mask", "Where", vec![Some(le), Some(zero), Some(ninf)], Attrs::default(), 1)[0];
        let out = if reader == "Attention" {
            g.add_node("attn", "Attention", vec![Some(q), Some(kt), Some(q), Some(mask)], Attrs::default(), 2)[0]
        } else {
            let scores = g.add_node("scores", "MatMul", vec![Some(q), Some(kt)], Attrs::default(), 1)[0];
            g.add_node("add", "Add", vec![Some(scores), Some(mask)], Attrs::default(), 1)[0]
        };
        (g, mask, out)
    }

    #[test]
    fn a_large_constant_mask_is_folded_when_only_attention_reads_it() {
        // 5 x 1024 x 1024 elements: over the general limit of 2^22
        let (b, t) = (5, 1024);
        for reader in ["Attention", "Add"] {
            let (g, mask, out) = masked_attention(b, t, reader);
            let types = [("q", vec![b, 1, t, 8]), ("kt", vec![b, 1, 8, t])];
            let req = PlanRequest {
                graph: &g,
                n_fwd: g.nodes.len(),
                forward_outputs: vec![out],
                backward_outputs: vec![],
                bound_outputs: vec![],
                input_types: types.iter().map(|(n, s)| (g.find(n).expect("input"), (DType::F32, s.clone()))).collect(),
                seeds: vec![],
                bound_from_forward: vec![],
            };
            let plan = build(&req).expect("plan");
            let ran: Vec<&str> = plan.steps.iter().map(|s| g.nodes[s.0].op_type.as_str()).collect();
            if reader == "Attention" {
                assert_eq!(ran, ["Attention"], "the mask's nodes were folded");
                let Storage::Const(m) = &plan.storage[mask.0] else { panic!("the mask is not a constant: {:?}", plan.storage[mask.0]) };
                let Data::F32(v) = &m.data else { panic!("an f32 mask") };
                assert_eq!(v.len(), b * t * t);
                // row 3 of the last matrix: keys 0..=3 visible, 4 hidden
                let row = (b * t + 3 - t) * t;
                assert_eq!((v[row + 3], v[row + 4]), (0.0, f32::NEG_INFINITY));
            } else {
                assert_eq!(ran, ["LessOrEqual", "Where", "MatMul", "Add"], "a mask read by an Add keeps the general limit");
            }
        }
    }
}
