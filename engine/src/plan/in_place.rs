//! Which steps of a plan write memory they also read, decided once the steps, types and
//! constants are known. Both cases keep LinearCrossEntropy's weight gradient (made in the
//! forward phase with a unit seed) out of the arena by writing it straight into the gradient
//! memory the caller binds from the forward phase on (`PlanRequest::bound_from_forward`):
//! - scaled: `gv = Mul(u, s)`: u lives in gv's memory, the Mul scales it in place;
//! - summed (a weight read twice, e.g. GPT-2's tied embedding and LM head): `gv = Add(m, b)` with
//!   `m = Mul(u, s)` as above: u and m live in gv's memory, the Mul scales in place and the Add
//!   adds b in place (the same floating-point addition: bitwise equal). Where b is the
//!   embedding's GatherGrad, b lives there too: its rows are added onto the scaled term and the
//!   Add has nothing left to do (no dense [vocab, hidden] buffer, no zero fill, no Add pass).
//!
//! The in-place kernels (backend/cpu/in_place.rs) never view the operand that lives in their
//! output's memory.

use std::sync::Arc;

use super::{is_bound, PlanRequest};
use crate::backend::cpu::{self, Kernel};
use crate::ir::{NodeId, ValueId};
use crate::ops::TypeOut;
use crate::tensor::{DType, Tensor};

/// What the in-place decisions read: the request and the plan so far.
struct Steps<'a> {
    req: &'a PlanRequest<'a>,
    steps: &'a [NodeId],
    split: usize,
    types: &'a [Option<TypeOut>],
    consts: &'a [Option<Arc<Tensor>>],
}

/// Applies every in-place rewrite to `alias` and `kernels`; returns the rewritten steps.
pub(super) fn apply(
    req: &PlanRequest,
    steps: &[NodeId],
    split: usize,
    types: &[Option<TypeOut>],
    consts: &[Option<Arc<Tensor>>],
    alias: &mut [Option<ValueId>],
    kernels: &mut [Kernel],
) -> Vec<usize> {
    let p = Steps { req, steps, split, types, consts };
    let mut in_place = Vec::new();
    for &gv in &req.bound_from_forward {
        if let Some((i, u)) = p.scaled(alias, gv) {
            alias[u.0] = Some(gv);
            kernels[i] = cpu::mul_scalar_in_place;
            in_place.push(i);
        } else if let Some(s) = p.summed(alias, gv) {
            alias[s.u.0] = Some(gv);
            alias[s.m.0] = Some(gv);
            kernels[s.mul_step] = cpu::mul_scalar_in_place;
            in_place.extend([s.mul_step, s.add_step]);
            if let Some((gather_step, b)) = s.gather {
                alias[b.0] = Some(gv);
                kernels[gather_step] = cpu::gather_grad_accumulate;
                kernels[s.add_step] = cpu::sum_already_in_place;
                in_place.push(gather_step);
            } else {
                kernels[s.add_step] = if s.m_first { cpu::add_in_place_first } else { cpu::add_in_place_second };
            }
        }
    }
    in_place.sort_unstable();
    in_place
}

/// `gv = Add(m, b)` (either order) where `m = Mul(u, s)` qualifies for `Steps::scaled` with m
/// in gv's place.
struct Summed {
    u: ValueId,
    m: ValueId,
    mul_step: usize,
    add_step: usize,
    /// m is the Add's first operand.
    m_first: bool,
    /// (step, b) where b is a GatherGrad that can add its rows into gv's memory after the Mul.
    gather: Option<(usize, ValueId)>,
}

impl Steps<'_> {
    /// (step, node) of v's producer, when it is a planned step with one output.
    fn producer(&self, v: ValueId, op: &str) -> Option<(usize, &crate::ir::Node)> {
        let g = self.req.graph;
        let producer = g.values[v.0].producer?;
        let i = self.steps.iter().position(|s| *s == producer)?;
        let node = &g.nodes[producer.0];
        (node.op_type == op && node.outputs.len() == 1).then_some((i, node))
    }

    fn readers(&self, v: ValueId) -> impl Iterator<Item = usize> + '_ {
        let g = self.req.graph;
        self.steps.iter().enumerate().filter(move |(_, st)| g.nodes[st.0].inputs.iter().flatten().any(|x| *x == v)).map(|(k, _)| k)
    }

    /// v lives in its own memory, nothing shares it, and the caller neither binds nor reads it.
    fn private(&self, alias: &[Option<ValueId>], v: ValueId) -> bool {
        let r = self.req;
        alias[v.0].is_none()
            && !alias.contains(&Some(v))
            && !is_bound(r, v)
            && !r.forward_outputs.contains(&v)
            && !r.backward_outputs.contains(&v)
    }

    /// For a gradient `gv` bound from the forward phase on (or an operand about to live there):
    /// (its step, u) where `gv = Mul(u, s)` runs in the backward phase, `u` is computed by a
    /// forward step, has gv's type (f32 or f64), is private and read by no step after that one,
    /// and `s` is a scalar; then u can live in gv's memory and the Mul scale it in place.
    fn scaled(&self, alias: &[Option<ValueId>], gv: ValueId) -> Option<(usize, ValueId)> {
        let (i, node) = self.producer(gv, "Mul")?;
        if i < self.split || node.inputs.len() != 2 || alias[gv.0].is_some() {
            return None;
        }
        let (u, s) = (node.inputs[0]?, node.inputs[1]?);
        let up = self.req.graph.values[u.0].producer?;
        if u == s || !self.steps[..self.split].contains(&up) || self.consts[u.0].is_some() || self.consts[s.0].is_some() {
            return None;
        }
        if !self.private(alias, u) {
            return None;
        }
        let types = self.types;
        let (tu, tg, ts) = (types[u.0].as_ref()?, types[gv.0].as_ref()?, types[s.0].as_ref()?);
        let float = matches!(tg.dtype, DType::F32 | DType::F64);
        if !float || tu.dtype != tg.dtype || tu.shape != tg.shape || ts.dtype != tg.dtype || ts.shape.iter().product::<usize>() != 1 {
            return None;
        }
        // every other reader of u runs before the Mul (forward steps), when u is not scaled yet
        let late_reader = self.readers(u).any(|k| k > i);
        (!late_reader).then_some((i, u))
    }

    /// For a gradient `gv` bound from the forward phase on: `gv = Add(m, b)` runs in the
    /// backward phase, m, b and gv have one type (no broadcasting), `m = Mul(u, s)` qualifies
    /// for `scaled` (with m as the target), m is private and read by the Add only, b is neither
    /// m nor u nor in gv's memory, and nothing else lives in gv's memory. b may move into gv's
    /// memory too where `gathered_after` allows.
    fn summed(&self, alias: &[Option<ValueId>], gv: ValueId) -> Option<Summed> {
        let (add_step, node) = self.producer(gv, "Add")?;
        if add_step < self.split || node.inputs.len() != 2 || alias[gv.0].is_some() || alias.contains(&Some(gv)) {
            return None;
        }
        let (a, b) = (node.inputs[0]?, node.inputs[1]?);
        let tg = self.types[gv.0].as_ref()?;
        let same = |v: ValueId| self.types[v.0].as_ref().is_some_and(|t| t.dtype == tg.dtype && t.shape == tg.shape);
        if a == b || !same(a) || !same(b) || self.consts[a.0].is_some() || self.consts[b.0].is_some() {
            return None;
        }
        let pick = |m: ValueId, other: ValueId, m_first: bool| -> Option<Summed> {
            if !self.private(alias, m) || alias[other.0] == Some(gv) || self.readers(m).count() != 1 {
                return None;
            }
            let (mul_step, u) = self.scaled(alias, m)?;
            let gather = self.gathered_after(alias, other, mul_step, add_step).map(|i| (i, other));
            (mul_step < add_step && other != u).then_some(Summed { u, m, mul_step, add_step, m_first, gather })
        };
        pick(a, b, true).or_else(|| pick(b, a, false))
    }

    /// The step of b when b is a GatherGrad that runs after the Mul (so it adds to the scaled
    /// term) and before the Add, is private and read by the Add only: then it can add its rows
    /// into gv's memory. Repeated indices then sum onto the other term one by one instead of
    /// among themselves first: a different rounding, not a different result.
    fn gathered_after(&self, alias: &[Option<ValueId>], b: ValueId, mul_step: usize, add_step: usize) -> Option<usize> {
        let (i, _) = self.producer(b, "GatherGrad")?;
        let ok = i > mul_step && i < add_step && self.private(alias, b) && self.readers(b).count() == 1;
        ok.then_some(i)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{build, Storage};
    use super::*;
    use crate::ir::{Attrs, Dim, Graph, ValueKind};

    /// x → u = Relu(x), w = Sigmoid(x), loss = ReduceSum(u) (forward); backward: m = Mul(u, seed),
    /// gv = Add(w, m) or Add(m, w): a weight's two gradient contributions summed. With
    /// `m_read_twice`, a second bound gradient Neg(m) reads m too.
    fn plan(m_first: bool, early: bool, m_read_twice: bool) -> (Graph, super::super::Plan, [ValueId; 4]) {
        let mut g = Graph::default();
        let shape = Some(vec![Dim::Known(4), Dim::Known(8)]);
        let x = g.add_value("x", ValueKind::Input, Some(DType::F32), shape);
        let u = g.add_node("u", "Relu", vec![Some(x)], Attrs::default(), 1)[0];
        let w = g.add_node("w", "Sigmoid", vec![Some(x)], Attrs::default(), 1)[0];
        let loss = g.add_node("loss", "ReduceSum", vec![Some(u)], Attrs::default(), 1)[0];
        let seed = g.add_value("grad:loss", ValueKind::Input, Some(DType::F32), Some(vec![]));
        let m = g.add_node("m", "Mul", vec![Some(u), Some(seed)], Attrs::default(), 1)[0];
        let ins = if m_first { vec![Some(m), Some(w)] } else { vec![Some(w), Some(m)] };
        let gv = g.add_node("gv", "Add", ins, Attrs::default(), 1)[0];
        let mut grads = vec![gv];
        if m_read_twice {
            grads.push(g.add_node("other", "Neg", vec![Some(m)], Attrs::default(), 1)[0]);
        }
        let req = PlanRequest {
            graph: &g,
            n_fwd: 3,
            forward_outputs: vec![loss],
            backward_outputs: grads.clone(),
            bound_outputs: grads.clone(),
            input_types: [(x, (DType::F32, vec![4, 8]))].into_iter().collect(),
            seeds: vec![(seed, loss)],
            bound_from_forward: if early { grads.clone() } else { vec![] },
        };
        let p = build(&req).expect("plan");
        (g, p, [u, w, m, gv])
    }

    #[test]
    fn a_summed_gradient_keeps_both_terms_in_its_own_memory() {
        for m_first in [true, false] {
            let (g, plain, _) = plan(m_first, false, false);
            let (_, early, [u, w, m, gv]) = plan(m_first, true, false);
            assert!(plain.in_place.is_empty());
            assert_eq!(early.in_place.len(), 2, "the Mul and the Add run in place");
            assert!(matches!(early.storage[u.0], Storage::Alias(a) if a == gv));
            assert!(matches!(early.storage[m.0], Storage::Alias(a) if a == gv));
            assert!(matches!(early.storage[w.0], Storage::Arena(_)), "the other term stays where it was");
            assert!(early.arena_bytes < plain.arena_bytes, "{} vs {}", early.arena_bytes, plain.arena_bytes);
            let add = early.in_place[1];
            assert_eq!(g.nodes[early.steps[add].0].outputs[0], gv);
            let expected: Kernel = if m_first { cpu::add_in_place_first } else { cpu::add_in_place_second };
            assert!(early.kernels[add] as usize == expected as usize);
        }
    }

    #[test]
    fn a_term_read_by_another_step_is_not_moved() {
        let (_, early, [u, _, m, _]) = plan(true, true, true);
        assert!(early.in_place.is_empty());
        assert!(matches!(early.storage[u.0], Storage::Arena(_)));
        assert!(matches!(early.storage[m.0], Storage::Arena(_)));
    }

    /// x → u = Relu(x), loss = ReduceSum(u) (forward); backward: m = Mul(u, seed) and
    /// b = GatherGrad(Neg(z), ids) in the given order, gv = Add(m, b).
    fn gathered(mul_first: bool) -> (Graph, super::super::Plan, [ValueId; 3]) {
        let mut g = Graph::default();
        let x = g.add_value("x", ValueKind::Input, Some(DType::F32), Some(vec![Dim::Known(4), Dim::Known(8)]));
        let z = g.add_value("z", ValueKind::Input, Some(DType::F32), Some(vec![Dim::Known(6), Dim::Known(8)]));
        let ids = g.add_value("ids", ValueKind::Input, Some(DType::I64), Some(vec![Dim::Known(6)]));
        let shape = g.add_const("shape", Tensor::from_i64(vec![2], vec![4, 8]));
        let u = g.add_node("u", "Relu", vec![Some(x)], Attrs::default(), 1)[0];
        let loss = g.add_node("loss", "ReduceSum", vec![Some(u)], Attrs::default(), 1)[0];
        let seed = g.add_value("grad:loss", ValueKind::Input, Some(DType::F32), Some(vec![]));
        let mul = |g: &mut Graph| g.add_node("m", "Mul", vec![Some(u), Some(seed)], Attrs::default(), 1)[0];
        let gather = |g: &mut Graph| {
            let dz = g.add_node("dz", "Neg", vec![Some(z)], Attrs::default(), 1)[0];
            g.add_node("b", "GatherGrad", vec![Some(dz), Some(ids), Some(shape)], Attrs::default(), 1)[0]
        };
        let (m, b) = if mul_first {
            let m = mul(&mut g);
            (m, gather(&mut g))
        } else {
            let b = gather(&mut g);
            (mul(&mut g), b)
        };
        let gv = g.add_node("gv", "Add", vec![Some(m), Some(b)], Attrs::default(), 1)[0];
        let req = PlanRequest {
            graph: &g,
            n_fwd: 2,
            forward_outputs: vec![loss],
            backward_outputs: vec![gv],
            bound_outputs: vec![gv],
            input_types: [(x, (DType::F32, vec![4, 8])), (z, (DType::F32, vec![6, 8])), (ids, (DType::I64, vec![6]))].into_iter().collect(),
            seeds: vec![(seed, loss)],
            bound_from_forward: vec![gv],
        };
        let p = build(&req).expect("plan");
        (g, p, [m, b, gv])
    }

    #[test]
    fn an_embedding_gradient_adds_its_rows_into_the_summed_gradient() {
        let (g, p, [m, b, gv]) = gathered(true);
        assert_eq!(p.in_place.len(), 3, "Mul, GatherGrad and Add");
        assert!(matches!(p.storage[m.0], Storage::Alias(a) if a == gv));
        assert!(matches!(p.storage[b.0], Storage::Alias(a) if a == gv));
        let step_of = |v: ValueId| p.steps.iter().position(|s| g.nodes[s.0].outputs[0] == v).expect("step");
        assert!(p.kernels[step_of(b)] as usize == cpu::gather_grad_accumulate as Kernel as usize);
        // the Add has nothing left to do (an empty kernel: compared by what it is not, since
        // release builds may fold identical empty functions into one address)
        let add = p.kernels[step_of(gv)] as usize;
        let adds: [Kernel; 3] = [cpu::add_in_place_first, cpu::add_in_place_second, cpu::kernel("Add").expect("Add")];
        assert!(adds.iter().all(|k| *k as usize != add), "the Add still adds");
        assert!(p.in_place.contains(&step_of(gv)));
    }

    #[test]
    fn an_embedding_gradient_made_before_the_scaling_stays_apart() {
        let (g, p, [m, b, gv]) = gathered(false);
        let step_of = |v: ValueId| p.steps.iter().position(|s| g.nodes[s.0].outputs[0] == v).expect("step");
        assert!(step_of(b) < step_of(m), "the steps keep the graph's order");
        assert_eq!(p.in_place.len(), 2, "Mul and Add only");
        assert!(matches!(p.storage[b.0], Storage::Arena(_)));
        assert!(p.kernels[step_of(gv)] as usize == cpu::add_in_place_first as Kernel as usize);
    }
}
