//! MatMulGeluGrad (internal, made by passes/matmul_gelu_grad.rs on CUDA train graphs):
//! Y = GeluGrad(op(A) · op(B), X) with the tanh approximation, the gradient through a GELU of a
//! product that nothing else reads: A [..., K] (rows of K, as FusedMatMul folds a batch into M)
//! or, with `transA`, [K, M]; B [K, N] ([N, K] with `transB`); X the GELU's input, M·N elements
//! ending in N, of the operands' type. Y has the product's shape: A's leading dims and N
//! ([M, N] with `transA`). Optional output 1: the sums of Y's rows, [N] (the bias gradient of
//! the layer before the GELU). On CUDA one cuBLASLt product whose DGELU_BGRAD epilogue applies
//! the gradient as it writes and sums the rows (backend/cuda/ops/matmul.rs), so the product is
//! never stored; the CPU multiplies, applies the gradient, then sums.

use super::util::{input, same_element_type};
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::error::Result;
use crate::ir::Node;

/// (M, K, N) of a MatMulGeluGrad's operands, and the shape of its product.
pub fn product_dims(node: &Node, a: &[usize], b: &[usize]) -> Result<(usize, usize, usize, Vec<usize>)> {
    let ta = node.attrs.int("transA", 0)? != 0;
    let tb = node.attrs.int("transB", 0)? != 0;
    let [b0, b1] = b else {
        return Err(node.err(format!("B must be 2-D, got {b:?}")));
    };
    let (kb, n) = if tb { (*b1, *b0) } else { (*b0, *b1) };
    let (m, k, mut shape) = match (a, ta) {
        ([k, m], true) => (*m, *k, vec![*m]),
        (_, true) => return Err(node.err(format!("A must be 2-D with transA, got {a:?}"))),
        ([], false) => return Err(node.err("A must have rank ≥ 1")),
        ([lead @ .., k], false) => (lead.iter().product(), *k, lead.to_vec()),
    };
    if k != kb {
        return Err(node.err(format!("inner dimensions differ: {a:?} · {b:?} (transA={ta}, transB={tb})")));
    }
    shape.push(n);
    Ok((m, k, n, shape))
}

struct MatMulGeluGrad;
impl OpDef for MatMulGeluGrad {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let (a, b, x) = (input(node, inputs, 0)?, input(node, inputs, 1)?, input(node, inputs, 2)?);
        same_element_type(node, inputs, &[0, 1, 2])?;
        let approximate = node.attrs.string("approximate", "none")?;
        if approximate != "tanh" {
            return Err(node.err(format!("approximate must be \"tanh\" (cuBLASLt's GELU), got {approximate:?}")));
        }
        let (m, _, n, shape) = product_dims(node, a.shape, b.shape)?;
        if x.shape.last() != Some(&n) || x.shape.iter().product::<usize>() != m * n {
            return Err(node.err(format!("the GELU input {:?} must hold the product's {m} rows of {n}", x.shape)));
        }
        let mut out = vec![TypeOut::new(x.dtype, shape)];
        if node.outputs.len() > 1 {
            out.push(TypeOut::new(x.dtype, vec![n]));
        }
        Ok(out)
    }
}

pub fn register(r: &mut Registry) {
    r.internal("MatMulGeluGrad", MatMulGeluGrad);
}
