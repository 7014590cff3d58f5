//! Backends run planned graphs. A backend supplies storage for the arena and a kernel per op
//! type; a missing kernel is a plan-time error listing every unsupported op.

pub mod cpu;

/// The narrow interface the executor needs from a device.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    /// Op types for which this backend has no kernel, among `op_types`.
    fn missing_kernels<'a>(&self, op_types: &[&'a str]) -> Vec<&'a str>;
}
