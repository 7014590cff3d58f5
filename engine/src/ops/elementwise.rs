//! Element-wise ops with numpy broadcasting: arithmetic, comparison, logic, Where, unary math,
//! Cast. Spec: https://onnx.ai/onnx/operators/ (Add-14, Where-16, Cast-19, ...).

use super::util::{broadcast_shapes, input};
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::{Attr, Attrs, Node};
use crate::tensor::DType;

/// A broadcasting binary op; `logical` outputs bool.
struct Binary {
    logical: bool,
    grad: Option<fn(&Node, &mut GradCtx) -> Result<()>>,
}

impl OpDef for Binary {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let a = input(node, inputs, 0)?;
        let b = input(node, inputs, 1)?;
        if a.dtype != b.dtype && node.op_type != "Pow" {
            return Err(node.err(format!("operands have different element types ({} and {})", a.dtype.name(), b.dtype.name())));
        }
        let shape = broadcast_shapes(node, &[a.shape, b.shape])?;
        Ok(vec![TypeOut::new(if self.logical { DType::Bool } else { a.dtype }, shape)])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        self.grad
    }
}

struct Unary {
    out: Option<DType>,
    grad: Option<fn(&Node, &mut GradCtx) -> Result<()>>,
}

impl OpDef for Unary {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let a = input(node, inputs, 0)?;
        Ok(vec![TypeOut::new(self.out.unwrap_or(a.dtype), a.shape.to_vec())])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        self.grad
    }
}

struct Where;
impl OpDef for Where {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let c = input(node, inputs, 0)?;
        let x = input(node, inputs, 1)?;
        let y = input(node, inputs, 2)?;
        if x.dtype != y.dtype {
            return Err(node.err(format!("X and Y have different element types ({} and {})", x.dtype.name(), y.dtype.name())));
        }
        Ok(vec![TypeOut::new(x.dtype, broadcast_shapes(node, &[c.shape, x.shape, y.shape])?)])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|_, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let c = g.x(0)?;
            for (i, keep) in [(1usize, 1i64), (2, 0)] {
                if g.wants(i) {
                    let sel = g.op("MaskSelect", &[c, dy], Attrs::default().with("keep", Attr::Int(keep)));
                    let x = g.x(i)?;
                    let d = g.sum_to(sel, x);
                    g.set(i, d);
                }
            }
            Ok(())
        })
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[0]
    }
}

struct Cast;
impl OpDef for Cast {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let a = input(node, inputs, 0)?;
        let to = if node.op_type == "CastLike" {
            input(node, inputs, 1)?.dtype
        } else {
            let code = node.attrs.req_int("to").map_err(|e| node.err(e.to_string()))?;
            DType::from_onnx(code as i32).ok_or_else(|| node.err(format!("cast to element type code {code} is not supported")))?
        };
        Ok(vec![TypeOut::new(to, a.shape.to_vec())])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|_, g| {
            if let Some(dy) = g.dy(0) {
                let x = g.x(0)?;
                let d = g.op("CastLike", &[dy, x], Attrs::default());
                g.set(0, d);
            }
            Ok(())
        })
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[1]
    }
    /// A cast to the type the input has already moves nothing (a CastLike gradient of a value
    /// that was never narrowed, an exporter's Cast to int64 of an int64).
    fn is_view_for(&self, node: &Node, inputs: &[Option<InferIn>]) -> bool {
        self.infer(node, inputs).is_ok_and(|outs| inputs.first().and_then(|x| x.as_ref()).is_some_and(|x| outs[0].dtype == x.dtype))
    }
}

fn grad_add(_: &Node, g: &mut GradCtx) -> Result<()> {
    let Some(dy) = g.dy(0) else { return Ok(()) };
    for i in 0..2 {
        if g.wants(i) {
            let x = g.x(i)?;
            let d = g.sum_to(dy, x);
            g.set(i, d);
        }
    }
    Ok(())
}

fn grad_sub(_: &Node, g: &mut GradCtx) -> Result<()> {
    let Some(dy) = g.dy(0) else { return Ok(()) };
    if g.wants(0) {
        let x = g.x(0)?;
        let d = g.sum_to(dy, x);
        g.set(0, d);
    }
    if g.wants(1) {
        let n = g.op("Neg", &[dy], Attrs::default());
        let x = g.x(1)?;
        let d = g.sum_to(n, x);
        g.set(1, d);
    }
    Ok(())
}

fn grad_mul(_: &Node, g: &mut GradCtx) -> Result<()> {
    let Some(dy) = g.dy(0) else { return Ok(()) };
    let (a, b) = (g.x(0)?, g.x(1)?);
    if g.wants(0) {
        let p = g.op("Mul", &[dy, b], Attrs::default());
        let d = g.sum_to(p, a);
        g.set(0, d);
    }
    if g.wants(1) {
        let p = g.op("Mul", &[dy, a], Attrs::default());
        let d = g.sum_to(p, b);
        g.set(1, d);
    }
    Ok(())
}

fn grad_div(_: &Node, g: &mut GradCtx) -> Result<()> {
    let Some(dy) = g.dy(0) else { return Ok(()) };
    let (a, b) = (g.x(0)?, g.x(1)?);
    if g.wants(0) {
        let p = g.op("Div", &[dy, b], Attrs::default());
        let d = g.sum_to(p, a);
        g.set(0, d);
    }
    if g.wants(1) {
        // d(a/b)/db = -(a/b)/b
        let y = g.y(0);
        let q = g.op("Div", &[y, b], Attrs::default());
        let p = g.op("Mul", &[dy, q], Attrs::default());
        let n = g.op("Neg", &[p], Attrs::default());
        let d = g.sum_to(n, b);
        g.set(1, d);
    }
    Ok(())
}

/// Max/Min of two inputs: dy goes to the input that won, half to each on a tie (as PyTorch's
/// maximum/minimum do), through the internal MinMaxGrad(dy, a, b) (attrs is_max, which).
fn grad_min_max(node: &Node, g: &mut GradCtx) -> Result<()> {
    let Some(dy) = g.dy(0) else { return Ok(()) };
    if node.inputs.len() != 2 {
        return Err(node.err(format!("the gradient of {} with {} inputs is not supported (2 only)", node.op_type, node.inputs.len())));
    }
    let (a, b) = (g.x(0)?, g.x(1)?);
    let is_max = (node.op_type == "Max") as i64;
    for i in 0..2 {
        if g.wants(i) {
            let attrs = Attrs::default().with("is_max", Attr::Int(is_max)).with("which", Attr::Int(i as i64));
            let p = g.op("MinMaxGrad", &[dy, a, b], attrs);
            let x = g.x(i)?;
            let d = g.sum_to(p, x);
            g.set(i, d);
        }
    }
    Ok(())
}

/// MinMaxGrad(dy, a, b): dy's share of input `which`, shaped like dy.
struct MinMaxGrad;
impl OpDef for MinMaxGrad {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let dy = input(node, inputs, 0)?;
        Ok(vec![TypeOut::like(dy)])
    }
}

fn grad_pow(_: &Node, g: &mut GradCtx) -> Result<()> {
    let Some(dy) = g.dy(0) else { return Ok(()) };
    let (a, b) = (g.x(0)?, g.x(1)?);
    if g.wants(0) {
        // b * a^(b-1)
        let bf = g.op("CastLike", &[b, a], Attrs::default());
        let bm1 = g.affine(bf, 1.0, -1.0);
        let p = g.op("Pow", &[a, bm1], Attrs::default());
        let s = g.op("Mul", &[p, bf], Attrs::default());
        let t = g.op("Mul", &[dy, s], Attrs::default());
        let d = g.sum_to(t, a);
        g.set(0, d);
    }
    if g.wants(1) {
        // y * ln(a)
        let y = g.y(0);
        let l = g.op("Log", &[a], Attrs::default());
        let s = g.op("Mul", &[y, l], Attrs::default());
        let t = g.op("Mul", &[dy, s], Attrs::default());
        let d = g.sum_to(t, b);
        g.set(1, d);
    }
    Ok(())
}

/// Gradient rule `dx = dy ∘ f` for unary ops whose derivative is one more op.
macro_rules! unary_grad {
    (|$g:ident, $dy:ident, $x:ident, $y:ident| $body:expr) => {{
        fn rule(_: &Node, $g: &mut GradCtx) -> Result<()> {
            let Some($dy) = $g.dy(0) else { return Ok(()) };
            let $x = $g.x(0)?;
            let $y = $g.y(0);
            let _ = (&$x, &$y);
            let d = $body;
            $g.set(0, d);
            Ok(())
        }
        Some(rule as fn(&Node, &mut GradCtx) -> Result<()>)
    }};
}

/// Identity: a view of its input.
struct IdentityOp;
impl OpDef for IdentityOp {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let a = input(node, inputs, 0)?;
        Ok(vec![TypeOut::new(a.dtype, a.shape.to_vec())])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        unary_grad!(|g, dy, x, y| dy)
    }
    fn is_view(&self) -> bool {
        true
    }
}

pub fn register(r: &mut Registry) {
    let arith = |grad| Binary { logical: false, grad };
    r.add("Add", arith(Some(grad_add)));
    r.add("Sub", arith(Some(grad_sub)));
    r.add("Mul", arith(Some(grad_mul)));
    r.add("Div", arith(Some(grad_div)));
    r.add("Pow", arith(Some(grad_pow)));
    r.add("Mod", arith(None));
    r.add("Max", arith(Some(grad_min_max)));
    r.add("Min", arith(Some(grad_min_max)));
    r.internal("MinMaxGrad", MinMaxGrad);
    for op in ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor"] {
        r.add(op, Binary { logical: true, grad: None });
    }
    r.add("Where", Where);
    r.add("Cast", Cast);
    r.add("CastLike", Cast);
    r.add("Not", Unary { out: Some(DType::Bool), grad: None });
    r.add("IsNaN", Unary { out: Some(DType::Bool), grad: None });
    r.add("IsInf", Unary { out: Some(DType::Bool), grad: None });
    r.add("Sign", Unary { out: None, grad: None });
    r.add("Floor", Unary { out: None, grad: None });
    r.add("Ceil", Unary { out: None, grad: None });
    r.add("Identity", IdentityOp);
    r.add("Neg", Unary { out: None, grad: unary_grad!(|g, dy, x, y| g.op("Neg", &[dy], Attrs::default())) });
    r.add(
        "Sqrt",
        Unary {
            out: None,
            grad: unary_grad!(|g, dy, x, y| {
                let h = g.affine(dy, 0.5, 0.0);
                g.op("Div", &[h, y], Attrs::default())
            }),
        },
    );
    r.add("Exp", Unary { out: None, grad: unary_grad!(|g, dy, x, y| g.op("Mul", &[dy, y], Attrs::default())) });
    r.add("Log", Unary { out: None, grad: unary_grad!(|g, dy, x, y| g.op("Div", &[dy, x], Attrs::default())) });
    r.add(
        "Abs",
        Unary {
            out: None,
            grad: unary_grad!(|g, dy, x, y| {
                let s = g.op("Sign", &[x], Attrs::default());
                g.op("Mul", &[dy, s], Attrs::default())
            }),
        },
    );
    r.add(
        "Reciprocal",
        Unary {
            out: None,
            grad: unary_grad!(|g, dy, x, y| {
                let yy = g.op("Mul", &[y, y], Attrs::default());
                let p = g.op("Mul", &[dy, yy], Attrs::default());
                g.op("Neg", &[p], Attrs::default())
            }),
        },
    );
    r.add(
        "Sin",
        Unary {
            out: None,
            grad: unary_grad!(|g, dy, x, y| {
                let c = g.op("Cos", &[x], Attrs::default());
                g.op("Mul", &[dy, c], Attrs::default())
            }),
        },
    );
    r.add(
        "Cos",
        Unary {
            out: None,
            grad: unary_grad!(|g, dy, x, y| {
                let s = g.op("Sin", &[x], Attrs::default());
                let p = g.op("Mul", &[dy, s], Attrs::default());
                g.op("Neg", &[p], Attrs::default())
            }),
        },
    );
    r.add("Erf", Unary { out: None, grad: unary_grad!(|g, dy, x, y| g.op("ErfGrad", &[dy, x], Attrs::default())) });
}
