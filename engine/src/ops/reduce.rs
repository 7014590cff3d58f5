//! Reductions: ReduceSum, ReduceMean, ReduceMax, ReduceMin (axes as attribute or, from opset
//! 13/18 on, as input; keepdims; noop_with_empty_axes), and the internal ReduceGrad.

use super::util::{const_ints, input, norm_axis};
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::{Attr, Node};

/// The reduced axes of a Reduce* node for an input of rank `rank`.
pub fn reduce_axes(node: &Node, inputs: &[Option<InferIn>], rank: usize) -> Result<Vec<usize>> {
    let raw = match inputs.get(1) {
        Some(Some(_)) => Some(const_ints(node, &inputs[1], "axes")?),
        _ => node.attrs.ints("axes")?,
    };
    let raw = raw.filter(|v| !v.is_empty());
    match raw {
        None if node.attrs.int("noop_with_empty_axes", 0)? != 0 => Ok(vec![]),
        None => Ok((0..rank).collect()),
        Some(v) => {
            let mut a = v.iter().map(|&x| norm_axis(node, x, rank)).collect::<Result<Vec<_>>>()?;
            a.sort_unstable();
            a.dedup();
            Ok(a)
        }
    }
}

/// Output shape with reduced axes kept as 1 (`keep`) and the final shape.
pub fn reduced_shapes(shape: &[usize], axes: &[usize], keepdims: bool) -> (Vec<usize>, Vec<usize>) {
    let keep: Vec<usize> = shape.iter().enumerate().map(|(i, &d)| if axes.contains(&i) { 1 } else { d }).collect();
    let out = if keepdims { keep.clone() } else { shape.iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, &d)| d).collect() };
    (keep, out)
}

struct Reduce {
    grad: Option<fn(&Node, &mut GradCtx) -> Result<()>>,
}
impl OpDef for Reduce {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let axes = reduce_axes(node, inputs, x.shape.len())?;
        let keepdims = node.attrs.int("keepdims", 1)? != 0;
        Ok(vec![TypeOut::new(x.dtype, reduced_shapes(x.shape, &axes, keepdims).1)])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        self.grad
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[1]
    }
}

fn grad_sum_mean(node: &Node, g: &mut GradCtx) -> Result<()> {
    let Some(dy) = g.dy(0) else { return Ok(()) };
    let x = g.x(0)?;
    let s = g.shape_of(x);
    let mut attrs = node.attrs.clone();
    attrs.set("mean", Attr::Int((node.op_type == "ReduceMean") as i64));
    let d = g.op_n("ReduceGrad", vec![Some(dy), Some(s), node.input(1)], attrs, 1)[0];
    g.set(0, d);
    Ok(())
}

/// ReduceGrad(dy, x_shape, axes?): dy broadcast back over the reduced axes (÷ count for mean).
struct ReduceGrad;
impl OpDef for ReduceGrad {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let dy = input(node, inputs, 0)?;
        let s: Vec<usize> = const_ints(node, &inputs[1], "shape")?.into_iter().map(|d| d as usize).collect();
        Ok(vec![TypeOut::new(dy.dtype, s)])
    }
}

pub fn register(r: &mut Registry) {
    r.add("ReduceSum", Reduce { grad: Some(grad_sum_mean) });
    r.add("ReduceMean", Reduce { grad: Some(grad_sum_mean) });
    r.add("ReduceMax", Reduce { grad: None });
    r.add("ReduceMin", Reduce { grad: None });
    r.internal("ReduceGrad", ReduceGrad);
}
