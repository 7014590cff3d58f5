//! Linear (internal, made by passes/fuse_linear.rs): Y[…, N] = X[…, K] · op(W) + b, with W
//! 2-D ([N, K] when `transB` = 1, else [K, N]) and an optional bias b[N]. One op instead of
//! Transpose + MatMul + Add: the weight is never transposed in memory and the bias lands in the
//! matmul's output. Its gradient is two FusedMatMuls over the rows and a column sum.
//!
//! Input 3, `residual` (internal, passes/fuse_residual_linear.rs): Y = residual + X · op(W) + b,
//! of the residual's type and shape (f32 from 16-bit X and W: the bias is then the residual's
//! type too), its rows the product's rows (the residual's last dim is N). Its gradient is dY
//! itself; X's and W's come from dY cast to their type, the bias's from dY.
//!
//! Attribute `activation` (internal, passes/fuse_linear_gelu.rs): "none" (the default) or
//! "gelu_tanh": Y = GELU(X · op(W) + b) with the tanh approximation, and output 1 the product
//! plus bias before it (the GELU's input, which its gradient reads). Not with a residual.

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

/// Whether a Linear applies the tanh-approximated GELU to its product (attribute `activation`),
/// writing the GELU's input as output 1.
pub fn gelu_after(node: &Node) -> Result<bool> {
    match node.attrs.string("activation", "none")?.as_str() {
        "none" => Ok(false),
        "gelu_tanh" => Ok(true),
        other => Err(node.err(format!("activation must be \"none\" or \"gelu_tanh\", got {other:?}"))),
    }
}

struct Linear;
impl OpDef for Linear {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let (x, w) = (input(node, inputs, 0)?, input(node, inputs, 1)?);
        let residual = inputs.get(3).and_then(|r| r.as_ref());
        let gelu = gelu_after(node)?;
        if gelu && (residual.is_some() || node.outputs.len() != 2) {
            return Err(node.err("a Linear with a GELU has no residual and two outputs (the result and the GELU's input)"));
        }
        same_element_type(node, inputs, if residual.is_some() { &[0, 1] } else { &[0, 1, 2] })?;
        let (k, n) = linear_dims(node, w.shape)?;
        if x.shape.last() != Some(&k) {
            return Err(node.err(format!("X {:?} does not end in the weight's K = {k}", x.shape)));
        }
        if let Some(Some(b)) = inputs.get(2) {
            if b.shape != [n] {
                return Err(node.err(format!("the bias must be [{n}], got {:?}", b.shape)));
            }
            if let Some(r) = residual.filter(|r| r.dtype != b.dtype) {
                return Err(node.err(format!("the bias is {} and the residual {}: they must be alike", b.dtype.name(), r.dtype.name())));
            }
        }
        let mut out = x.shape[..x.shape.len() - 1].to_vec();
        out.push(n);
        match residual {
            None if gelu => Ok(vec![TypeOut::new(x.dtype, out.clone()), TypeOut::new(x.dtype, out)]),
            None => Ok(vec![TypeOut::new(x.dtype, out)]),
            Some(r) => {
                let rows: usize = out[..out.len() - 1].iter().product();
                if r.shape.last() != Some(&n) || r.shape.iter().product::<usize>() != rows * n {
                    return Err(node.err(format!("the residual {:?} must hold the product's {rows} rows of {n}", r.shape)));
                }
                Ok(vec![TypeOut::like(r)])
            }
        }
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            // through the GELU first: the products below take the gradient of its input
            let dy = if gelu_after(node)? {
                let tanh = Attrs::default().with("approximate", Attr::String("tanh".into()));
                let pre = g.y(1);
                g.op("GeluGrad", &[dy, pre], tanh)
            } else {
                dy
            };
            let (x, w) = (g.x(0)?, g.x(1)?);
            let tb = node.attrs.int("transB", 0)? != 0;
            let mm = |ta: bool, tb: bool| Attrs::default().with("transA", Attr::Int(ta as i64)).with("transB", Attr::Int(tb as i64));
            let residual = node.input(3).is_some();
            // with a residual, dY is the residual's (f32, its shape): the products take it as
            // rows of N cast to X's type, the bias's gradient as those rows
            let dy_rows = residual.then(|| g.op("FlattenRows", &[dy], Attrs::default()));
            let dy_x = match dy_rows {
                Some(rows) => {
                    g.set(3, dy);
                    g.op("CastLike", &[rows, x], Attrs::default())
                }
                None => dy,
            };
            if g.wants(0) {
                let d = g.op("FusedMatMul", &[dy_x, w], mm(false, !tb));
                let d = if residual {
                    let shape = g.shape_of(x);
                    g.op("Reshape", &[d, shape], Attrs::default())
                } else {
                    d
                };
                g.set(0, d);
            }
            if g.wants(1) || g.wants(2) {
                // rows flattened: [-1, N] and [-1, K] views (free: Reshape shares memory)
                let dy2 = if residual { dy_x } else { g.op("FlattenRows", &[dy], Attrs::default()) };
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
                    let d = g.op("SumRows", &[dy_rows.unwrap_or(dy2)], Attrs::default());
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
