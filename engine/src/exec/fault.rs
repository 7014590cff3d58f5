//! Fault injection for testing ortrain's parity tooling: with `ORTRAIN_FAULT_INJECT=OpType` in
//! the environment, every f32 output of every node of that op type is scaled by 1.1 after its
//! kernel runs. `ortrain.check_parity` (and `%%ort --check`) must then name that op as the first
//! divergence; the tests use it to give the tool a real engine fault to find. Unset (the normal
//! case), it costs one environment lookup per phase.

use crate::backend::cpu::Out;
use crate::ir::Node;
use crate::tensor::DType;

pub const ENV_FAULT: &str = "ORTRAIN_FAULT_INJECT";

/// The op type to corrupt in this phase, if any.
pub fn target() -> Option<String> {
    std::env::var(ENV_FAULT).ok().filter(|s| !s.is_empty())
}

/// Applies the fault to `node`'s outputs when it is of the targeted op type.
pub fn apply(target: Option<&str>, node: &Node, outs: &mut [Out]) {
    if target != Some(node.op_type.as_str()) {
        return;
    }
    for out in outs.iter_mut().filter(|o| o.dtype == DType::F32) {
        if let Ok(v) = out.slice::<f32>() {
            v.iter_mut().for_each(|x| *x *= 1.1);
        }
    }
}
