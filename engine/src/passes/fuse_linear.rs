//! fuse_linear: MatMul(X, Transpose(W)) [+ b] and MatMul(X, W) [+ b], W 2-D and b 1-D of known
//! shapes, become one Linear(X, W, b) (ops/linear.rs). The exporters write nn.Linear on 3-D
//! inputs this way; fused, the weight is read in place (no transposed copy per step, and none of
//! its gradient either) and the bias is added inside the matmul.

use crate::error::Result;
use crate::ir::{Attr, Attrs, Dim, Graph, Node, ValueId, ValueKind};

/// A value's shape if it is fully known without running anything (weights, constants).
pub(super) fn static_shape(graph: &Graph, v: ValueId) -> Option<Vec<usize>> {
    let val = graph.value(v);
    match &val.kind {
        ValueKind::Const(t) => Some(t.shape.clone()),
        ValueKind::Weight => val.shape.as_ref()?.iter().map(|d| if let Dim::Known(k) = d { Some(*k) } else { None }).collect(),
        _ => None,
    }
}

/// The weight W and transB of a MatMul's second operand: Transpose(W) with W 2-D, or W 2-D.
fn weight_of(graph: &Graph, b: ValueId) -> Option<(ValueId, bool, [usize; 2])> {
    if let Some(p) = graph.value(b).producer {
        let t = &graph.nodes[p.0];
        if t.op_type != "Transpose" {
            return None;
        }
        let w = t.input(0)?;
        let s = static_shape(graph, w)?;
        let perm = t.attrs.ints("perm").ok().flatten();
        let swaps = perm.as_deref().is_none_or(|p| p == [1, 0]);
        return (s.len() == 2 && swaps).then_some((w, true, [s[0], s[1]]));
    }
    let s = static_shape(graph, b)?;
    (s.len() == 2).then_some((b, false, [s[0], s[1]]))
}

pub fn run(graph: &mut Graph) -> Result<usize> {
    let consumers = graph.consumers();
    let mut rewrites = 0;
    for m in 0..graph.nodes.len() {
        let node = &graph.nodes[m];
        if node.op_type != "MatMul" {
            continue;
        }
        let (Some(x), Some(b)) = (node.input(0), node.input(1)) else { continue };
        let Some((w, trans_b, ws)) = weight_of(graph, b) else { continue };
        let n = if trans_b { ws[0] } else { ws[1] };
        let y = node.outputs[0];
        // a bias: Y's only consumer is Add(Y, b) or Add(b, Y) with b of shape [N]
        let bias_add = match consumers[y.0].as_slice() {
            [(a, _)] if !graph.outputs.contains(&y) && graph.nodes[a.0].op_type == "Add" => {
                let add = &graph.nodes[a.0];
                let other = if add.input(0) == Some(y) { add.input(1) } else { add.input(0) };
                other.filter(|&c| c != y && static_shape(graph, c).is_some_and(|s| s == [n])).map(|c| (*a, c))
            }
            _ => None,
        };
        let attrs = Attrs::default().with("transB", Attr::Int(trans_b as i64));
        let name = node.name.clone();
        match bias_add {
            Some((a, bias)) => {
                let outputs = graph.nodes[a.0].outputs.clone();
                graph.nodes[a.0] = Node { name, op_type: "Linear".into(), inputs: vec![Some(x), Some(w), Some(bias)], outputs, attrs };
            }
            None => {
                let outputs = graph.nodes[m].outputs.clone();
                graph.nodes[m] = Node { name, op_type: "Linear".into(), inputs: vec![Some(x), Some(w)], outputs, attrs };
            }
        }
        rewrites += 1;
    }
    Ok(rewrites)
}
