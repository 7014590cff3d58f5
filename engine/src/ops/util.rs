//! Shape helpers shared by op families: broadcasting, axis normalisation, reading shape inputs.

use crate::error::{Error, Result};
use crate::ir::Node;
use crate::tensor::Tensor;

use super::InferIn;

/// Numpy-style multidirectional broadcast of several shapes.
pub fn broadcast_shapes(node: &Node, shapes: &[&[usize]]) -> Result<Vec<usize>> {
    let rank = shapes.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut out = vec![1usize; rank];
    for s in shapes {
        let off = rank - s.len();
        for (i, &d) in s.iter().enumerate() {
            let o = &mut out[off + i];
            if *o == 1 {
                *o = d;
            } else if d != 1 && d != *o {
                return Err(node.err(format!("shapes {:?} cannot be broadcast together", shapes)));
            }
        }
    }
    // a zero-sized dim broadcast against 1 stays zero
    for s in shapes {
        let off = rank - s.len();
        for (i, &d) in s.iter().enumerate() {
            if d == 0 {
                out[off + i] = 0;
            }
        }
    }
    Ok(out)
}

/// A possibly negative axis in [-rank, rank) to [0, rank).
pub fn norm_axis(node: &Node, axis: i64, rank: usize) -> Result<usize> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    if a < 0 || a >= r.max(1) && !(r == 0 && a == 0) {
        return Err(node.err(format!("axis {axis} is out of range for rank {rank}")));
    }
    Ok(a as usize)
}

/// The input's value as i64s; an error if it is not known at plan time.
pub fn const_ints(node: &Node, inp: &Option<InferIn>, what: &str) -> Result<Vec<i64>> {
    let i = inp.as_ref().ok_or_else(|| node.err(format!("{what} input is required")))?;
    let v = i.value.ok_or_else(|| node.err(format!("{what} must be computable before the step (it depends on data)")))?;
    v.to_i64_vec().ok_or_else(|| node.err(format!("{what} must be an integer tensor")))
}

pub fn input<'a>(node: &Node, inputs: &'a [Option<InferIn<'a>>], i: usize) -> Result<&'a InferIn<'a>> {
    inputs.get(i).and_then(|x| x.as_ref()).ok_or_else(|| node.err(format!("input {i} is required")))
}

/// Strides (in elements) of a contiguous row-major shape.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Axes attribute (or, from opset 13 on for some ops, an axes input) as normalised, sorted axes.
pub fn axes_of(node: &Node, from_input: Option<&Tensor>, attr: Option<Vec<i64>>, rank: usize) -> Result<Option<Vec<usize>>> {
    let raw = match (from_input, attr) {
        (Some(t), _) => Some(t.to_i64_vec().ok_or_else(|| node.err("axes must be integers"))?),
        (None, a) => a,
    };
    match raw {
        None => Ok(None),
        Some(v) => {
            let mut axes = v.iter().map(|&a| norm_axis(node, a, rank)).collect::<Result<Vec<_>>>()?;
            axes.sort_unstable();
            axes.dedup();
            Ok(Some(axes))
        }
    }
}

pub fn err_dtype(node: &Node, what: &str, got: crate::tensor::DType) -> Error {
    node.err(format!("{what} has unsupported element type {}", got.name()))
}

/// The operands `which` (those present) share one element type: a product of mixed types is a
/// graph bug (a pass that cast some operands only), which the kernels would read as garbage.
pub fn same_element_type(node: &Node, inputs: &[Option<InferIn>], which: &[usize]) -> Result<()> {
    let mut typed = which.iter().filter_map(|&i| inputs.get(i).and_then(|x| x.as_ref()).map(|x| (i, x.dtype)));
    let Some((i0, t0)) = typed.next() else { return Ok(()) };
    match typed.find(|&(_, t)| t != t0) {
        Some((i, t)) => Err(node.err(format!("operands have different element types (input {i0} {}, input {i} {})", t0.name(), t.name()))),
        None => Ok(()),
    }
}
