//! RmsNorm (internal, made by passes/fuse_rms_norm.rs): Y = X · r [· scale] over the last axis,
//! r = 1 / √(mean(X²) + epsilon), what Llama-style models write as Pow, ReduceMean, Add, Sqrt,
//! Reciprocal and two Muls. Outputs Y (X's type and shape) and InvRms (r per row: X's shape with
//! a last dim of 1, f32, or f64 for f64 X), which the gradient reads instead of recomputing.
//!
//! RmsNormGrad(dY, X, scale?, InvRms) -> (dX, dscale?) (dscale only if asked for: a second
//! output) with, per row of n,
//! dX = r · (scale ∘ dY) − X · r³ · Σ(scale ∘ dY ∘ X) / n and dscale = Σ over rows of dY ∘ X · r
//! (the scale has the row's shape, [n]: the pass fuses no other).

use super::util::input;
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::DType;

/// (rows, row length) of an RmsNorm over `shape`; the scale, if given, must hold one value per
/// element of a row.
pub fn rms_norm_layout(node: &Node, x: &[usize], scale: Option<&[usize]>) -> Result<(usize, usize)> {
    let Some((&n, outer)) = x.split_last() else {
        return Err(node.err("RmsNorm normalises the last axis: X must have rank >= 1"));
    };
    if let Some(s) = scale {
        if s != [n] {
            return Err(node.err(format!("the scale {s:?} is not one value per element of X's rows, [{n}] (X {x:?})")));
        }
    }
    Ok((outer.iter().product(), n))
}

fn float_input<'a>(node: &Node, inputs: &'a [Option<InferIn<'a>>], i: usize) -> Result<&'a InferIn<'a>> {
    let x = input(node, inputs, i)?;
    if !x.dtype.is_float() {
        return Err(node.err(format!("input {i} is {}, RmsNorm takes float tensors", x.dtype.name())));
    }
    Ok(x)
}

/// The type of InvRms for X of type `x`.
pub fn stat_type(x: DType) -> DType {
    if x == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

struct RmsNorm;
impl OpDef for RmsNorm {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = float_input(node, inputs, 0)?;
        let scale = inputs.get(1).and_then(|s| s.as_ref());
        if let Some(s) = scale.filter(|s| s.dtype != x.dtype) {
            return Err(node.err(format!("the scale is {}, X is {}", s.dtype.name(), x.dtype.name())));
        }
        rms_norm_layout(node, x.shape, scale.map(|s| s.shape))?;
        let mut stat = x.shape.to_vec();
        if let Some(last) = stat.last_mut() {
            *last = 1;
        }
        Ok(vec![TypeOut::like(x), TypeOut::new(stat_type(x.dtype), stat)])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let scale = g.x_opt(1);
            // a frozen scale (LoRA's norms) gets no gradient: the kernel then sums none
            let scale_grad = scale.is_some() && g.wants(1);
            let ins = vec![Some(dy), Some(g.x(0)?), scale, Some(g.y(1))];
            let outs = g.op_n("RmsNormGrad", ins, node.attrs.clone(), 1 + scale_grad as usize);
            if g.wants(0) {
                g.set(0, outs[0]);
            }
            if scale_grad {
                g.set(1, outs[1]);
            }
            Ok(())
        })
    }
}

struct RmsNormGrad;
impl OpDef for RmsNormGrad {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let (dy, x) = (float_input(node, inputs, 0)?, float_input(node, inputs, 1)?);
        let scale = inputs.get(2).and_then(|s| s.as_ref());
        let r = float_input(node, inputs, 3)?;
        if dy.dtype != x.dtype || dy.shape != x.shape {
            return Err(node.err(format!("dY is {} {:?}, X {} {:?}: they must match", dy.dtype.name(), dy.shape, x.dtype.name(), x.shape)));
        }
        let (rows, _) = rms_norm_layout(node, x.shape, scale.map(|s| s.shape))?;
        if r.dtype != stat_type(x.dtype) || r.shape.iter().product::<usize>() != rows {
            return Err(node.err(format!(
                "InvRms is {} {:?}: one {} per row of X {:?}",
                r.dtype.name(),
                r.shape,
                stat_type(x.dtype).name(),
                x.shape
            )));
        }
        // dscale when the node asks for it (a second output; a probe node without outputs asks
        // for every type)
        let mut outs = vec![TypeOut::like(x)];
        if node.outputs.len() != 1 {
            outs.extend(scale.map(TypeOut::like));
        }
        Ok(outs)
    }
}

pub fn register(r: &mut Registry) {
    r.internal("RmsNorm", RmsNorm);
    r.internal("RmsNormGrad", RmsNormGrad);
}
