//! Activations: Relu, LeakyRelu, Tanh, Sigmoid, Gelu (exact and tanh), Softplus, HardSigmoid,
//! HardSwish, and their internal gradients, each `XGrad(dy, x or y)`.

use super::util::input;
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::Node;

/// An activation whose gradient is `grad_op(dy, x)` (from_output = false) or `grad_op(dy, y)`.
struct Act {
    grad_op: &'static str,
    from_output: bool,
}

impl OpDef for Act {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        Ok(vec![TypeOut::like(input(node, inputs, 0)?)])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let def = grad_def(&node.op_type).ok_or_else(|| node.err("no gradient definition"))?;
            let src = if def.1 { g.y(0) } else { g.x(0)? };
            let d = g.op(def.0, &[dy, src], node.attrs.clone());
            g.set(0, d);
            Ok(())
        })
    }
}

/// (gradient op, whether it reads the output rather than the input) per activation.
fn grad_def(op: &str) -> Option<(&'static str, bool)> {
    TABLE.iter().find(|(name, _)| *name == op).map(|(_, a)| (a.grad_op, a.from_output))
}

const TABLE: &[(&str, Act)] = &[
    ("Relu", Act { grad_op: "ReluGrad", from_output: true }),
    ("LeakyRelu", Act { grad_op: "LeakyReluGrad", from_output: false }),
    ("Tanh", Act { grad_op: "TanhGrad", from_output: true }),
    ("Sigmoid", Act { grad_op: "SigmoidGrad", from_output: true }),
    ("Gelu", Act { grad_op: "GeluGrad", from_output: false }),
    ("Softplus", Act { grad_op: "SoftplusGrad", from_output: false }),
    ("HardSigmoid", Act { grad_op: "HardSigmoidGrad", from_output: false }),
    ("HardSwish", Act { grad_op: "HardSwishGrad", from_output: false }),
];

struct SameAsFirst;
impl OpDef for SameAsFirst {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        Ok(vec![TypeOut::like(input(node, inputs, 0)?)])
    }
}

pub fn register(r: &mut Registry) {
    for (name, a) in TABLE {
        r.add(name, Act { grad_op: a.grad_op, from_output: a.from_output });
        r.internal(a.grad_op, SameAsFirst);
    }
}
