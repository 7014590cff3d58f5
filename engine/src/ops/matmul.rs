//! MatMul (numpy semantics, batch broadcasting), Gemm, and the internal FusedMatMul
//! (transposes, alpha, and an optional target shape that sums broadcast batches away — the
//! form every matmul gradient takes; attribute `to`, an ONNX type code, only float32 over
//! 16-bit or f32 operands: the product written in f32, passes/wgrad_f32.rs). Spec: MatMul-13,
//! Gemm-13.

use super::util::{broadcast_shapes, const_ints, input, same_element_type};
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::{Attr, Attrs, Node};
use crate::tensor::DType;

/// Output shape of a (possibly transposed) batched matmul.
pub fn matmul_shape(node: &Node, a: &[usize], b: &[usize], ta: bool, tb: bool) -> Result<Vec<usize>> {
    if a.is_empty() || b.is_empty() {
        return Err(node.err("MatMul operands must have rank ≥ 1"));
    }
    let a2: Vec<usize> = if a.len() == 1 { vec![1, a[0]] } else { a.to_vec() };
    let b2: Vec<usize> = if b.len() == 1 { vec![b[0], 1] } else { b.to_vec() };
    let (ra, rb) = (a2.len(), b2.len());
    let (m, ka) = if ta { (a2[ra - 1], a2[ra - 2]) } else { (a2[ra - 2], a2[ra - 1]) };
    let (kb, n) = if tb { (b2[rb - 1], b2[rb - 2]) } else { (b2[rb - 2], b2[rb - 1]) };
    if ka != kb {
        return Err(node.err(format!("inner dimensions differ: {a:?} · {b:?} (transA={ta}, transB={tb})")));
    }
    let mut out = broadcast_shapes(node, &[&a2[..ra - 2], &b2[..rb - 2]])?;
    if a.len() > 1 {
        out.push(m);
    }
    if b.len() > 1 {
        out.push(n);
    }
    Ok(out)
}

struct MatMul;
impl OpDef for MatMul {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let (a, b) = (input(node, inputs, 0)?, input(node, inputs, 1)?);
        same_element_type(node, inputs, &[0, 1])?;
        Ok(vec![TypeOut::new(a.dtype, matmul_shape(node, a.shape, b.shape, false, false)?)])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|_, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let (a, b) = (g.x(0)?, g.x(1)?);
            // `grad_of` lets FusedMatMul restore the dims MatMul dropped for 1-D operands
            if g.wants(0) {
                let d = fused(g, dy, b, false, true, 1.0, Some((a, 0)));
                g.set(0, d);
            }
            if g.wants(1) {
                let d = fused(g, a, dy, true, false, 1.0, Some((b, 1)));
                g.set(1, d);
            }
            Ok(())
        })
    }
}

/// FusedMatMul's (A shape, B shape, target shape) with MatMul's dropped 1-D dims restored.
pub type FusedShapes = (Vec<usize>, Vec<usize>, Option<Vec<usize>>);

/// FusedMatMul's operand and target shapes with MatMul's dropped 1-D dims restored.
///
/// With `grad_of` = 0 the node computes dA = dY·Bᵀ (inputs dY, B; target A's shape), with
/// `grad_of` = 1 it computes dB = Aᵀ·dY (inputs A, dY; target B's shape). Where A or B is 1-D,
/// MatMul dropped a dim of Y (M at -2 for a 1-D A, N at -1 for a 1-D B); here dY gets it back,
/// the 1-D operand becomes [1, K] (A) or [K, 1] (B), and so does the target. Without `grad_of`
/// (or with 2-D+ operands) the shapes are returned unchanged. Same memory layout either way.
pub fn fused_shapes(node: &Node, a: &[usize], b: &[usize], target: Option<&[usize]>) -> Result<FusedShapes> {
    let which = node.attrs.int("grad_of", -1)?;
    let (Some(t), 0 | 1) = (target, which) else { return Ok((a.to_vec(), b.to_vec(), target.map(|t| t.to_vec()))) };
    let (ra, rb) = if which == 0 { (t.len(), b.len()) } else { (a.len(), t.len()) };
    let dy = if which == 0 { a } else { b };
    let mut dy2 = dy.to_vec();
    if ra == 1 && rb == 1 {
        dy2 = vec![1, 1];
    } else if ra == 1 {
        dy2.insert(dy2.len().saturating_sub(1), 1);
    } else if rb == 1 {
        dy2.push(1);
    }
    let row = |v: &[usize]| if v.len() == 1 { vec![1, v[0]] } else { v.to_vec() };
    let col = |v: &[usize]| if v.len() == 1 { vec![v[0], 1] } else { v.to_vec() };
    Ok(if which == 0 { (dy2, col(b), Some(row(t))) } else { (row(a), dy2, Some(col(t))) })
}

/// Adds FusedMatMul(a, b) whose result is summed to the shape of `like`: (value, which MatMul
/// operand's gradient this is, see `fused_shapes`; negative: operands of rank ≥ 2, no dims to
/// restore, no `grad_of`).
fn fused(
    g: &mut GradCtx,
    a: crate::ir::ValueId,
    b: crate::ir::ValueId,
    ta: bool,
    tb: bool,
    alpha: f32,
    like: Option<(crate::ir::ValueId, i64)>,
) -> crate::ir::ValueId {
    let attrs =
        Attrs::default().with("transA", Attr::Int(ta as i64)).with("transB", Attr::Int(tb as i64)).with("alpha", Attr::Float(alpha));
    match like {
        Some((l, which)) => {
            let s = g.shape_of(l);
            let attrs = if which >= 0 { attrs.with("grad_of", Attr::Int(which)) } else { attrs };
            g.op("FusedMatMul", &[a, b, s], attrs)
        }
        None => g.op("FusedMatMul", &[a, b], attrs),
    }
}

/// The element type a FusedMatMul writes: its operands', or f32 where attribute `to` says so
/// (16-bit or f32 operands only: the GPU's products accumulate in f32 and write it).
pub fn fused_output_type(node: &Node, operands: DType) -> Result<DType> {
    let Some(code) = node.attrs.get("to").map(|_| node.attrs.int("to", 0)).transpose()? else { return Ok(operands) };
    match DType::from_onnx(code as i32) {
        Some(DType::F32) if operands == DType::F32 || operands.is_half() => Ok(DType::F32),
        to => Err(node.err(format!(
            "`to` must be float32 ({}) over float32 or 16-bit operands, got {code} ({}) over {}",
            DType::F32.onnx_code(),
            to.map_or("unknown", |t| t.name()),
            operands.name()
        ))),
    }
}

struct FusedMatMul;
impl OpDef for FusedMatMul {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let (a, b) = (input(node, inputs, 0)?, input(node, inputs, 1)?);
        same_element_type(node, inputs, &[0, 1])?;
        let out_type = fused_output_type(node, a.dtype)?;
        let ta = node.attrs.int("transA", 0)? != 0;
        let tb = node.attrs.int("transB", 0)? != 0;
        if inputs.get(2).is_some_and(|x| x.is_some()) {
            let target: Vec<usize> = const_ints(node, &inputs[2], "target shape")?.into_iter().map(|d| d as usize).collect();
            let (a2, b2, t2) = fused_shapes(node, a.shape, b.shape, Some(&target))?;
            let full = matmul_shape(node, &a2, &b2, ta, tb)?;
            let t2 = t2.unwrap_or_default();
            if t2.len() < 2 || full.len() < 2 || t2[t2.len() - 2..] != full[full.len() - 2..] {
                return Err(node.err(format!("target shape {target:?} does not end like the product {full:?}")));
            }
            return Ok(vec![TypeOut::new(out_type, target)]);
        }
        Ok(vec![TypeOut::new(out_type, matmul_shape(node, a.shape, b.shape, ta, tb)?)])
    }
    /// A forward FusedMatMul (passes/fold_matmul_transpose.rs: operands of rank ≥ 2, no target,
    /// no `to`): Gemm's rule, each gradient summed to its operand's shape over broadcast batches.
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            if node.input(2).is_some() || node.attrs.get("to").is_some() || node.attrs.get("grad_of").is_some() {
                return Err(node.err("a gradient's own FusedMatMul (a target shape, `to` or `grad_of`) has no gradient rule"));
            }
            let (a, b) = (g.x(0)?, g.x(1)?);
            let ta = node.attrs.int("transA", 0)? != 0;
            let tb = node.attrs.int("transB", 0)? != 0;
            let alpha = node.attrs.float("alpha", 1.0)?;
            if g.wants(0) {
                let like = Some((a, -1));
                let d = if !ta { fused(g, dy, b, false, !tb, alpha, like) } else { fused(g, b, dy, tb, true, alpha, like) };
                g.set(0, d);
            }
            if g.wants(1) {
                let like = Some((b, -1));
                let d = if !tb { fused(g, a, dy, !ta, false, alpha, like) } else { fused(g, dy, a, true, ta, alpha, like) };
                g.set(1, d);
            }
            Ok(())
        })
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[2]
    }
}

struct Gemm;
impl OpDef for Gemm {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let (a, b) = (input(node, inputs, 0)?, input(node, inputs, 1)?);
        if a.shape.len() != 2 || b.shape.len() != 2 {
            return Err(node.err(format!("A and B must be 2-D, got {:?} and {:?}", a.shape, b.shape)));
        }
        same_element_type(node, inputs, &[0, 1, 2])?;
        let ta = node.attrs.int("transA", 0)? != 0;
        let tb = node.attrs.int("transB", 0)? != 0;
        let out = matmul_shape(node, a.shape, b.shape, ta, tb)?;
        if let Some(Some(c)) = inputs.get(2) {
            broadcast_shapes(node, &[c.shape, &out])?;
        }
        Ok(vec![TypeOut::new(a.dtype, out)])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let (a, b) = (g.x(0)?, g.x(1)?);
            let ta = node.attrs.int("transA", 0)? != 0;
            let tb = node.attrs.int("transB", 0)? != 0;
            let alpha = node.attrs.float("alpha", 1.0)?;
            let beta = node.attrs.float("beta", 1.0)?;
            if g.wants(0) {
                let d = if !ta { fused(g, dy, b, false, !tb, alpha, None) } else { fused(g, b, dy, tb, true, alpha, None) };
                g.set(0, d);
            }
            if g.wants(1) {
                let d = if !tb { fused(g, a, dy, !ta, false, alpha, None) } else { fused(g, dy, a, true, ta, alpha, None) };
                g.set(1, d);
            }
            if g.wants(2) {
                let c = g.x(2)?;
                let scaled = if beta == 1.0 { dy } else { g.affine(dy, beta, 0.0) };
                let d = g.sum_to(scaled, c);
                g.set(2, d);
            }
            Ok(())
        })
    }
}

pub fn register(r: &mut Registry) {
    r.add("MatMul", MatMul);
    r.add("Gemm", Gemm);
    r.internal("FusedMatMul", FusedMatMul);
}
