//! CPU kernels of ops/movement.rs. Most are dtype-agnostic copies of contiguous byte runs.

use rayon::prelude::*;
use std::collections::HashMap;

use super::broadcast::bcast_strides;
use super::elementwise::{first, identity, Arith};
use super::tensor_view::{Elem, In, Out};
use super::{CpuCtx, KernelTable, PAR_MIN};
use crate::error::Result;
use crate::ir::Node;
use crate::ops::movement::GATHER_GRAD_SEGMENT;
use crate::ops::util::{norm_axis, numel, strides};

fn nth<'a, 'b>(node: &Node, inputs: &'b [Option<In<'a>>], i: usize) -> Result<&'b In<'a>> {
    inputs.get(i).and_then(|x| x.as_ref()).ok_or_else(|| node.err(format!("input {i} missing")))
}

fn ints(node: &Node, inputs: &[Option<In>], i: usize) -> Result<Option<Vec<i64>>> {
    match inputs.get(i).and_then(|x| x.as_ref()) {
        None => Ok(None),
        Some(t) => Ok(Some(t.to_tensor().to_i64_vec().ok_or_else(|| node.err(format!("input {i} must be integers")))?)),
    }
}

/// Element-wise permuted copy, generic over the element's byte width.
fn transpose_typed<T: Elem + Default>(x: &In, o: &mut Out, perm: &[usize]) -> Result<()> {
    let xs = strides(x.shape);
    let oshape = o.shape.to_vec();
    let src = x.slice_bytes_as::<T>();
    let dst = o.slice_bytes_as::<T>();
    let inner = *oshape.last().unwrap_or(&1);
    let in_stride_inner = perm.last().map(|&p| xs[p]).unwrap_or(1);
    let src_strides: Vec<usize> = perm.iter().map(|&p| xs[p]).collect();
    let body = |r: usize, row: &mut [T]| {
        let mut rr = r;
        let mut off = 0;
        for d in (0..oshape.len().saturating_sub(1)).rev() {
            off += (rr % oshape[d]) * src_strides[d];
            rr /= oshape[d];
        }
        if in_stride_inner == 1 {
            // the last axis stays last (the attention heads' (1, 0, 2) moves): whole rows
            row.copy_from_slice(&src[off..off + row.len()]);
        } else {
            for (j, v) in row.iter_mut().enumerate() {
                *v = src[off + j * in_stride_inner];
            }
        }
    };
    if inner == 0 {
        return Ok(());
    }
    if dst.len() >= PAR_MIN {
        dst.par_chunks_mut(inner).enumerate().for_each(|(r, row)| body(r, row));
    } else {
        dst.chunks_mut(inner).enumerate().for_each(|(r, row)| body(r, row));
    }
    Ok(())
}

impl<'a> In<'a> {
    /// The data viewed as same-width plain elements (for dtype-agnostic copies).
    fn slice_bytes_as<T: Elem>(&self) -> &'a [T] {
        let b = self.bytes();
        // SAFETY: arena and tensor buffers are aligned to at least 8 bytes, and T has the
        // element's byte width (chosen by `by_width`), so the length divides exactly.
        unsafe { std::slice::from_raw_parts(b.as_ptr() as *const T, b.len() / std::mem::size_of::<T>()) }
    }
}
impl<'a> Out<'a> {
    fn slice_bytes_as<T: Elem>(&mut self) -> &mut [T] {
        let b = self.bytes();
        // SAFETY: as for In::slice_bytes_as.
        unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut T, b.len() / std::mem::size_of::<T>()) }
    }
}

macro_rules! by_width {
    ($dtype:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype.size() {
            1 => $f::<u8>($($arg),*),
            4 => $f::<i32>($($arg),*),
            _ => $f::<i64>($($arg),*),
        }
    };
}

fn transpose(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let perm = crate::ops::movement_perm(node, x.shape.len())?;
    by_width!(x.dtype, transpose_typed(x, &mut out[0], &perm))
}

fn expand_typed<T: Elem + Default>(x: &In, o: &mut Out) -> Result<()> {
    let oshape = o.shape.to_vec();
    let st = bcast_strides(x.shape, &oshape);
    let src = x.slice_bytes_as::<T>();
    let dst = o.slice_bytes_as::<T>();
    let inner = *oshape.last().unwrap_or(&1);
    let is = *st.last().unwrap_or(&0);
    if inner == 0 {
        return Ok(());
    }
    for (r, row) in dst.chunks_mut(inner).enumerate() {
        let mut rr = r;
        let mut off = 0;
        for d in (0..oshape.len().saturating_sub(1)).rev() {
            off += (rr % oshape[d]) * st[d];
            rr /= oshape[d];
        }
        if is == 1 {
            row.copy_from_slice(&src[off..off + inner]);
        } else {
            row.iter_mut().for_each(|v| *v = src[off]);
        }
    }
    Ok(())
}

fn expand(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    by_width!(x.dtype, expand_typed(x, &mut out[0]))
}

/// Copies block `k` of `parts` (each [outer, len_k·inner]) into/out of the concatenation.
fn concat(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let o = &mut out[0];
    let r = o.shape.len();
    let axis = norm_axis(node, node.attrs.req_int("axis")?, r)?;
    let es = o.dtype.size();
    let outer = numel(&o.shape[..axis]);
    let inner = numel(&o.shape[axis + 1..]) * es;
    let row = o.shape[axis] * inner;
    let dst = o.bytes();
    let mut at = 0;
    for x in inputs.iter().flatten() {
        let w = x.shape[axis] * inner;
        let src = x.bytes();
        for i in 0..outer {
            dst[i * row + at..i * row + at + w].copy_from_slice(&src[i * w..(i + 1) * w]);
        }
        at += w;
    }
    Ok(())
}

fn concat_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    let idx = node.attrs.req_int("index")? as usize;
    let r = dy.shape.len();
    let axis = norm_axis(node, node.attrs.req_int("axis")?, r)?;
    let es = dy.dtype.size();
    let mut before = 0;
    for k in 0..idx {
        let s = ints(node, inputs, 1 + k)?.unwrap_or_default();
        before += s[axis] as usize;
    }
    let o = &mut out[0];
    let outer = numel(&dy.shape[..axis]);
    let inner = numel(&dy.shape[axis + 1..]) * es;
    let row = dy.shape[axis] * inner;
    let w = o.shape[axis] * inner;
    let src = dy.bytes();
    let dst = o.bytes();
    for i in 0..outer {
        dst[i * w..(i + 1) * w].copy_from_slice(&src[i * row + before * inner..i * row + before * inner + w]);
    }
    Ok(())
}

fn split(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let axis = norm_axis(node, node.attrs.int("axis", 0)?, x.shape.len())?;
    let es = x.dtype.size();
    let outer = numel(&x.shape[..axis]);
    let inner = numel(&x.shape[axis + 1..]) * es;
    let row = x.shape[axis] * inner;
    let src = x.bytes();
    let mut at = 0;
    for o in out.iter_mut() {
        let w = o.shape[axis] * inner;
        let dst = o.bytes();
        for i in 0..outer {
            dst[i * w..(i + 1) * w].copy_from_slice(&src[i * row + at..i * row + at + w]);
        }
        at += w;
    }
    Ok(())
}

/// (start, step, count) per axis, as ops::movement::slice_params computed at plan time.
fn slice_plan(node: &Node, inputs: &[Option<In>], shape: &[usize], first_param: usize) -> Result<Vec<(i64, i64, usize)>> {
    let t: Vec<Option<crate::tensor::Tensor>> =
        (first_param..first_param + 4).map(|i| inputs.get(i).and_then(|x| x.as_ref()).map(|x| x.to_tensor())).collect();
    let infer: Vec<Option<crate::ops::InferIn>> = std::iter::once(None)
        .chain(t.iter().map(|x| x.as_ref().map(|x| crate::ops::InferIn { dtype: x.dtype(), shape: &x.shape, value: Some(x) })))
        .collect();
    crate::ops::movement_slice_params(node, &infer, shape)
}

/// Visits a strided slice as contiguous runs: `f(src_offset, dst_offset, len)`, in elements.
/// Trailing axes taken whole with step 1 join one run, and so does the next axis outward when
/// its step is 1, so a slice such as `logits[:, :-1, :]` is one copy per row instead of an
/// index computation per element (measured: 140 ms -> memcpy speed for GPT-2's 103 MB logits).
fn slice_runs(shape: &[usize], p: &[(i64, i64, usize)], mut f: impl FnMut(usize, usize, usize)) {
    let xs = strides(shape);
    let mut k = shape.len();
    let mut run = 1usize;
    let mut base = 0i64;
    while k > 0 && p[k - 1] == (0, 1, shape[k - 1]) {
        run *= shape[k - 1];
        k -= 1;
    }
    if k > 0 && p[k - 1].1 == 1 {
        run *= p[k - 1].2;
        base = p[k - 1].0 * xs[k - 1] as i64;
        k -= 1;
    }
    if run == 0 {
        return;
    }
    let counts: Vec<usize> = p[..k].iter().map(|t| t.2).collect();
    let total: usize = counts.iter().product();
    for o in 0..total {
        let mut r = o;
        let mut off = base;
        for d in (0..k).rev() {
            let i = (r % counts[d]) as i64;
            r /= counts[d];
            off += (p[d].0 + i * p[d].1) * xs[d] as i64;
        }
        f(off as usize, o * run, run);
    }
}

fn slice(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let p = slice_plan(node, inputs, x.shape, 1)?;
    fn go<T: Elem>(x: &In, o: &mut Out, p: &[(i64, i64, usize)]) -> Result<()> {
        let src = x.slice_bytes_as::<T>();
        let dst = o.slice_bytes_as::<T>();
        slice_runs(x.shape, p, |s, d, n| dst[d..d + n].copy_from_slice(&src[s..s + n]));
        Ok(())
    }
    by_width!(x.dtype, go(x, &mut out[0], &p))
}

fn slice_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    let o = &mut out[0];
    let shape = o.shape.to_vec();
    let p = slice_plan(node, inputs, &shape, 2)?;
    fn go<T: Arith>(dy: &In, o: &mut Out, shape: &[usize], p: &[(i64, i64, usize)]) -> Result<()> {
        let src = dy.slice::<T>()?;
        let dst = o.slice::<T>()?;
        dst.iter_mut().for_each(|v| *v = T::zero());
        // a slice reads every position at most once (step != 0), so its gradient is a copy
        slice_runs(shape, p, |s, d, n| dst[s..s + n].copy_from_slice(&src[d..d + n]));
        Ok(())
    }
    crate::dispatch_num!(dy.dtype, node, go::<T>(dy, o, &shape, &p))
}

fn index_list(node: &Node, idx: &In, dim: usize) -> Result<Vec<usize>> {
    let raw = idx.to_tensor().to_i64_vec().ok_or_else(|| node.err("indices must be integers"))?;
    raw.into_iter()
        .map(|i| {
            let j = if i < 0 { i + dim as i64 } else { i };
            if j < 0 || j >= dim as i64 {
                Err(node.err(format!("index {i} is out of range for a dimension of size {dim}")))
            } else {
                Ok(j as usize)
            }
        })
        .collect()
}

fn gather(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let idx = nth(node, inputs, 1)?;
    let axis = norm_axis(node, node.attrs.int("axis", 0)?, x.shape.len())?;
    let dim = x.shape[axis];
    let ids = index_list(node, idx, dim)?;
    let es = x.dtype.size();
    let outer = numel(&x.shape[..axis]);
    let inner = numel(&x.shape[axis + 1..]) * es;
    let src = x.bytes();
    let dst = out[0].bytes();
    let n = ids.len();
    if inner == 0 {
        return Ok(());
    }
    let copy = |(k, chunk): (usize, &mut [u8])| {
        let (i, j) = (k / n.max(1), k % n.max(1));
        let s = (i * dim + ids[j]) * inner;
        chunk.copy_from_slice(&src[s..s + inner]);
    };
    if dst.len() >= PAR_MIN * 4 {
        dst.par_chunks_mut(inner).enumerate().for_each(copy);
    } else {
        dst.chunks_mut(inner).enumerate().for_each(copy);
    }
    let _ = outer;
    Ok(())
}

fn gather_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    gather_grad_into(node, inputs, out, true)
}

/// GatherGrad's scatter-add of `dy` rows at the indices into the output; `zero_first`: the
/// output starts from zeros (the op), else the rows are added to what it holds (in_place.rs).
pub(super) fn gather_grad_into(node: &Node, inputs: &[Option<In>], out: &mut [Out], zero_first: bool) -> Result<()> {
    let dy = first(node, inputs)?;
    let idx = nth(node, inputs, 1)?;
    let o = &mut out[0];
    let shape = o.shape.to_vec();
    let axis = norm_axis(node, node.attrs.int("axis", 0)?, shape.len())?;
    let dim = shape[axis];
    let ids = index_list(node, idx, dim)?;
    fn go<T: Arith>(dy: &In, o: &mut Out, shape: &[usize], axis: usize, ids: &[usize], zero_first: bool) -> Result<()> {
        let outer = numel(&shape[..axis]);
        let inner = numel(&shape[axis + 1..]);
        let dim = shape[axis];
        let src = dy.slice::<T>()?;
        let dst = o.slice::<T>()?;
        if zero_first && dst.len() >= PAR_MIN {
            // an embedding's gradient is mostly zeros (the tutorial's: 23 MB for 700 rows)
            dst.par_chunks_mut(PAR_MIN).for_each(|c| c.iter_mut().for_each(|v| *v = T::zero()));
        } else if zero_first {
            dst.iter_mut().for_each(|v| *v = T::zero());
        }
        let n = ids.len();
        let add = |to: &mut [T], row: &[T]| to.iter_mut().zip(row).for_each(|(t, &r)| *t = *t + r);
        let mut seen = vec![0usize; if n > GATHER_GRAD_SEGMENT { dim } else { 0 }];
        // the open segment of each index seen more than GATHER_GRAD_SEGMENT times
        let mut open: HashMap<usize, Vec<T>> = HashMap::new();
        for i in 0..outer {
            seen.iter_mut().for_each(|c| *c = 0);
            for (j, &id) in ids.iter().enumerate() {
                let row = &src[(i * n + j) * inner..][..inner];
                let d = (i * dim + id) * inner;
                let occurrence = match seen.get_mut(id) {
                    Some(c) => {
                        *c += 1;
                        *c - 1
                    }
                    None => 0,
                };
                if occurrence < GATHER_GRAD_SEGMENT {
                    add(&mut dst[d..d + inner], row);
                    continue;
                }
                let seg = open.entry(id).or_insert_with(|| vec![T::zero(); inner]);
                if occurrence % GATHER_GRAD_SEGMENT == 0 {
                    seg.iter_mut().for_each(|v| *v = T::zero());
                }
                add(seg, row);
                if occurrence % GATHER_GRAD_SEGMENT == GATHER_GRAD_SEGMENT - 1 {
                    add(&mut dst[d..d + inner], seg);
                }
            }
            // the segments still open: each index's last, when not full
            for (id, seg) in open.drain() {
                if seen[id] % GATHER_GRAD_SEGMENT != 0 {
                    add(&mut dst[(i * dim + id) * inner..][..inner], &seg);
                }
            }
        }
        Ok(())
    }
    crate::dispatch_num!(dy.dtype, node, go::<T>(dy, o, &shape, axis, &ids, zero_first))
}

/// Visits (data_offset, index_position) for GatherElements along `axis`.
fn elements_walk(node: &Node, data_shape: &[usize], idx: &In, axis: usize, mut f: impl FnMut(usize, usize)) -> Result<()> {
    let ishape = idx.shape;
    let raw = idx.to_tensor().to_i64_vec().ok_or_else(|| node.err("indices must be integers"))?;
    let ds = strides(data_shape);
    let dim = data_shape[axis] as i64;
    for (p, &i) in raw.iter().enumerate() {
        let j = if i < 0 { i + dim } else { i };
        if j < 0 || j >= dim {
            return Err(node.err(format!("index {i} is out of range for a dimension of size {dim}")));
        }
        let mut r = p;
        let mut off = 0;
        for d in (0..ishape.len()).rev() {
            let c = r % ishape[d];
            r /= ishape[d];
            off += if d == axis { j as usize } else { c } * ds[d];
        }
        f(off, p);
    }
    Ok(())
}

fn gather_elements(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let idx = nth(node, inputs, 1)?;
    let axis = norm_axis(node, node.attrs.int("axis", 0)?, x.shape.len())?;
    fn go<T: Elem>(node: &Node, x: &In, idx: &In, o: &mut Out, axis: usize) -> Result<()> {
        let src = x.slice_bytes_as::<T>();
        let dst = o.slice_bytes_as::<T>();
        elements_walk(node, x.shape, idx, axis, |s, p| dst[p] = src[s])
    }
    by_width!(x.dtype, go(node, x, idx, &mut out[0], axis))
}

fn gather_elements_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    let idx = nth(node, inputs, 1)?;
    let o = &mut out[0];
    let shape = o.shape.to_vec();
    let axis = norm_axis(node, node.attrs.int("axis", 0)?, shape.len())?;
    fn go<T: Arith>(node: &Node, dy: &In, idx: &In, o: &mut Out, shape: &[usize], axis: usize) -> Result<()> {
        let src = dy.slice::<T>()?;
        let dst = o.slice::<T>()?;
        dst.iter_mut().for_each(|v| *v = T::zero());
        elements_walk(node, shape, idx, axis, |d, p| dst[d] = dst[d] + src[p])
    }
    crate::dispatch_num!(dy.dtype, node, go::<T>(node, dy, idx, o, &shape, axis))
}

fn trilu(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let upper = node.attrs.int("upper", 1)? != 0;
    let k = ints(node, inputs, 1)?.and_then(|v| v.first().copied()).unwrap_or(0);
    let r = x.shape.len();
    let (rows, cols) = (x.shape[r - 2], x.shape[r - 1]);
    fn go<T: Elem + Default>(x: &In, o: &mut Out, rows: usize, cols: usize, upper: bool, k: i64) -> Result<()> {
        let src = x.slice_bytes_as::<T>();
        let dst = o.slice_bytes_as::<T>();
        for (p, (d, &s)) in dst.iter_mut().zip(src).enumerate() {
            let j = (p % cols) as i64;
            let i = ((p / cols.max(1)) % rows.max(1)) as i64;
            let keep = if upper { j - i >= k } else { j - i <= k };
            *d = if keep { s } else { T::default() };
        }
        Ok(())
    }
    by_width!(x.dtype, go(x, &mut out[0], rows, cols, upper, k))
}

pub fn register(t: &mut KernelTable) {
    for op in ["Reshape", "Flatten", "Squeeze", "Unsqueeze"] {
        t.add(op, identity);
    }
    t.add("Transpose", transpose);
    t.add("Expand", expand);
    t.add("Concat", concat);
    t.add("ConcatGrad", concat_grad);
    t.add("Split", split);
    t.add("Slice", slice);
    t.add("SliceGrad", slice_grad);
    t.add("Gather", gather);
    t.add("GatherGrad", gather_grad);
    t.add("GatherElements", gather_elements);
    t.add("GatherElementsGrad", gather_elements_grad);
    t.add("Trilu", trilu);
}

#[cfg(test)]
mod tests {
    use super::super::testutil::run;
    use crate::ir::{Attr, Attrs};
    use crate::ops::movement::GATHER_GRAD_SEGMENT;
    use crate::tensor::Tensor;

    /// GatherGrad's sums are the CUDA kernels' (kernels/gather.cu): each index's rows a segment
    /// at a time from zero, then the segments in order; and they are the sums.
    #[test]
    fn gather_grad_adds_long_runs_by_segments() {
        // x [2, 5, 3] gathered on axis 1 by 150 indices: 100 of them 3 (a padding token's run),
        // 33 of them -1 (4), the rest 0 and 1
        let (outer, dim, inner, n) = (2usize, 5usize, 3usize, 150usize);
        let idx: Vec<i64> = (0..n)
            .map(|j| {
                if j % 3 != 2 {
                    3
                } else if j < 100 {
                    -1
                } else {
                    (j % 2) as i64
                }
            })
            .collect();
        // values whose sums depend on the order they are added in
        let dy: Vec<f32> = (0..outer * n * inner).map(|e| (e as f32 * 0.7).sin() * 10f32.powi((e % 7) as i32 - 3)).collect();
        let attrs = Attrs::default().with("axis", Attr::Int(1));
        let got = run(
            "GatherGrad",
            attrs,
            &[
                &Tensor::from_f32(vec![outer, n, inner], dy.clone()),
                &Tensor::from_i64(vec![n], idx.clone()),
                &Tensor::from_i64(vec![3], vec![2, 5, 3]),
            ],
        )[0]
        .to_f64_vec();
        let mut order_mattered = false;
        for o in 0..outer {
            for row in 0..dim {
                for k in 0..inner {
                    let rows: Vec<f32> =
                        (0..n).filter(|&j| (idx[j] + dim as i64) as usize % dim == row).map(|j| dy[(o * n + j) * inner + k]).collect();
                    let segmented = rows.chunks(GATHER_GRAD_SEGMENT).map(|c| c.iter().fold(0f32, |a, &v| a + v)).fold(0f32, |a, v| a + v);
                    let in_turn = rows.iter().fold(0f32, |a, &v| a + v);
                    let exact: f64 = rows.iter().map(|&v| v as f64).sum();
                    let at = (o * dim + row) * inner + k;
                    assert_eq!(got[at], segmented as f64, "row {row} column {k} of slice {o}");
                    assert!(
                        (got[at] - exact).abs() <= 1e-5 * rows.iter().map(|v| v.abs() as f64).sum::<f64>(),
                        "row {row}: {} vs {exact}",
                        got[at]
                    );
                    order_mattered |= segmented != in_turn;
                }
            }
        }
        assert!(order_mattered, "the test's values should tell the two orders apart");
    }
}
