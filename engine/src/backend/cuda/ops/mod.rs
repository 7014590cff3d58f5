//! The CUDA kernel table: per op type, a host function that reads the node's attributes and
//! operand shapes, works out strides and launch geometry, and enqueues kernels (kernels/*.cu)
//! or cuBLAS calls on the step's stream. Families register themselves; an op without an entry
//! is a plan-time error listing every such op (`missing`). Shape rules are shared with the CPU
//! backend through `crate::ops` helpers, so both backends read a node the same way.

use std::collections::HashMap;
use std::sync::OnceLock;

use cudarc::driver::sys::CUstream;

use super::runtime::CudaRuntime;
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::{DType, Tensor};

mod activation;
mod elementwise;
mod matmul;
mod movement;
mod reduce;
pub mod strides;

/// A value on the device: its type, shape and address (contiguous, row-major), and for
/// constants (folded at plan time: shapes, axes, slice bounds) the host copy too.
#[derive(Clone, Copy, Debug)]
pub struct DView<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub ptr: u64,
    pub host: Option<&'a Tensor>,
}

impl DView<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// What a kernel launch needs besides its operands.
pub struct CudaCtx<'a> {
    pub rt: &'a CudaRuntime,
    pub stream: CUstream,
    /// The step's dropout seed.
    pub seed: u64,
    /// Device address of an i32 error flag that index-checking kernels (gather, the loss's
    /// labels) set on invalid input; 0: none (invalid input is then silently zero).
    pub error_flag: u64,
}

pub type CudaKernel = fn(&Node, &[Option<DView>], &[DView], &mut CudaCtx) -> Result<()>;

pub struct CudaTable(HashMap<&'static str, CudaKernel>);

impl CudaTable {
    pub fn add(&mut self, op: &'static str, k: CudaKernel) {
        self.0.insert(op, k);
    }
}

fn table() -> &'static CudaTable {
    static T: OnceLock<CudaTable> = OnceLock::new();
    T.get_or_init(|| {
        let mut t = CudaTable(HashMap::new());
        matmul::register(&mut t);
        elementwise::register(&mut t);
        activation::register(&mut t);
        reduce::register(&mut t);
        movement::register(&mut t);
        t
    })
}

pub fn kernel(op_type: &str) -> Option<CudaKernel> {
    table().0.get(op_type).copied()
}

/// Every op type with a CUDA kernel, sorted (for doc/SUPPORTED-OPS.md).
pub fn op_types() -> Vec<&'static str> {
    let mut v: Vec<&'static str> = table().0.keys().copied().collect();
    v.sort();
    v
}

/// Input `i` of a node, or an error naming it.
pub(crate) fn input<'v, 'a>(node: &Node, ins: &'v [Option<DView<'a>>], i: usize) -> Result<&'v DView<'a>> {
    ins.get(i).and_then(|x| x.as_ref()).ok_or_else(|| node.err(format!("input {i} missing")))
}

/// The kernel-name suffix of a float dtype, or an error naming the node.
pub(crate) fn float_suffix(node: &Node, d: DType) -> Result<&'static str> {
    match d {
        DType::F32 => Ok("f32"),
        DType::F64 => Ok("f64"),
        other => Err(node.err(format!("the CUDA kernel takes float tensors, got {}", other.name()))),
    }
}
