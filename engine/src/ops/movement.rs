//! Data movement: Reshape, Flatten, Squeeze, Unsqueeze, Transpose, Expand, Concat, Split, Slice,
//! Gather, GatherElements, Trilu; and their internal gradient helpers (SliceGrad, ConcatGrad,
//! GatherGrad, GatherElementsGrad). Spec: Reshape-14, Squeeze-13, Slice-13, Gather-13, Trilu-14.

use super::util::{broadcast_shapes, const_ints, input, norm_axis, numel};
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::{Attr, Attrs, Node};
use crate::tensor::DType;

type Rule = fn(&Node, &mut GradCtx) -> Result<()>;

/// Ops whose gradient is `Reshape(dy, Shape(x))`.
fn grad_reshape_back(_: &Node, g: &mut GradCtx) -> Result<()> {
    if let Some(dy) = g.dy(0) {
        let x = g.x(0)?;
        let s = g.shape_of(x);
        let d = g.op("Reshape", &[dy, s], Attrs::default());
        g.set(0, d);
    }
    Ok(())
}

struct Reshape;
impl OpDef for Reshape {
    fn is_view(&self) -> bool {
        true
    }
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let spec = const_ints(node, &inputs[1], "shape")?;
        let allowzero = node.attrs.int("allowzero", 0)? != 0;
        let mut out = Vec::with_capacity(spec.len());
        let mut infer_at = None;
        for (i, &d) in spec.iter().enumerate() {
            match d {
                -1 if infer_at.is_none() => {
                    infer_at = Some(i);
                    out.push(1);
                }
                0 if !allowzero => out.push(
                    *x.shape
                        .get(i)
                        .ok_or_else(|| node.err(format!("shape {spec:?} copies dim {i} of the rank-{} input", x.shape.len())))?,
                ),
                d if d >= 0 => out.push(d as usize),
                _ => return Err(node.err(format!("invalid target shape {spec:?}"))),
            }
        }
        let total = numel(x.shape);
        if let Some(i) = infer_at {
            let known: usize = out.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, &d)| d).product();
            if known == 0 || !total.is_multiple_of(known) {
                return Err(node.err(format!("cannot reshape {:?} to {spec:?}", x.shape)));
            }
            out[i] = total / known;
        }
        if numel(&out) != total {
            return Err(node.err(format!("cannot reshape {:?} ({total} elements) to {spec:?}", x.shape)));
        }
        Ok(vec![TypeOut::new(x.dtype, out)])
    }
    fn gradient(&self) -> Option<Rule> {
        Some(grad_reshape_back)
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[1]
    }
}

struct Flatten;
impl OpDef for Flatten {
    fn is_view(&self) -> bool {
        true
    }
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let r = x.shape.len();
        let axis = node.attrs.int("axis", 1)?;
        let a = if axis < 0 { axis + r as i64 } else { axis };
        if a < 0 || a > r as i64 {
            return Err(node.err(format!("axis {axis} out of range for rank {r}")));
        }
        let a = a as usize;
        Ok(vec![TypeOut::new(x.dtype, vec![numel(&x.shape[..a]), numel(&x.shape[a..])])])
    }
    fn gradient(&self) -> Option<Rule> {
        Some(grad_reshape_back)
    }
}

/// Axes from the `axes` input (opset ≥ 13) or attribute (older opsets).
fn axes_input_or_attr(node: &Node, inputs: &[Option<InferIn>]) -> Result<Option<Vec<i64>>> {
    match inputs.get(1) {
        Some(Some(_)) => Ok(Some(const_ints(node, &inputs[1], "axes")?)),
        _ => node.attrs.ints("axes"),
    }
}

struct Squeeze;
impl OpDef for Squeeze {
    fn is_view(&self) -> bool {
        true
    }
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let out = match axes_input_or_attr(node, inputs)? {
            None => x.shape.iter().copied().filter(|&d| d != 1).collect(),
            Some(axes) => {
                let axes = axes.iter().map(|&a| norm_axis(node, a, x.shape.len())).collect::<Result<Vec<_>>>()?;
                for &a in &axes {
                    if x.shape[a] != 1 {
                        return Err(node.err(format!("cannot squeeze axis {a} of size {}", x.shape[a])));
                    }
                }
                x.shape.iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, &d)| d).collect()
            }
        };
        Ok(vec![TypeOut::new(x.dtype, out)])
    }
    fn gradient(&self) -> Option<Rule> {
        Some(grad_reshape_back)
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[1]
    }
}

struct Unsqueeze;
impl OpDef for Unsqueeze {
    fn is_view(&self) -> bool {
        true
    }
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let axes = axes_input_or_attr(node, inputs)?.ok_or_else(|| node.err("axes are required"))?;
        let r = x.shape.len() + axes.len();
        let mut axes = axes.iter().map(|&a| norm_axis(node, a, r)).collect::<Result<Vec<_>>>()?;
        axes.sort_unstable();
        let mut src = x.shape.iter();
        let out = (0..r).map(|i| if axes.contains(&i) { 1 } else { src.next().copied().unwrap_or(1) }).collect();
        Ok(vec![TypeOut::new(x.dtype, out)])
    }
    fn gradient(&self) -> Option<Rule> {
        Some(grad_reshape_back)
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[1]
    }
}

pub fn perm_of(node: &Node, rank: usize) -> Result<Vec<usize>> {
    match node.attrs.ints("perm")? {
        None => Ok((0..rank).rev().collect()),
        Some(p) => {
            let p: Vec<usize> = p.iter().map(|&a| norm_axis(node, a, rank)).collect::<Result<_>>()?;
            let mut seen = vec![false; rank];
            for &a in &p {
                if seen[a] {
                    return Err(node.err(format!("perm {p:?} is not a permutation")));
                }
                seen[a] = true;
            }
            if p.len() != rank {
                return Err(node.err(format!("perm {p:?} does not match rank {rank}")));
            }
            Ok(p)
        }
    }
}

struct Transpose;
impl OpDef for Transpose {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let p = perm_of(node, x.shape.len())?;
        Ok(vec![TypeOut::new(x.dtype, p.iter().map(|&a| x.shape[a]).collect())])
    }
    fn gradient(&self) -> Option<Rule> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            // the inverse permutation; without perm the reversal is its own inverse
            let attrs = match node.attrs.ints("perm")? {
                None => Attrs::default(),
                Some(p) => {
                    let mut inv = vec![0i64; p.len()];
                    for (i, &a) in p.iter().enumerate() {
                        let a = if a < 0 { a + p.len() as i64 } else { a };
                        inv[a as usize] = i as i64;
                    }
                    Attrs::default().with("perm", Attr::Ints(inv))
                }
            };
            let d = g.op("Transpose", &[dy], attrs);
            g.set(0, d);
            Ok(())
        })
    }
}

struct Expand;
impl OpDef for Expand {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let s: Vec<usize> = const_ints(node, &inputs[1], "shape")?.into_iter().map(|d| d.max(0) as usize).collect();
        Ok(vec![TypeOut::new(x.dtype, broadcast_shapes(node, &[x.shape, &s])?)])
    }
    fn gradient(&self) -> Option<Rule> {
        Some(|_, g| {
            if let Some(dy) = g.dy(0) {
                let x = g.x(0)?;
                let d = g.sum_to(dy, x);
                g.set(0, d);
            }
            Ok(())
        })
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[1]
    }
}

struct Concat;
impl OpDef for Concat {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let first = input(node, inputs, 0)?;
        let r = first.shape.len();
        let axis = norm_axis(node, node.attrs.req_int("axis").map_err(|e| node.err(e.to_string()))?, r)?;
        let mut out = first.shape.to_vec();
        out[axis] = 0;
        for i in inputs.iter().flatten() {
            if i.shape.len() != r || i.shape.iter().enumerate().any(|(k, &d)| k != axis && d != first.shape[k]) || i.dtype != first.dtype {
                return Err(node.err(format!("inputs {:?} and {:?} cannot be concatenated on axis {axis}", first.shape, i.shape)));
            }
            out[axis] += i.shape[axis];
        }
        Ok(vec![TypeOut::new(first.dtype, out)])
    }
    fn gradient(&self) -> Option<Rule> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let shapes: Vec<_> = (0..node.inputs.len()).map(|i| g.x(i)).collect::<Result<_>>()?;
            let shapes: Vec<_> = shapes.into_iter().map(|x| g.shape_of(x)).collect();
            for i in 0..node.inputs.len() {
                if g.wants(i) {
                    let mut ins = vec![dy];
                    ins.extend(&shapes);
                    let attrs = Attrs::default()
                        .with("axis", node.attrs.get("axis").cloned().unwrap_or(Attr::Int(0)))
                        .with("index", Attr::Int(i as i64));
                    let d = g.op("ConcatGrad", &ins, attrs);
                    g.set(i, d);
                }
            }
            Ok(())
        })
    }
}

/// ConcatGrad(dy, shape_0..shape_n): the part of dy that came from input `index`.
struct ConcatGrad;
impl OpDef for ConcatGrad {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let dy = input(node, inputs, 0)?;
        let idx = node.attrs.req_int("index")? as usize;
        let s: Vec<usize> = const_ints(node, &inputs[1 + idx], "shape")?.into_iter().map(|d| d as usize).collect();
        Ok(vec![TypeOut::new(dy.dtype, s)])
    }
}

/// Split sizes from the `split` input/attribute or `num_outputs`, even split otherwise.
pub fn split_sizes(node: &Node, inputs: &[Option<InferIn>], dim: usize) -> Result<Vec<usize>> {
    let explicit = match inputs.get(1) {
        Some(Some(_)) => Some(const_ints(node, &inputs[1], "split")?),
        _ => node.attrs.ints("split")?,
    };
    let n = node.outputs.len();
    let sizes: Vec<usize> = match explicit {
        Some(v) => v.into_iter().map(|d| d.max(0) as usize).collect(),
        None => {
            let chunk = dim.div_ceil(n.max(1));
            (0..n).map(|i| chunk.min(dim.saturating_sub(i * chunk))).collect()
        }
    };
    if sizes.len() != n || sizes.iter().sum::<usize>() != dim {
        return Err(node.err(format!("split sizes {sizes:?} do not cover dimension {dim} with {n} outputs")));
    }
    Ok(sizes)
}

struct Split;
impl OpDef for Split {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let axis = norm_axis(node, node.attrs.int("axis", 0)?, x.shape.len())?;
        let sizes = split_sizes(node, inputs, x.shape[axis])?;
        Ok(sizes
            .into_iter()
            .map(|s| {
                let mut sh = x.shape.to_vec();
                sh[axis] = s;
                TypeOut::new(x.dtype, sh)
            })
            .collect())
    }
    fn gradient(&self) -> Option<Rule> {
        Some(|node, g| {
            // dx = Concat of the output gradients, zeros where an output has none
            let mut parts = Vec::new();
            for i in 0..node.outputs.len() {
                let part = match g.dy(i) {
                    Some(d) => d,
                    None => {
                        let y = g.y(i);
                        g.affine(y, 0.0, 0.0)
                    }
                };
                parts.push(part);
            }
            let attrs = Attrs::default().with("axis", Attr::Int(node.attrs.int("axis", 0)?));
            let d = g.op("Concat", &parts, attrs);
            g.set(0, d);
            Ok(())
        })
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[1]
    }
}

/// Normalised slice parameters along every axis: (start, step, count).
pub fn slice_params(node: &Node, inputs: &[Option<InferIn>], shape: &[usize]) -> Result<Vec<(i64, i64, usize)>> {
    let r = shape.len();
    let starts = const_ints(node, &inputs[1], "starts")?;
    let ends = const_ints(node, &inputs[2], "ends")?;
    let axes = match inputs.get(3) {
        Some(Some(_)) => const_ints(node, &inputs[3], "axes")?,
        _ => (0..starts.len() as i64).collect(),
    };
    let steps = match inputs.get(4) {
        Some(Some(_)) => const_ints(node, &inputs[4], "steps")?,
        _ => vec![1; starts.len()],
    };
    if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
        return Err(node.err("starts, ends, axes and steps must have the same length"));
    }
    let mut p: Vec<(i64, i64, usize)> = shape.iter().map(|&d| (0, 1, d)).collect();
    for k in 0..starts.len() {
        let a = norm_axis(node, axes[k], r)?;
        let d = shape[a] as i64;
        let step = steps[k];
        if step == 0 {
            return Err(node.err("slice step 0"));
        }
        let clamp = |v: i64, lo: i64, hi: i64| v.max(lo).min(hi);
        let fix = |v: i64| if v < 0 { v + d } else { v };
        let (s, e) = if step > 0 {
            (clamp(fix(starts[k]), 0, d), clamp(fix(ends[k]), 0, d))
        } else {
            (clamp(fix(starts[k]), 0, d - 1), clamp(fix(ends[k]), -1, d - 1))
        };
        let count = if step > 0 { ((e - s).max(0) + step - 1) / step } else { ((s - e).max(0) + (-step) - 1) / (-step) };
        p[a] = (s, step, count as usize);
    }
    Ok(p)
}

struct Slice;
impl OpDef for Slice {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let p = slice_params(node, inputs, x.shape)?;
        Ok(vec![TypeOut::new(x.dtype, p.iter().map(|t| t.2).collect())])
    }
    fn gradient(&self) -> Option<Rule> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let x = g.x(0)?;
            let s = g.shape_of(x);
            let mut ins = vec![Some(dy), Some(s)];
            ins.extend(node.inputs[1..].iter().copied());
            let d = g.op_n("SliceGrad", ins, Attrs::default(), 1)[0];
            g.set(0, d);
            Ok(())
        })
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[1, 2, 3, 4]
    }
    /// A slice keeping every element in order (HF's `hidden_states[:, slice(0, None)]`): the
    /// plan shares its input's memory where the sizes agree.
    fn is_view_for(&self, _: &Node, inputs: &[Option<InferIn>]) -> bool {
        forward_steps(inputs, 4)
    }
}

/// Whether the steps input at `i` is absent or a constant of positive steps (with equal
/// sizes in and out, such a slice takes every element in order).
fn forward_steps(inputs: &[Option<InferIn>], i: usize) -> bool {
    match inputs.get(i) {
        None | Some(None) => true,
        Some(Some(x)) => x.value.and_then(|t| t.to_i64_vec()).is_some_and(|v| v.iter().all(|&s| s > 0)),
    }
}

/// SliceGrad(dy, x_shape, starts, ends, axes?, steps?): dy scattered into zeros of x's shape.
struct SliceGrad;
impl OpDef for SliceGrad {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let dy = input(node, inputs, 0)?;
        let s: Vec<usize> = const_ints(node, &inputs[1], "shape")?.into_iter().map(|d| d as usize).collect();
        Ok(vec![TypeOut::new(dy.dtype, s)])
    }
    /// The gradient of a slice keeping everything in order is dy itself.
    fn is_view_for(&self, _: &Node, inputs: &[Option<InferIn>]) -> bool {
        forward_steps(inputs, 5)
    }
}

struct Gather;
impl OpDef for Gather {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let idx = input(node, inputs, 1)?;
        if !matches!(idx.dtype, DType::I64 | DType::I32) {
            return Err(node.err(format!("indices must be int64 or int32, got {}", idx.dtype.name())));
        }
        let axis = norm_axis(node, node.attrs.int("axis", 0)?, x.shape.len())?;
        let mut out = x.shape[..axis].to_vec();
        out.extend_from_slice(idx.shape);
        out.extend_from_slice(&x.shape[axis + 1..]);
        Ok(vec![TypeOut::new(x.dtype, out)])
    }
    fn gradient(&self) -> Option<Rule> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let (x, idx) = (g.x(0)?, g.x(1)?);
            let s = g.shape_of(x);
            let attrs = Attrs::default().with("axis", Attr::Int(node.attrs.int("axis", 0)?));
            let d = g.op("GatherGrad", &[dy, idx, s], attrs);
            g.set(0, d);
            Ok(())
        })
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[1]
    }
}

/// GatherGrad adds an index's rows in position order a segment of this many at a time, each
/// segment from zero, then the segments in order: both backends' order (the CUDA kernels sum a
/// long run's segments apart; kernels/gather.cu `ROWS_PER_SEGMENT` must equal it).
pub const GATHER_GRAD_SEGMENT: usize = 32;

/// GatherGrad(dy, indices, x_shape): scatter-add of dy rows into zeros of x's shape.
struct ShapedBy(usize);
impl OpDef for ShapedBy {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let dy = input(node, inputs, 0)?;
        let s: Vec<usize> = const_ints(node, &inputs[self.0], "shape")?.into_iter().map(|d| d as usize).collect();
        Ok(vec![TypeOut::new(dy.dtype, s)])
    }
}

struct GatherElements;
impl OpDef for GatherElements {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let idx = input(node, inputs, 1)?;
        if idx.shape.len() != x.shape.len() {
            return Err(node.err("indices must have the data's rank"));
        }
        norm_axis(node, node.attrs.int("axis", 0)?, x.shape.len())?;
        Ok(vec![TypeOut::new(x.dtype, idx.shape.to_vec())])
    }
    fn gradient(&self) -> Option<Rule> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let (x, idx) = (g.x(0)?, g.x(1)?);
            let s = g.shape_of(x);
            let attrs = Attrs::default().with("axis", Attr::Int(node.attrs.int("axis", 0)?));
            let d = g.op("GatherElementsGrad", &[dy, idx, s], attrs);
            g.set(0, d);
            Ok(())
        })
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[1]
    }
}

struct Trilu;
impl OpDef for Trilu {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        if x.shape.len() < 2 {
            return Err(node.err("input must have rank ≥ 2"));
        }
        Ok(vec![TypeOut::like(x)])
    }
    fn gradient(&self) -> Option<Rule> {
        Some(|node, g| {
            if let Some(dy) = g.dy(0) {
                let k = node.input(1);
                let d = g.op_n("Trilu", vec![Some(dy), k], node.attrs.clone(), 1)[0];
                g.set(0, d);
            }
            Ok(())
        })
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[1]
    }
}

pub fn register(r: &mut Registry) {
    r.add("Reshape", Reshape);
    r.add("Flatten", Flatten);
    r.add("Squeeze", Squeeze);
    r.add("Unsqueeze", Unsqueeze);
    r.add("Transpose", Transpose);
    r.add("Expand", Expand);
    r.add("Concat", Concat);
    r.add("Split", Split);
    r.add("Slice", Slice);
    r.add("Gather", Gather);
    r.add("GatherElements", GatherElements);
    r.add("Trilu", Trilu);
    r.internal("ConcatGrad", ConcatGrad);
    r.internal("SliceGrad", SliceGrad);
    r.internal("GatherGrad", ShapedBy(2));
    r.internal("GatherElementsGrad", ShapedBy(2));
}
