//! Linear (internal, made by passes/fuse_linear.rs): Y[…, N] = X[…, K] · op(W) + b, with W
//! 2-D ([N, K] when `transB` = 1, else [K, N]) and an optional bias b[N]. One op instead of
//! Transpose + MatMul + Add: the weight is never transposed in memory and the bias lands in the
//! matmul's output. Its gradient is two FusedMatMuls over the rows and a column sum.

use super::util::{input, same_element_type};
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::{Attr, Attrs, Node};

/// (K, N) of a Linear node's weight shape.
pub fn linear_dims(node: &Node, w: &[usize]) -> Result<(usize, usize)> {
    if w.len() != 2 {
        return Err(node.err(format!("the weight must be 2-D, got {w:?}")));
    }
    Ok(if node.attrs.int("transB", 0)? != 0 { (w[1], w[0]) } else { (w[0], w[1]) })
}

struct Linear;
impl OpDef for Linear {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let (x, w) = (input(node, inputs, 0)?, input(node, inputs, 1)?);
        same_element_type(node, inputs, &[0, 1, 2])?;
        let (k, n) = linear_dims(node, w.shape)?;
        if x.shape.last() != Some(&k) {
            return Err(node.err(format!("X {:?} does not end in the weight's K = {k}", x.shape)));
        }
        if let Some(Some(b)) = inputs.get(2) {
            if b.shape != [n] {
                return Err(node.err(format!("the bias must be [{n}], got {:?}", b.shape)));
            }
        }
        let mut out = x.shape[..x.shape.len() - 1].to_vec();
        out.push(n);
        Ok(vec![TypeOut::new(x.dtype, out)])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let (x, w) = (g.x(0)?, g.x(1)?);
            let tb = node.attrs.int("transB", 0)? != 0;
            let mm = |ta: bool, tb: bool| Attrs::default().with("transA", Attr::Int(ta as i64)).with("transB", Attr::Int(tb as i64));
            if g.wants(0) {
                let d = g.op("FusedMatMul", &[dy, w], mm(false, !tb));
                g.set(0, d);
            }
            if g.wants(1) || g.wants(2) {
                // rows flattened: [-1, N] and [-1, K] views (free: Reshape shares memory)
                let dy2 = g.op("FlattenRows", &[dy], Attrs::default());
                if g.wants(1) {
                    let x2 = g.op("FlattenRows", &[x], Attrs::default());
                    let d = if tb {
                        g.op("FusedMatMul", &[dy2, x2], mm(true, false))
                    } else {
                        g.op("FusedMatMul", &[x2, dy2], mm(true, false))
                    };
                    g.set(1, d);
                }
                if g.wants(2) {
                    let d = g.op("SumRows", &[dy2], Attrs::default());
                    g.set(2, d);
                }
            }
            Ok(())
        })
    }
}

/// FlattenRows: [d0, …, dk] -> [d0·…·d(k-1), dk] (a view).
struct FlattenRows;
impl OpDef for FlattenRows {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let last = *x.shape.last().ok_or_else(|| node.err("input must have rank ≥ 1"))?;
        let rows = x.shape[..x.shape.len() - 1].iter().product();
        Ok(vec![TypeOut::new(x.dtype, vec![rows, last])])
    }
    fn is_view(&self) -> bool {
        true
    }
}

/// SumRows: [M, N] -> [N], the column sums (a bias gradient).
struct SumRows;
impl OpDef for SumRows {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        if x.shape.len() != 2 {
            return Err(node.err(format!("input must be 2-D, got {:?}", x.shape)));
        }
        Ok(vec![TypeOut::new(x.dtype, vec![x.shape[1]])])
    }
}

pub fn register(r: &mut Registry) {
    r.internal("Linear", Linear);
    r.internal("FlattenRows", FlattenRows);
    r.internal("SumRows", SumRows);
}
