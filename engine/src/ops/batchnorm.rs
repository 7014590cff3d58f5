//! BatchNormalization (opset 15) over [N, C, D...] (channel axis 1): inputs X, scale, B,
//! input_mean, input_var; attributes epsilon, momentum, training_mode.
//! - inference (training_mode 0): y = (x − input_mean) / √(input_var + ε) · scale + B.
//! - training: batch statistics over every axis but 1 (biased variance) normalise x, and the
//!   optional outputs running_mean = input_mean·momentum + mean·(1 − momentum),
//!   running_var = input_var·momentum + var·(1 − momentum).
//!   ortrain extension: attribute `unbiased_running_var` = 1 uses the unbiased batch variance
//!   (·n/(n−1)) in running_var, as PyTorch does; the Python runner sets it for PyTorch models.
//!
//! Gradient: the internal BatchNormGrad(dy, x, scale, input_mean, input_var) -> (dx, dscale,
//! dbias), which recomputes the batch statistics from x in training mode (nothing is stashed).
//! input_mean and input_var are buffers: no gradient flows to them.

use super::util::input;
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::Node;

/// (channels, per-channel element count over N and the spatial axes) of a BatchNorm input.
pub fn batch_norm_layout(node: &Node, x: &[usize]) -> Result<(usize, usize)> {
    if x.len() < 2 {
        return Err(node.err(format!("input {x:?} must be [N, C, ...]")));
    }
    Ok((x[1], x[0] * x[2..].iter().product::<usize>()))
}

fn check_params(node: &Node, inputs: &[Option<InferIn>], from: usize, to: usize) -> Result<()> {
    let x = input(node, inputs, 0)?;
    let c = x.shape.get(1).copied().unwrap_or(0);
    for i in from..to {
        let p = input(node, inputs, i)?;
        if p.shape != [c] || p.dtype != x.dtype {
            return Err(node.err(format!("input {i} is {:?} {}, expected [{c}] {}", p.shape, p.dtype.name(), x.dtype.name())));
        }
    }
    Ok(())
}

struct BatchNorm;
impl OpDef for BatchNorm {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        if !x.dtype.is_float() {
            return Err(node.err(format!("input must be float32 or float64, got {}", x.dtype.name())));
        }
        let (c, _) = batch_norm_layout(node, x.shape)?;
        check_params(node, inputs, 1, 5)?;
        let training = node.attrs.int("training_mode", 0).map_err(|e| node.err(e.to_string()))? != 0;
        if node.outputs.len() > 3 {
            return Err(node.err("the saved_mean/saved_var outputs of BatchNormalization before opset 14 are not supported"));
        }
        if !training && node.outputs.len() > 1 {
            return Err(node.err("running_mean/running_var outputs need training_mode=1"));
        }
        Ok(vec![TypeOut::like(x), TypeOut::new(x.dtype, vec![c]), TypeOut::new(x.dtype, vec![c])])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let ins = vec![Some(dy), Some(g.x(0)?), Some(g.x(1)?), Some(g.x(3)?), Some(g.x(4)?)];
            let mut attrs = node.attrs.clone();
            attrs.0.retain(|(k, _)| k == "epsilon" || k == "training_mode");
            let outs = g.op_n("BatchNormGrad", ins, attrs, 3);
            for (i, &o) in outs.iter().enumerate() {
                g.set(i, o);
            }
            Ok(())
        })
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[3, 4]
    }
}

struct BatchNormGrad;
impl OpDef for BatchNormGrad {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let dy = input(node, inputs, 0)?;
        let x = input(node, inputs, 1)?;
        if dy.shape != x.shape {
            return Err(node.err(format!("dy {:?} and x {:?} differ", dy.shape, x.shape)));
        }
        let (c, _) = batch_norm_layout(node, x.shape)?;
        Ok(vec![TypeOut::like(x), TypeOut::new(x.dtype, vec![c]), TypeOut::new(x.dtype, vec![c])])
    }
}

pub fn register(r: &mut Registry) {
    r.add("BatchNormalization", BatchNorm);
    r.internal("BatchNormGrad", BatchNormGrad);
}
