//! fuse_gelu_tanh: the tanh approximation of GELU written out, as GPT-2's `NewGELUActivation`
//! exports it, `Mul(Mul(x, 0.5), Add(Tanh(Mul(Add(x, Mul(Pow(x, 3), 0.044715)), √(2/π))), 1))`
//! (each Mul and Add in either operand order), becomes one `Gelu(x, approximate="tanh")`: one
//! pass over x forward and one backward instead of eight elementwise ops and their gradients.
//! Only where every intermediate has no other reader and the constants are those of the
//! formula.

use super::{scalar_const, sole_producer};
use crate::error::Result;
use crate::ir::{Attr, Attrs, Graph, Node, NodeId, ValueId};

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

/// Whether `v` is a one-element constant equal to `want` (to f32 rounding).
fn is_const(graph: &Graph, v: ValueId, want: f64) -> bool {
    scalar_const(graph, v).is_some_and(|c| (c - want).abs() <= 1e-6 * want.abs().max(1.0))
}

/// The other operand of a binary `node` whose one operand is the constant `c`.
fn with_const(graph: &Graph, node: &Node, c: f64) -> Option<ValueId> {
    let (a, b) = (node.input(0)?, node.input(1)?);
    if is_const(graph, b, c) {
        Some(a)
    } else if is_const(graph, a, c) {
        Some(b)
    } else {
        None
    }
}

/// x of `x + 0.044715·x³` (Add and Mul in either order, x³ as Pow(x, 3)).
fn cubic_of(graph: &Graph, consumers: &[Vec<(NodeId, usize)>], v: ValueId) -> Option<ValueId> {
    let add = sole_producer(graph, consumers, v, "Add")?;
    let (a, b) = (add.input(0)?, add.input(1)?);
    for (x, term) in [(a, b), (b, a)] {
        let Some(mul) = sole_producer(graph, consumers, term, "Mul") else { continue };
        let Some(cube) = with_const(graph, mul, 0.044715) else { continue };
        let Some(pow) = sole_producer(graph, consumers, cube, "Pow") else { continue };
        if pow.input(0) == Some(x) && pow.input(1).is_some_and(|e| is_const(graph, e, 3.0)) {
            return Some(x);
        }
    }
    None
}

/// x of `1 + tanh(√(2/π)·(x + 0.044715·x³))`.
fn one_plus_tanh_of(graph: &Graph, consumers: &[Vec<(NodeId, usize)>], v: ValueId) -> Option<ValueId> {
    let add = sole_producer(graph, consumers, v, "Add")?;
    let t = with_const(graph, add, 1.0)?;
    let tanh = sole_producer(graph, consumers, t, "Tanh")?;
    let scaled = sole_producer(graph, consumers, tanh.input(0)?, "Mul")?;
    cubic_of(graph, consumers, with_const(graph, scaled, SQRT_2_OVER_PI)?)
}

/// x of the Mul `node` if it is the whole formula.
fn gelu_input(graph: &Graph, consumers: &[Vec<(NodeId, usize)>], node: &Node) -> Option<ValueId> {
    let (a, b) = (node.input(0)?, node.input(1)?);
    for (half, rest) in [(a, b), (b, a)] {
        let Some(h) = sole_producer(graph, consumers, half, "Mul") else { continue };
        let Some(x) = with_const(graph, h, 0.5) else { continue };
        if one_plus_tanh_of(graph, consumers, rest) == Some(x) {
            return Some(x);
        }
    }
    None
}

pub fn run(graph: &mut Graph) -> Result<usize> {
    let consumers = graph.consumers();
    let mut rewrites = 0;
    for n in 0..graph.nodes.len() {
        if graph.nodes[n].op_type != "Mul" {
            continue;
        }
        let Some(x) = gelu_input(graph, &consumers, &graph.nodes[n]) else { continue };
        let node = &graph.nodes[n];
        let attrs = Attrs::default().with("approximate", Attr::String("tanh".into()));
        graph.nodes[n] =
            Node { name: node.name.clone(), op_type: "Gelu".into(), inputs: vec![Some(x)], outputs: node.outputs.clone(), attrs };
        rewrites += 1;
    }
    Ok(rewrites)
}
