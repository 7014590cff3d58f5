//! The CUDA kernel table: per op type, a host function that reads the node's attributes and
//! operand shapes, works out strides and launch geometry, and enqueues kernels (kernels/*.cu)
//! or cuBLAS calls on the step's stream. Families register themselves; an op without an entry
//! is a plan-time error listing every such op (`missing`). Shape rules are shared with the CPU
//! backend through `crate::ops` helpers, so both backends read a node the same way.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::CUstream;

use super::blas::F32Mode;
use super::runtime::CudaRuntime;
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::{DType, Tensor};

mod activation;
mod attention;
mod attention_flash;
mod batchnorm;
mod causal_mask;
mod conv;
mod conv_plan;
mod cumsum;
mod elementwise;
mod gather;
mod gather_nd;
mod linear_cross_entropy;
mod loss;
mod matmul;
pub(crate) mod movement;
mod norm;
mod pool;
pub(crate) mod radix_sort;
mod random;
mod random_draws;
mod reduce;
mod rms_norm;
mod softmax;
pub mod strides;
mod widen;

pub use attention::{computes_mask, path as attention_path};
pub use attention_flash::{ENV_FLASH, ENV_FLASH_ROWS};
pub use matmul::ENV_CUBLASLT;
pub use random::{random_key, salt_of};

/// A value on the device: its type, shape and address (contiguous, row-major), and for
/// constants (folded at plan time: shapes, axes, slice bounds, masks) the host copy too, shared
/// with the plan (ops/attention.rs remembers what it found in a constant by its allocation).
#[derive(Clone, Copy, Debug)]
pub struct DView<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub ptr: u64,
    pub host: Option<&'a Arc<Tensor>>,
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
    /// Device address of a u64 holding the step's seed (0: none). Set while a step is recorded
    /// into a CUDA graph: Dropout then reads its key from there (`dropout_slot_T`), so each
    /// replay draws fresh masks from the seed written before it.
    pub seed_slot: u64,
    /// How f32 matmuls multiply: exact (the default, for parity), TF32 (PyTorch's
    /// `torch.backends.cuda.matmul.allow_tf32`, read per step by the Python side), or bf16 (the
    /// session's `precision="bf16"`).
    pub f32_mode: F32Mode,
    /// Device address of an i32 error flag that index-checking kernels (gather, the loss's
    /// labels) set on invalid input; 0: none (invalid input is then silently zero).
    pub error_flag: u64,
    /// Where the executor points `error_flag` for each step: this address plus 4 × the node's
    /// index (one flag per node, session/cuda_errors.rs); 0: `error_flag` as given.
    pub error_base: u64,
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
        attention::register(&mut t);
        elementwise::register(&mut t);
        activation::register(&mut t);
        reduce::register(&mut t);
        movement::register(&mut t);
        softmax::register(&mut t);
        norm::register(&mut t);
        rms_norm::register(&mut t);
        random::register(&mut t);
        random_draws::register(&mut t);
        loss::register(&mut t);
        linear_cross_entropy::register(&mut t);
        gather::register(&mut t);
        gather_nd::register(&mut t);
        cumsum::register(&mut t);
        conv::register(&mut t);
        pool::register(&mut t);
        batchnorm::register(&mut t);
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
/// An error naming the node unless every present operand of `others` (name, view) has `x`'s
/// element type: for kernels that read companion operands (scale, bias, class weights, the
/// incoming gradient) as x's type, where a bf16 x with an f32 scale would read the scale as
/// pairs of bf16 values. The CPU kernels widen every operand, so they take such mixes.
pub(crate) fn same_type(node: &Node, x: &DView, others: &[(&str, Option<&DView>)]) -> Result<()> {
    for (what, v) in others {
        if let Some(v) = v.filter(|v| v.dtype != x.dtype) {
            return Err(node.err(format!(
                "the CUDA kernel reads the {what} as {} like its input, but it is {}",
                x.dtype.name(),
                v.dtype.name()
            )));
        }
    }
    Ok(())
}

pub(crate) fn float_suffix(node: &Node, d: DType) -> Result<&'static str> {
    match d {
        DType::F32 => Ok("f32"),
        DType::F64 => Ok("f64"),
        DType::BF16 => Ok("bf16"),
        DType::F16 => Ok("f16"),
        other => Err(node.err(format!("the CUDA kernel takes float tensors, got {}", other.name()))),
    }
}

/// The value of input `i`, a constant folded at plan time (shape, axes, slice bounds), as
/// integers; `None` when the input is absent. A computed input is an error: the CUDA backend
/// reads these values on the host when it enqueues the kernel.
pub(crate) fn const_ints(node: &Node, ins: &[Option<DView>], i: usize, what: &str) -> Result<Option<Vec<i64>>> {
    let Some(x) = ins.get(i).and_then(|x| x.as_ref()) else { return Ok(None) };
    let t = x.host.ok_or_else(|| {
        node.err(format!("the CUDA backend needs {what} (input {i}) to be a constant known when the plan is built; here it is computed"))
    })?;
    t.to_i64_vec().map(Some).ok_or_else(|| node.err(format!("{what} (input {i}) must be an integer tensor")))
}

/// Inputs `range` as the shape rules see them (`InferIn` with the host value of constants), for
/// the `crate::ops` helpers that read parameters from inputs (Slice's bounds). An input that
/// is present but computed is an error naming it.
pub(crate) fn infer_ins<'a>(
    node: &Node,
    ins: &[Option<DView<'a>>],
    range: std::ops::Range<usize>,
    what: &str,
) -> Result<Vec<Option<crate::ops::InferIn<'a>>>> {
    range
        .map(|i| match ins.get(i).and_then(|x| x.as_ref()) {
            None => Ok(None),
            Some(x) => match x.host {
                Some(t) => Ok(Some(crate::ops::InferIn { dtype: x.dtype, shape: x.shape, value: Some(t.as_ref()) })),
                None => Err(node.err(format!(
                    "the CUDA backend needs the {what} (input {i}) to be a constant known when the plan is built; here it is computed"
                ))),
            },
        })
        .collect()
}
