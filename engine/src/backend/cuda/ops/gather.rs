//! Gather (embedding lookups) and GatherElements with their scatter-add gradients GatherGrad
//! and GatherElementsGrad (kernels/gather.cu), with the semantics of backend/cpu/movement.rs:
//! `axis` attribute (default 0, negative counts from the end), negative indices counted from
//! the end of the axis, gradients of repeated indices summed.
//!
//! Where the CPU kernel fails on an index out of range, a device kernel cannot: it writes 0
//! (drops the gradient) and sets the i32 at `CudaCtx::error_flag` (null allowed: gather.cu
//! checks it), which the executor reads after the step. Indices must be int64 (what PyTorch
//! exports); int32 indices are an error naming the node.
//!
//! GatherGrad (an embedding's gradient) sorts its indices (radix_sort.rs) and sums each row's
//! repeats in position order, as the CPU does: the same bits every run, in every float type.
//! GatherElementsGrad still adds with float atomics (f32 and f64; 16-bit widened), so the
//! order of its sums over repeated indices varies run to run.

use super::strides::contiguous;
use super::{float_suffix, input, radix_sort, widen, CudaCtx, CudaTable, DView};
use crate::backend::cuda::abi::{Strides, MAX_DIMS};
use crate::backend::cuda::launch::{Grid, KArg};
use crate::error::Result;
use crate::ir::Node;
use crate::ops::movement::GATHER_GRAD_SEGMENT;
use crate::ops::util::norm_axis;
use crate::tensor::DType;

/// Gather's view of x as [outer, dim, inner] with `n_idx` indices: (outer, dim, inner).
pub(super) fn gather_geometry(node: &Node, x: &[usize], axis_attr: i64) -> Result<(usize, usize, usize)> {
    if x.is_empty() {
        return Err(node.err("the data must have rank ≥ 1"));
    }
    let axis = norm_axis(node, axis_attr, x.len())?;
    Ok((x[..axis].iter().product(), x[axis], x[axis + 1..].iter().product()))
}

/// GatherElements' `Strides`: the index tensor's shape as the index space (not simplified: the
/// kernel replaces the coordinate on `axis`), x's contiguous strides as operand 0. The index
/// tensor must have x's rank and fit in x off the axis (the kernel reads x there).
pub(super) fn elements_layout(node: &Node, x: &[usize], idx: &[usize], axis: usize) -> Result<Strides> {
    if x.is_empty() || idx.len() != x.len() {
        return Err(node.err(format!("indices {idx:?} must have the data's rank (≥ 1), data {x:?}")));
    }
    if x.len() > MAX_DIMS {
        return Err(node.err(format!("rank {} is above the CUDA kernels' {MAX_DIMS}", x.len())));
    }
    if idx.iter().zip(x).enumerate().any(|(d, (&i, &n))| d != axis && i > n) {
        return Err(node.err(format!("indices {idx:?} exceed the data {x:?} off axis {axis}")));
    }
    let mut s = Strides { rank: x.len() as i32, ..Default::default() };
    for (d, (&n, st)) in idx.iter().zip(contiguous(x)).enumerate() {
        s.dims[d] = n as i64;
        s.stride[0][d] = st;
    }
    Ok(s)
}

pub(super) fn int64_indices(node: &Node, idx: &DView) -> Result<()> {
    match idx.dtype {
        DType::I64 => Ok(()),
        other => Err(node.err(format!("the CUDA kernels take int64 indices, got {} (cast them to int64 first)", other.name()))),
    }
}

fn gather(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (x, idx) = (input(node, ins, 0)?, input(node, ins, 1)?);
    int64_indices(node, idx)?;
    let (outer, dim, inner) = gather_geometry(node, x.shape, node.attrs.int("axis", 0)?)?;
    let o = &outs[0];
    let n = o.numel();
    if n != outer * idx.numel() * inner {
        return Err(node.err(format!("the output {:?} does not match indices {:?} into {:?}", o.shape, idx.shape, x.shape)));
    }
    if n == 0 {
        return Ok(());
    }
    let kernel = format!("gather_{}", super::movement::width(x.dtype.size()));
    ctx.rt.launch(ctx.stream, &kernel, ctx.rt.elementwise_grid(n), &gather_args(x.ptr, idx, o.ptr, n, dim, inner, ctx.error_flag))
}

/// gather_W's launch arguments: `n` elements moved from `src` to `dst` along a dimension of
/// `dim` with `inner` elements after it.
fn gather_args(src: u64, idx: &DView, dst: u64, n: usize, dim: usize, inner: usize, flag: u64) -> [KArg; 8] {
    let i = |v: usize| KArg::I64(v as i64);
    [KArg::Ptr(src), KArg::Ptr(idx.ptr), KArg::Ptr(dst), i(n), i(dim), i(idx.numel()), i(inner), KArg::Ptr(flag)]
}

/// GatherGrad(dy, indices, x_shape): dy scattered (added) into zeros shaped like x. The
/// indices are sorted with their positions (out-of-range ones as `dim`, past every row), then a
/// warp sums each run of equal indices, 32 columns at a time, in position order (a run longer
/// than `GATHER_GRAD_SEGMENT`: its segments on warps of their own, then their sums in order); up to `SMALL`
/// indices, a warp finds its index's other positions by scanning them instead.
fn gather_grad(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (dy, idx) = (input(node, ins, 0)?, input(node, ins, 1)?);
    int64_indices(node, idx)?;
    let o = &outs[0];
    let sfx = float_suffix(node, dy.dtype)?;
    let (outer, dim, inner) = gather_geometry(node, o.shape, node.attrs.int("axis", 0)?)?;
    let n_idx = idx.numel();
    let n = dy.numel();
    if n != outer * n_idx * inner {
        return Err(node.err(format!("dy {:?} does not match indices {:?} into {:?}", dy.shape, idx.shape, o.shape)));
    }
    // keys are u32 with `dim` itself marking an index out of range
    let max_key = match u32::try_from(dim) {
        Ok(d) if d < u32::MAX && u32::try_from(n_idx).is_ok() => d,
        _ => return Err(node.err(format!("{n_idx} indices into an axis of {dim}: the CUDA kernel sorts both as u32, below {}", u32::MAX))),
    };
    super::movement::zero(ctx, o)?;
    if n == 0 {
        return Ok(());
    }
    let i = |v: usize| KArg::I64(v as i64);
    let grid = rows_grid(outer * n_idx * inner.div_ceil(32), ctx.rt.sms);
    if n_idx <= SMALL {
        let args =
            [KArg::Ptr(dy.ptr), KArg::Ptr(idx.ptr), KArg::Ptr(o.ptr), i(outer), i(n_idx), i(dim), i(inner), KArg::Ptr(ctx.error_flag)];
        return ctx.rt.launch(ctx.stream, &format!("gather_grad_small_{sfx}"), grid, &args);
    }
    let acc_bytes = if dy.dtype == DType::F64 { 8 } else { 4 };
    let partials = outer * segment_partial_rows(n_idx) * inner * acc_bytes;
    let sorted = radix_sort::sort_pairs(ctx, n_idx, max_key, partials, |keys, pos| {
        let args = [KArg::Ptr(idx.ptr), KArg::Ptr(keys), KArg::Ptr(pos), i(n_idx), i(dim), KArg::Ptr(ctx.error_flag)];
        ctx.rt.launch(ctx.stream, "gather_grad_keys_i64", ctx.rt.elementwise_grid(n_idx), &args)
    })?;
    let (keys, pos, part) = (KArg::Ptr(sorted.keys), KArg::Ptr(sorted.vals), KArg::Ptr(sorted.extra));
    ctx.rt.launch(
        ctx.stream,
        &format!("gather_grad_rows_{sfx}"),
        grid,
        &[KArg::Ptr(dy.ptr), keys, pos, KArg::Ptr(o.ptr), part, i(outer), i(n_idx), i(dim), i(inner)],
    )?;
    ctx.rt.launch(
        ctx.stream,
        &format!("gather_grad_runs_{sfx}"),
        grid,
        &[keys, part, KArg::Ptr(o.ptr), i(outer), i(n_idx), i(dim), i(inner)],
    )
}

/// Rows of `inner` partial sums an outer slice of `n_idx` indices may need
/// (kernels/gather.cu `partial_row`): two per segment's slots. A run of equal indices longer
/// than a segment is summed a segment at a time, each on warps of its own, then the segments
/// in order: a padding token's thousands of rows are not one warp's sequential sum.
fn segment_partial_rows(n_idx: usize) -> usize {
    2 * n_idx.div_ceil(GATHER_GRAD_SEGMENT)
}

/// Up to this many indices (a select's one, a few fixed rows) GatherGrad finds repeats by
/// scanning them (gather_grad_small_T), one kernel where the sorted path takes nine (two passes).
const SMALL: usize = 32;
// gather_grad_small sums a whole run at once: the sorted path's order only up to a segment
const _: () = assert!(SMALL <= GATHER_GRAD_SEGMENT);

/// gather_grad_rows' and gather_grad_small's grid: a warp an item (outer slice, slot, 32
/// columns), 8 warps a block, at most 16 blocks an SM (the warps loop over the rest).
fn rows_grid(items: usize, sms: u32) -> Grid {
    Grid::new(items.div_ceil(8).clamp(1, (sms * 16) as usize) as u32, 256)
}

/// The launch arguments shared by gather_elements_W and gather_elements_grad_T.
#[allow(clippy::too_many_arguments)]
fn elements_args(src: u64, idx: u64, dst: u64, s: Strides, n: usize, axis: usize, dim: usize, flag: u64) -> [KArg; 8] {
    [
        KArg::Ptr(src),
        KArg::Ptr(idx),
        KArg::Ptr(dst),
        KArg::Strides(s),
        KArg::I64(n as i64),
        KArg::I32(axis as i32),
        KArg::I64(dim as i64),
        KArg::Ptr(flag),
    ]
}

fn gather_elements(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (x, idx) = (input(node, ins, 0)?, input(node, ins, 1)?);
    int64_indices(node, idx)?;
    let axis = norm_axis(node, node.attrs.int("axis", 0)?, x.shape.len())?;
    let s = elements_layout(node, x.shape, idx.shape, axis)?;
    let n = idx.numel();
    if outs[0].numel() != n {
        return Err(node.err(format!("the output {:?} must be shaped like the indices {:?}", outs[0].shape, idx.shape)));
    }
    if n == 0 {
        return Ok(());
    }
    let kernel = format!("gather_elements_{}", super::movement::width(x.dtype.size()));
    ctx.rt.launch(
        ctx.stream,
        &kernel,
        ctx.rt.elementwise_grid(n),
        &elements_args(x.ptr, idx.ptr, outs[0].ptr, s, n, axis, x.shape[axis], ctx.error_flag),
    )
}

/// GatherElementsGrad(dy, indices, x_shape): dy added at the gathered positions of zeros
/// shaped like x.
fn gather_elements_grad(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (dy, idx) = (input(node, ins, 0)?, input(node, ins, 1)?);
    if dy.dtype.is_half() {
        // float atomics: the scatter kernels exist for f32 and f64 only
        return widen::widened(node, ins, outs, ctx, gather_elements_grad);
    }
    int64_indices(node, idx)?;
    let o = &outs[0];
    let sfx = float_suffix(node, dy.dtype)?;
    let axis = norm_axis(node, node.attrs.int("axis", 0)?, o.shape.len())?;
    let s = elements_layout(node, o.shape, idx.shape, axis)?;
    if dy.shape != idx.shape {
        return Err(node.err(format!("dy {:?} must be shaped like the indices {:?}", dy.shape, idx.shape)));
    }
    super::movement::zero(ctx, o)?;
    let n = idx.numel();
    if n == 0 {
        return Ok(());
    }
    let kernel = format!("gather_elements_grad_{sfx}");
    ctx.rt.launch(
        ctx.stream,
        &kernel,
        ctx.rt.elementwise_grid(n),
        &elements_args(dy.ptr, idx.ptr, o.ptr, s, n, axis, o.shape[axis], ctx.error_flag),
    )
}

pub fn register(t: &mut CudaTable) {
    t.add("Gather", gather);
    t.add("GatherGrad", gather_grad);
    t.add("GatherElements", gather_elements);
    t.add("GatherElementsGrad", gather_elements_grad);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::run as cpu;
    use crate::backend::cuda::launch::check_args;
    use crate::ir::{Attr, Attrs};
    use crate::tensor::Tensor;

    fn node(op: &str) -> Node {
        Node { name: "t".into(), op_type: op.into(), inputs: vec![], outputs: vec![], attrs: Attrs::default() }
    }
    fn numel(s: &[usize]) -> usize {
        s.iter().product()
    }
    fn iota(shape: &[usize]) -> Tensor {
        Tensor::from_i64(shape.to_vec(), (0..numel(shape) as i64).map(|v| 3 * v + 2).collect())
    }
    /// In-range indices, negative ones included, from a fixed pattern.
    fn indices(n: usize, dim: usize) -> Vec<i64> {
        (0..n).map(|i| ((i * 5 + 3) % dim) as i64 - if i % 3 == 0 { dim as i64 } else { 0 }).collect()
    }

    /// gather_W on the host, with the arguments the dispatcher passes.
    fn emulate_gather(x: &[i64], idx: &[i64], n: usize, dim: usize, n_idx: usize, inner: usize) -> Vec<i64> {
        (0..n)
            .map(|e| {
                let (k, t) = (e % inner, e / inner);
                let (j, outer) = (t % n_idx, t / n_idx);
                let id = if idx[j] < 0 { idx[j] + dim as i64 } else { idx[j] } as usize;
                x[(outer * dim + id) * inner + k]
            })
            .collect()
    }

    /// gather_elements_W on the host (the kernel's `elements_src`).
    fn emulate_elements(x: &[i64], idx: &[i64], s: &Strides, axis: usize, dim: usize) -> Vec<i64> {
        idx.iter()
            .enumerate()
            .map(|(p, &raw)| {
                let id = if raw < 0 { raw + dim as i64 } else { raw };
                let (mut off, mut rest) = (0, p as i64);
                for d in (0..s.rank as usize).rev() {
                    let c = rest % s.dims[d];
                    rest /= s.dims[d];
                    off += if d == axis { id } else { c } * s.stride[0][d];
                }
                x[off as usize]
            })
            .collect()
    }

    #[test]
    fn gather_geometry_matches_the_cpu() {
        for (xs, axis, is) in [
            (&[3usize, 7, 4][..], 1i64, &[2usize, 5][..]),
            (&[50, 8], 0, &[3, 6]),
            (&[5, 6], -1, &[4]),
            (&[9, 3], 0, &[]),
            (&[2, 3, 4], -1, &[7]),
        ] {
            let (outer, dim, inner) = gather_geometry(&node("Gather"), xs, axis).unwrap();
            let n_idx = numel(is);
            let idx = indices(n_idx, dim);
            let attrs = Attrs::default().with("axis", Attr::Int(axis));
            let want = cpu("Gather", attrs, &[&iota(xs), &Tensor::from_i64(is.to_vec(), idx.clone())])[0].to_i64_vec().unwrap();
            assert_eq!(
                emulate_gather(&iota(xs).to_i64_vec().unwrap(), &idx, outer * n_idx * inner, dim, n_idx, inner),
                want,
                "Gather {xs:?} axis {axis}"
            );
        }
        assert!(gather_geometry(&node("Gather"), &[], 0).is_err());
        assert!(gather_geometry(&node("Gather"), &[2, 3], 2).is_err());
    }

    #[test]
    fn gather_elements_layout_matches_the_cpu() {
        for (xs, is, axis) in
            [(&[4usize, 5, 6][..], &[4usize, 3, 6][..], 1usize), (&[4, 5, 6], &[3, 2, 6], 0), (&[4, 5, 6], &[2, 5, 9], 2), (&[7], &[12], 0)]
        {
            let s = elements_layout(&node("GatherElements"), xs, is, axis).unwrap();
            let idx = indices(numel(is), xs[axis]);
            let attrs = Attrs::default().with("axis", Attr::Int(axis as i64));
            let want = cpu("GatherElements", attrs, &[&iota(xs), &Tensor::from_i64(is.to_vec(), idx.clone())])[0].to_i64_vec().unwrap();
            assert_eq!(
                emulate_elements(&iota(xs).to_i64_vec().unwrap(), &idx, &s, axis, xs[axis]),
                want,
                "GatherElements {xs:?} {is:?} axis {axis}"
            );
        }
        // indices larger than the data off the axis, or of another rank, would read outside x
        assert!(elements_layout(&node("GatherElements"), &[4, 5], &[5, 5], 1).is_err());
        assert!(elements_layout(&node("GatherElements"), &[4, 5], &[4], 0).is_err());
        assert!(elements_layout(&node("GatherElements"), &[], &[], 0).is_err());
    }

    #[test]
    fn launch_arguments_match_the_registry() {
        let s = Strides::default();
        for w in ["u8", "u16", "u32", "u64"] {
            check_args(&format!("gather_elements_{w}"), &elements_args(1, 2, 3, s, 4, 0, 5, 0)).unwrap();
        }
        for t in ["f32", "f64"] {
            check_args(&format!("gather_elements_grad_{t}"), &elements_args(1, 2, 3, s, 4, 0, 5, 0)).unwrap();
        }
    }
}
