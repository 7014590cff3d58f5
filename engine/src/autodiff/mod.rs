//! The gradient graph builder: a reverse sweep over the forward nodes that calls each op's
//! gradient rule (rules add graph nodes, never compute values), sums the gradients of fan-out
//! values, and stops at values that do not depend on the requested inputs.

use std::collections::HashSet;

use crate::error::{Error, Result};
use crate::ir::{Attr, Attrs, Graph, Node, NodeId, ValueId, ValueKind};
use crate::ops;

/// What a gradient rule sees and builds with.
pub struct GradCtx<'g> {
    graph: &'g mut Graph,
    node: NodeId,
    dys: Vec<Option<ValueId>>,
    wants: Vec<bool>,
    dxs: Vec<Option<ValueId>>,
    counter: usize,
}

impl<'g> GradCtx<'g> {
    fn node(&self) -> &Node {
        &self.graph.nodes[self.node.0]
    }
    /// Forward input `i`.
    pub fn x(&self, i: usize) -> Result<ValueId> {
        self.node().req_input(i)
    }
    /// Optional forward input `i`.
    pub fn x_opt(&self, i: usize) -> Option<ValueId> {
        self.node().input(i)
    }
    /// Forward output `i`.
    pub fn y(&self, i: usize) -> ValueId {
        self.graph.nodes[self.node.0].outputs[i]
    }
    /// Gradient of output `i`, if anything downstream needs it.
    pub fn dy(&self, i: usize) -> Option<ValueId> {
        self.dys.get(i).copied().flatten()
    }
    /// Whether input `i` needs a gradient.
    pub fn wants(&self, i: usize) -> bool {
        self.wants.get(i).copied().unwrap_or(false)
    }
    /// Records the gradient of input `i` (ignored where it is not wanted).
    pub fn set(&mut self, i: usize, dx: ValueId) {
        if self.wants(i) {
            self.dxs[i] = Some(dx);
        }
    }
    /// Adds a one-output node.
    pub fn op(&mut self, op_type: &str, inputs: &[ValueId], attrs: Attrs) -> ValueId {
        self.op_n(op_type, inputs.iter().map(|&v| Some(v)).collect(), attrs, 1)[0]
    }
    pub fn op_n(&mut self, op_type: &str, inputs: Vec<Option<ValueId>>, attrs: Attrs, n: usize) -> Vec<ValueId> {
        self.counter += 1;
        let name = format!("{}/grad/{}{}", self.node().name, op_type, self.counter);
        self.graph.add_node(&name, op_type, inputs, attrs, n)
    }
    pub fn shape_of(&mut self, v: ValueId) -> ValueId {
        self.op("Shape", &[v], Attrs::default())
    }
    /// Sums `dy` over broadcast axes so that it has the shape of `like`.
    pub fn sum_to(&mut self, dy: ValueId, like: ValueId) -> ValueId {
        let s = self.shape_of(like);
        self.op("ReduceSumTo", &[dy, s], Attrs::default())
    }
    /// `alpha * v + beta`, in v's dtype.
    pub fn affine(&mut self, v: ValueId, alpha: f32, beta: f32) -> ValueId {
        self.op("Affine", &[v], Attrs::default().with("alpha", Attr::Float(alpha)).with("beta", Attr::Float(beta)))
    }
    pub fn attrs(&self) -> &Attrs {
        &self.node().attrs
    }
}

/// Result of building gradients.
pub struct Gradients {
    /// Gradient value of each requested `wrt` value (None: it does not affect the outputs).
    pub grads: Vec<Option<ValueId>>,
    /// Index of the first gradient node in `graph.nodes`.
    pub first_backward_node: usize,
}

/// Appends to `graph` the nodes computing d(outputs)/d(wrt), given one gradient seed value per
/// output (`seeds[k]` is the gradient flowing into `outputs[k]`; None for an output without one).
pub fn build(graph: &mut Graph, outputs: &[ValueId], seeds: &[Option<ValueId>], wrt: &[ValueId]) -> Result<Gradients> {
    let n_fwd = graph.nodes.len();
    // values that depend on a wrt value through differentiable inputs
    let mut depends: HashSet<ValueId> = wrt.iter().copied().collect();
    for node in &graph.nodes[..n_fwd] {
        let op = ops::lookup(&node.op_type);
        let nd = op.map(|o| o.non_differentiable_inputs()).unwrap_or(&[]);
        let hit = node.inputs.iter().enumerate().any(|(i, v)| !nd.contains(&i) && v.is_some_and(|v| depends.contains(&v)));
        if hit {
            depends.extend(node.outputs.iter().copied());
        }
    }
    let mut contrib: Vec<Vec<ValueId>> = vec![Vec::new(); graph.values.len()];
    for (&o, s) in outputs.iter().zip(seeds) {
        if let Some(s) = s {
            if depends.contains(&o) {
                contrib[o.0].push(*s);
            }
        }
    }
    for n in (0..n_fwd).rev() {
        let node = graph.nodes[n].clone();
        if !node.outputs.iter().any(|o| !contrib[o.0].is_empty()) {
            continue;
        }
        let op = ops::lookup(&node.op_type).ok_or_else(|| Error::Unsupported {
            op_type: node.op_type.clone(),
            node: node.name.clone(),
            msg: "unknown op".into(),
        })?;
        let nd = op.non_differentiable_inputs();
        let wants: Vec<bool> =
            node.inputs.iter().enumerate().map(|(i, v)| !nd.contains(&i) && v.is_some_and(|v| depends.contains(&v))).collect();
        if !wants.iter().any(|&w| w) {
            continue;
        }
        let rule = op.gradient().ok_or_else(|| Error::NoGradient { op_type: node.op_type.clone(), node: node.name.clone() })?;
        let dys: Vec<Option<ValueId>> = node.outputs.iter().map(|o| sum_contributions(graph, &mut contrib, *o)).collect();
        let mut ctx = GradCtx { graph, node: NodeId(n), dys, wants: wants.clone(), dxs: vec![None; node.inputs.len()], counter: 0 };
        rule(&node, &mut ctx)?;
        let dxs = ctx.dxs;
        contrib.resize(graph.values.len(), Vec::new());
        for (i, dx) in dxs.into_iter().enumerate() {
            if let (Some(dx), Some(x)) = (dx, node.input(i)) {
                contrib[x.0].push(dx);
            }
        }
    }
    let grads = wrt.iter().map(|&w| sum_contributions(graph, &mut contrib, w)).collect::<Vec<_>>();
    // every gradient must be computed by a backward node, so that callers can bind its storage
    let grads = grads
        .into_iter()
        .map(|g| {
            g.map(|g| match graph.value(g).producer {
                Some(p) if p.0 >= n_fwd => g,
                _ => {
                    let name = format!("{}/grad_copy", graph.value(g).name);
                    graph.add_node(&name, "Identity", vec![Some(g)], Attrs::default(), 1)[0]
                }
            })
        })
        .collect();
    // every computed value a node reads has a producer (values of nodes a graph pass dropped
    // are read by none)
    debug_assert!(graph
        .nodes
        .iter()
        .flat_map(|n| n.inputs.iter().flatten())
        .all(|&v| graph.value(v).kind != ValueKind::Computed || graph.value(v).producer.is_some()));
    Ok(Gradients { grads, first_backward_node: n_fwd })
}

/// Whether `node` is one of the Adds that sum a value's gradient contributions (below): both
/// operands have that value's shape and type, by every gradient rule's contract.
pub fn is_gradient_sum(node: &Node) -> bool {
    node.op_type == "Add" && node.name.rsplit_once("/grad_sum").is_some_and(|(_, k)| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
}

fn sum_contributions(graph: &mut Graph, contrib: &mut Vec<Vec<ValueId>>, v: ValueId) -> Option<ValueId> {
    contrib.resize(graph.values.len(), Vec::new());
    let parts = std::mem::take(&mut contrib[v.0]);
    let mut it = parts.into_iter();
    let first = it.next()?;
    let mut acc = first;
    for (k, p) in it.enumerate() {
        let name = format!("{}/grad_sum{k}", graph.value(v).name);
        acc = graph.add_node(&name, "Add", vec![Some(acc), Some(p)], Attrs::default(), 1)[0];
    }
    contrib[v.0] = vec![acc];
    Some(acc)
}
