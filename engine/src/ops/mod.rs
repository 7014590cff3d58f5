//! Op semantics, one file per op family: shape/dtype rule and gradient rule. Each family registers
//! its ops in the registry below; kernels live in the backends, in files of the same name.

mod activation;
pub mod attention;
mod batchnorm;
mod conv;
mod cumsum;
mod elementwise;
pub mod gather_nd;
mod internal;
pub mod linear;
pub mod loss;
mod matmul;
pub mod matmul_gelu_grad;
pub(crate) mod movement;
mod norm;
mod pool;
pub(crate) mod random;
pub(crate) mod random_draws;
mod reduce;
mod rms_norm;
pub(crate) mod shape_ops;
mod softmax;
pub mod window;

pub mod util;

use std::collections::BTreeMap;
use std::sync::OnceLock;

use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::{DType, Tensor};

/// What shape inference knows of one input: its type, and its value when known at plan time.
#[derive(Clone, Copy, Debug)]
pub struct InferIn<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub value: Option<&'a Tensor>,
}

/// The inferred type of one output.
#[derive(Clone, Debug, PartialEq)]
pub struct TypeOut {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TypeOut {
    pub fn new(dtype: DType, shape: Vec<usize>) -> Self {
        TypeOut { dtype, shape }
    }
    pub fn like(i: &InferIn) -> Self {
        TypeOut { dtype: i.dtype, shape: i.shape.to_vec() }
    }
}

/// The semantics of one op type.
pub trait OpDef: Sync + Send {
    /// Output types from input types (and values, where the op reads shapes from inputs).
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>>;
    /// Adds the nodes computing the gradients of the inputs (see autodiff::GradCtx).
    /// `None` means the op has no gradient rule.
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        None
    }
    /// Draws random numbers: never folded as a constant, re-run every step.
    fn is_random(&self) -> bool {
        false
    }
    /// Inputs through which no gradient flows (indices, shapes, masks): no error if unreachable.
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[]
    }
    /// Output 0 holds input 0's bytes unchanged whenever both have the same element count
    /// (Reshape and friends): the plan lets it share input 0's memory instead of copying.
    fn is_view(&self) -> bool {
        false
    }
    /// The same for this node and these input types: ops that are views only for some
    /// arguments (a Slice keeping everything is one, a reversing one is not) override it.
    fn is_view_for(&self, _node: &Node, _inputs: &[Option<InferIn>]) -> bool {
        self.is_view()
    }
}

pub struct Registry {
    ops: BTreeMap<&'static str, (Box<dyn OpDef>, bool)>,
}

impl Registry {
    /// Registers an ONNX (default-domain) op.
    pub fn add(&mut self, name: &'static str, op: impl OpDef + 'static) {
        self.ops.insert(name, (Box::new(op), false));
    }
    /// Registers an ortrain-internal op (gradient helpers, fused ops): not an ONNX op.
    pub fn internal(&mut self, name: &'static str, op: impl OpDef + 'static) {
        self.ops.insert(name, (Box::new(op), true));
    }
}

fn registry() -> &'static Registry {
    static REG: OnceLock<Registry> = OnceLock::new();
    REG.get_or_init(|| {
        let mut r = Registry { ops: BTreeMap::new() };
        activation::register(&mut r);
        attention::register(&mut r);
        batchnorm::register(&mut r);
        conv::register(&mut r);
        cumsum::register(&mut r);
        elementwise::register(&mut r);
        gather_nd::register(&mut r);
        internal::register(&mut r);
        linear::register(&mut r);
        loss::register(&mut r);
        matmul::register(&mut r);
        matmul_gelu_grad::register(&mut r);
        movement::register(&mut r);
        norm::register(&mut r);
        pool::register(&mut r);
        random::register(&mut r);
        random_draws::register(&mut r);
        reduce::register(&mut r);
        rms_norm::register(&mut r);
        shape_ops::register(&mut r);
        softmax::register(&mut r);
        r
    })
}

pub fn lookup(op_type: &str) -> Option<&'static dyn OpDef> {
    registry().ops.get(op_type).map(|(b, _)| b.as_ref())
}

/// Every registered ONNX op type, sorted (internal ops excluded).
pub fn onnx_op_types() -> Vec<&'static str> {
    registry().ops.iter().filter(|(_, (_, internal))| !internal).map(|(k, _)| *k).collect()
}

/// Every registered op type, sorted, with whether it is internal.
pub fn all_op_types() -> Vec<(&'static str, bool)> {
    registry().ops.iter().map(|(k, (_, internal))| (*k, *internal)).collect()
}

/// Whether input `i` of an `op_type` node is read for its element type and shape only, never
/// its data (Shape and Size of anything; CastLike's `target_type` operand; the tensor a
/// RandomUniformLike or RandomNormalLike draws like). Plans neither keep such a value alive for
/// the read nor widen it.
pub fn reads_type_only(op_type: &str, i: usize) -> bool {
    matches!((op_type, i), ("Shape" | "Size" | "RandomUniformLike" | "RandomNormalLike", 0) | ("CastLike", 1))
}

/// Whether `op_type` is an ortrain-internal op (not importable from ONNX files).
pub fn is_internal(op_type: &str) -> bool {
    registry().ops.get(op_type).is_some_and(|(_, internal)| *internal)
}

/// Transpose's permutation for a given rank (shared with backends).
pub fn movement_perm(node: &Node, rank: usize) -> Result<Vec<usize>> {
    movement::perm_of(node, rank)
}

/// Slice's normalised (start, step, count) per axis (shared with backends).
pub fn movement_slice_params(node: &Node, inputs: &[Option<InferIn>], shape: &[usize]) -> Result<Vec<(i64, i64, usize)>> {
    movement::slice_params(node, inputs, shape)
}

pub use self::loss::{lce_chunk_rows, LceBudget};
pub use self::shape_ops::shape_range;

/// Reduce*'s normalised axes (shared with backends).
pub fn reduce_axes_of(node: &Node, inputs: &[Option<InferIn>], rank: usize) -> Result<Vec<usize>> {
    reduce::reduce_axes(node, inputs, rank)
}

/// (kept-dims shape, output shape) of a reduction (shared with backends).
pub fn reduced_shapes_of(shape: &[usize], axes: &[usize], keepdims: bool) -> (Vec<usize>, Vec<usize>) {
    reduce::reduced_shapes(shape, axes, keepdims)
}

/// Softmax's (outer, n, inner) layout (shared with backends).
pub fn softmax_layout_of(node: &Node, shape: &[usize]) -> Result<(usize, usize, usize)> {
    softmax::softmax_layout(node, shape)
}

/// FusedMatMul's operand and target shapes with MatMul's dropped 1-D dims restored (shared
/// with backends).
pub fn matmul_fused_shapes(node: &Node, a: &[usize], b: &[usize], target: Option<&[usize]>) -> Result<matmul::FusedShapes> {
    matmul::fused_shapes(node, a, b, target)
}

/// LayerNormalization's (rows, row length) (shared with backends).
pub fn layer_norm_layout_of(node: &Node, shape: &[usize]) -> Result<(usize, usize)> {
    norm::layer_norm_layout(node, shape)
}

/// RmsNorm's (rows, row length), checking the scale's shape (shared with backends).
pub fn rms_norm_layout_of(node: &Node, x: &[usize], scale: Option<&[usize]>) -> Result<(usize, usize)> {
    rms_norm::rms_norm_layout(node, x, scale)
}

/// RmsNorm's InvRms type for X of type `x`: f32, f64 for f64 (shared with backends).
pub fn rms_norm_stat_type(x: DType) -> DType {
    rms_norm::stat_type(x)
}

/// LayerNormGrad's optional outputs' indices: dx's 16-bit copy, dx's column sums (shared with
/// backends).
pub fn layer_norm_grad_extras_of(node: &Node) -> Result<(Option<usize>, Option<usize>)> {
    norm::layer_norm_grad_extras(node)
}

/// How many outputs those extras make (shared with backends).
pub fn layer_norm_grad_output_count_of(extras: (Option<usize>, Option<usize>)) -> usize {
    norm::layer_norm_grad_output_count(extras)
}

/// Conv's (group, window) for input and weight shapes (shared with backends).
pub fn conv_geometry_of(node: &Node, x: &[usize], w: &[usize]) -> Result<(usize, window::Window)> {
    conv::conv_geometry(node, x, w)
}

/// A pool's window over input shape `x` (shared with backends).
pub fn pool_geometry_of(node: &Node, x: &[usize]) -> Result<window::Window> {
    pool::pool_geometry(node, x)
}

/// GatherND's layout (shared with backends).
pub fn gather_nd_layout_of(node: &Node, data: &[usize], indices: &[usize]) -> Result<gather_nd::GatherNdLayout> {
    gather_nd::gather_nd_layout(node, data, indices)
}

/// CumSum's normalised axis (shared with backends).
pub fn cumsum_axis_of(node: &Node, axis: &Option<InferIn>, rank: usize) -> Result<usize> {
    cumsum::cumsum_axis(node, axis, rank)
}
