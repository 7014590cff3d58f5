//! LayerNormalization (opset 17; normalises over axes [axis, rank)) and its fused internal
//! gradient LayerNormGrad(dy, x, scale, mean?, inv_std_dev?) -> (dx, dscale, dbias). Where the
//! forward node gives its Mean and InvStdDev (ONNX's optional outputs; CUDA sessions add them,
//! passes/layer_norm_stats.rs), the gradient reads them; the CPU kernel recomputes them from x
//! whatever it is given. `y_type` (an ONNX type code, internal; passes/layer_norm_half.rs) makes
//! Y a 16-bit tensor computed in the input's precision and rounded once; its gradient's dy is
//! then 16-bit too. Two more internal parts of LayerNormGrad (passes/layer_norm_grad_sum.rs):
//! input 5, `dres`, the rest of the input's gradient (the residual stream's), of x's type and
//! shape, added to dx; and output 3, dx (with dres) rounded to the 16-bit `dx_half_type`. With
//! `dx_col_sum` = 1 (passes/layer_norm_grad_col_sum.rs) a last output holds the column sums of
//! dx (with dres) viewed as [rows, n]: n values of x's type, a following Linear's bias gradient.

use super::util::{input, norm_axis};
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::DType;

/// (rows, row length) of a LayerNormalization over `shape`.
pub fn layer_norm_layout(node: &Node, shape: &[usize]) -> Result<(usize, usize)> {
    let axis = norm_axis(node, node.attrs.int("axis", -1)?, shape.len())?;
    Ok((shape[..axis].iter().product(), shape[axis..].iter().product()))
}

/// The element type `attr` asks for (an ONNX code: a 16-bit float, from f32 X), or None where
/// the node has no such attribute.
fn half_type(node: &Node, attr: &str, x: DType) -> Result<Option<DType>> {
    match node.attrs.int(attr, 0)? {
        0 => Ok(None),
        code => match DType::from_onnx(code as i32) {
            Some(d) if d.is_half() && x == DType::F32 => Ok(Some(d)),
            _ => Err(node.err(format!("{attr} {code} on a {} input: only bf16 (16) or fp16 (10) from f32", x.name()))),
        },
    }
}

/// The output indices of LayerNormGrad's optional outputs after (dx, dscale, dbias), as its
/// attributes ask for them: dx's 16-bit copy (`dx_half_type`), then dx's column sums
/// (`dx_col_sum`).
pub fn layer_norm_grad_extras(node: &Node) -> Result<(Option<usize>, Option<usize>)> {
    let half = node.attrs.int("dx_half_type", 0)? != 0;
    let col_sum = match node.attrs.int("dx_col_sum", 0)? {
        0 => false,
        1 => true,
        v => return Err(node.err(format!("dx_col_sum is {v}: 0 or 1"))),
    };
    Ok((half.then_some(3), col_sum.then_some(3 + half as usize)))
}

/// How many outputs a LayerNormGrad with these `layer_norm_grad_extras` has.
pub fn layer_norm_grad_output_count(extras: (Option<usize>, Option<usize>)) -> usize {
    extras.1.or(extras.0).map_or(3, |last| last + 1)
}

/// The element type of a LayerNormalization's Y: `y_type` if given, else X's.
fn y_type(node: &Node, x: DType) -> Result<DType> {
    Ok(half_type(node, "y_type", x)?.unwrap_or(x))
}

struct LayerNorm;
impl OpDef for LayerNorm {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let (rows, n) = layer_norm_layout(node, x.shape)?;
        let s = input(node, inputs, 1)?;
        if s.shape.iter().product::<usize>() != n {
            return Err(node.err(format!("scale {:?} does not match the normalised size {n} of {:?}", s.shape, x.shape)));
        }
        let axis = norm_axis(node, node.attrs.int("axis", -1)?, x.shape.len())?;
        let mut stat = x.shape.to_vec();
        for d in stat.iter_mut().skip(axis) {
            *d = 1;
        }
        let _ = rows;
        let mut outs = vec![TypeOut::new(y_type(node, x.dtype)?, x.shape.to_vec())];
        for _ in 1..node.outputs.len() {
            outs.push(TypeOut::new(if x.dtype == DType::F64 { DType::F64 } else { DType::F32 }, stat.clone()));
        }
        Ok(outs)
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let (x, scale) = (g.x(0)?, g.x(1)?);
            let mut attrs = node.attrs.clone();
            attrs.0.retain(|(k, _)| k == "axis" || k == "epsilon");
            let mut ins = vec![Some(dy), Some(x), Some(scale)];
            if node.outputs.len() >= 3 {
                ins.extend([Some(g.y(1)), Some(g.y(2))]);
            }
            let outs = g.op_n("LayerNormGrad", ins, attrs, 3);
            g.set(0, outs[0]);
            g.set(1, outs[1]);
            g.set(2, outs[2]);
            Ok(())
        })
    }
}

struct LayerNormGrad;
impl OpDef for LayerNormGrad {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 1)?;
        let s = input(node, inputs, 2)?;
        if let Some(Some(dres)) = inputs.get(5) {
            if dres.dtype != x.dtype || dres.shape != x.shape {
                return Err(node.err(format!(
                    "the residual gradient (input 5) is {} {:?}; it must be x's type and shape, {} {:?}",
                    dres.dtype.name(),
                    dres.shape,
                    x.dtype.name(),
                    x.shape
                )));
            }
        }
        let mut outs = vec![TypeOut::like(x), TypeOut::like(s), TypeOut::like(s)];
        let (half, col_sum) = layer_norm_grad_extras(node)?;
        let want = layer_norm_grad_output_count((half, col_sum));
        // (a probe node without outputs asks for the types alone)
        if !node.outputs.is_empty() && node.outputs.len() != want {
            return Err(node.err(format!(
                "{} outputs; dx, dscale, dbias{}{} make {want}",
                node.outputs.len(),
                if half.is_some() { ", dx's 16-bit copy (dx_half_type)" } else { "" },
                if col_sum.is_some() { ", dx's column sums (dx_col_sum)" } else { "" }
            )));
        }
        if half.is_some() {
            let half = half_type(node, "dx_half_type", x.dtype)?.ok_or_else(|| node.err("dx_half_type is 0"))?;
            outs.push(TypeOut::new(half, x.shape.to_vec()));
        }
        if col_sum.is_some() {
            let (_, n) = layer_norm_layout(node, x.shape)?;
            outs.push(TypeOut::new(x.dtype, vec![n]));
        }
        Ok(outs)
    }
}

pub fn register(r: &mut Registry) {
    r.add("LayerNormalization", LayerNorm);
    r.internal("LayerNormGrad", LayerNormGrad);
}
