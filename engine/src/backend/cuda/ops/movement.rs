//! Data movement (kernels/movement.cu), with the semantics of backend/cpu/movement.rs: every op
//! is one or more `copy_W` launches whose `Strides` (operand 0 the source, operand 1 the
//! destination, each with a base offset) say where each element goes:
//!
//! - Transpose: source strides permuted; Expand: source strides 0 on broadcast dimensions;
//! - Slice: source strides times the steps (negative allowed), base at the starts; SliceGrad:
//!   `fill_W` 0, then the same copy reversed (the sliced positions are distinct);
//! - Concat: one launch per input into the output at the input's offset along the axis;
//!   Split and ConcatGrad: the reverse;
//! - Trilu: `trilu_W` over the contiguous input;
//! - the view ops the plan could not alias: a device-to-device copy on the stream.
//!
//! The layouts are computed by pure functions (unit-tested below against the CPU kernels
//! through a host emulation of `copy_W`); the dispatchers only read the node and launch.
//! Constant inputs (Slice's bounds, Trilu's constant k, ConcatGrad's shapes) are read from their host
//! copy; the CUDA backend needs them constant.

use cudarc::driver::result;

use super::strides::{broadcast, contiguous, make};
use super::{const_ints, infer_ins, input, CudaCtx, CudaTable, DView};
use crate::backend::cuda::abi::Strides;
use crate::backend::cuda::launch::KArg;
use crate::error::{Error, Result};
use crate::ir::Node;
use crate::ops::util::norm_axis;
use crate::tensor::DType;

/// The copy kernel for an element size.
pub(super) fn width(size: usize) -> &'static str {
    match size {
        1 => "u8",
        2 => "u16",
        4 => "u32",
        _ => "u64",
    }
}

// ---- layouts (pure) -----------------------------------------------------------------------

/// Transpose: the output's index space reading input dimension perm[d].
fn transpose_layout(x: &[usize], perm: &[usize], out: &[usize]) -> Result<Strides> {
    let xs = contiguous(x);
    let src: Vec<i64> = perm.iter().map(|&p| xs[p]).collect();
    make(out, &[src, contiguous(out)], &[])
}

/// Expand: `x` broadcast (numpy rules) to `out`.
pub(super) fn expand_layout(x: &[usize], out: &[usize]) -> Result<Strides> {
    make(out, &[broadcast(x, out)?, contiguous(out)], &[])
}

/// Slice of `x` by per-axis (start, step, count): (counts, source strides, source base).
fn slice_geometry(x: &[usize], p: &[(i64, i64, usize)]) -> (Vec<usize>, Vec<i64>, i64) {
    let xs = contiguous(x);
    let counts = p.iter().map(|q| q.2).collect();
    let src = p.iter().zip(&xs).map(|(q, s)| q.1 * s).collect();
    let base = p.iter().zip(&xs).map(|(q, s)| q.0 * s).sum();
    (counts, src, base)
}

/// Slice: the strided positions of `x` into a contiguous output.
pub(super) fn slice_layout(x: &[usize], p: &[(i64, i64, usize)]) -> Result<Strides> {
    let (counts, src, base) = slice_geometry(x, p);
    make(&counts, &[src, contiguous(&counts)], &[base, 0])
}

/// SliceGrad: a contiguous dy into the strided positions of a zeroed dx shaped `x`.
pub(super) fn slice_grad_layout(x: &[usize], p: &[(i64, i64, usize)]) -> Result<Strides> {
    let (counts, dst, base) = slice_geometry(x, p);
    make(&counts, &[contiguous(&counts), dst], &[0, base])
}

/// Concat on `axis`: per part, its copy into the output `out` (parts of no elements: None).
pub(super) fn concat_layouts(out: &[usize], axis: usize, parts: &[&[usize]]) -> Result<Vec<Option<Strides>>> {
    let os = contiguous(out);
    let mut at = 0i64;
    parts
        .iter()
        .map(|p| {
            let s = if p.iter().product::<usize>() == 0 { None } else { Some(make(p, &[contiguous(p), os.clone()], &[0, at * os[axis]])?) };
            at += p[axis] as i64;
            Ok(s)
        })
        .collect()
}

/// The part of shape `part` starting at `before` along `axis` of a tensor shaped `whole`,
/// copied out contiguously (Split, ConcatGrad).
pub(super) fn part_layout(whole: &[usize], axis: usize, before: usize, part: &[usize]) -> Result<Strides> {
    let ws = contiguous(whole);
    make(part, &[ws.clone(), contiguous(part)], &[before as i64 * ws[axis], 0])
}

/// Checks that `part` fits in `whole` at `before` along `axis` (same rank, same dimensions off
/// the axis), so that a copy never addresses outside either buffer.
fn check_part(node: &Node, whole: &[usize], axis: usize, before: usize, part: &[usize]) -> Result<()> {
    let fits = part.len() == whole.len()
        && part.iter().zip(whole).enumerate().all(|(d, (&p, &w))| if d == axis { before + p <= w } else { p == w });
    if fits {
        Ok(())
    } else {
        Err(node.err(format!("a part {part:?} at {before} on axis {axis} does not fit in {whole:?}")))
    }
}

/// Bytes `copy_v16` moves per element.
const VECTOR: usize = 16;

/// The copy `s` of `n` elements of `elem_size` bytes from `src` to `dst` as a copy of 16-byte
/// vectors (`copy_v16`: one 128-bit load and store where copy_W makes 16 / elem_size narrow
/// ones, and as many fewer index computations), with its vector count: when the innermost
/// dimension is contiguous on both sides and its length, every other stride, both base offsets
/// and both addresses are whole vectors. None otherwise (the element copy is kept). The
/// head transposes of attention ([B, S, H, 64] and back) qualify in every float type.
pub(crate) fn vector_copy(s: &Strides, elem_size: usize, src: u64, dst: u64, n: usize) -> Option<(Strides, usize)> {
    if elem_size == 0 || !VECTOR.is_multiple_of(elem_size) || elem_size == VECTOR || s.rank < 1 {
        return None;
    }
    let per = (VECTOR / elem_size) as i64;
    let inner = s.rank as usize - 1;
    let whole = |v: i64| v % per == 0;
    let aligned = src.is_multiple_of(VECTOR as u64) && dst.is_multiple_of(VECTOR as u64);
    let contiguous_run = s.stride[0][inner] == 1 && s.stride[1][inner] == 1 && whole(s.dims[inner]);
    let others = (0..inner).all(|d| whole(s.stride[0][d]) && whole(s.stride[1][d]));
    if !(aligned && contiguous_run && others && whole(s.base[0]) && whole(s.base[1]) && n.is_multiple_of(per as usize)) {
        return None;
    }
    let mut v = *s;
    v.dims[inner] /= per;
    for k in 0..2 {
        for d in 0..inner {
            v.stride[k][d] /= per;
        }
        v.base[k] /= per;
    }
    Some((v, n / per as usize))
}

// ---- dispatchers --------------------------------------------------------------------------

/// One copy launch over `n` elements with layout `s`: copy_v16 where `vector_copy` allows,
/// else copy_W.
pub(super) fn copy(ctx: &mut CudaCtx, elem_size: usize, src: u64, dst: u64, s: Strides, n: usize) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let (kernel, s, n) = match vector_copy(&s, elem_size, src, dst, n) {
        Some((v, count)) => ("copy_v16".to_string(), v, count),
        None => (format!("copy_{}", width(elem_size)), s, n),
    };
    ctx.rt.launch(ctx.stream, &kernel, ctx.rt.elementwise_grid(n), &[KArg::Ptr(src), KArg::Ptr(dst), KArg::Strides(s), KArg::I64(n as i64)])
}

/// fill_W with zero bits over `o` (zero is all-zero bits in every element type).
pub(super) fn zero(ctx: &mut CudaCtx, o: &DView) -> Result<()> {
    let n = o.numel();
    if n == 0 {
        return Ok(());
    }
    let kernel = format!("fill_{}", width(o.dtype.size()));
    ctx.rt.launch(ctx.stream, &kernel, ctx.rt.elementwise_grid(n), &[KArg::Ptr(o.ptr), KArg::I64(n as i64), KArg::U64(0)])
}

fn transpose(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let o = &outs[0];
    let perm = crate::ops::movement_perm(node, x.shape.len())?;
    let s = transpose_layout(x.shape, &perm, o.shape)?;
    copy(ctx, x.dtype.size(), x.ptr, o.ptr, s, o.numel())
}

fn expand(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let o = &outs[0];
    if o.numel() == 0 {
        return Ok(());
    }
    let s = expand_layout(x.shape, o.shape).map_err(|e| node.err(e.to_string()))?;
    copy(ctx, x.dtype.size(), x.ptr, o.ptr, s, o.numel())
}

/// Slice's (start, step, count) per axis of `shape`, from the constant inputs first..first+4
/// (starts, ends, axes, steps), by the shape rule the CPU kernel uses.
fn slice_params(node: &Node, ins: &[Option<DView>], shape: &[usize], first: usize) -> Result<Vec<(i64, i64, usize)>> {
    let mut infer = vec![None];
    infer.extend(infer_ins(node, ins, first..first + 4, "slice bounds")?);
    crate::ops::movement_slice_params(node, &infer, shape)
}

fn slice(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let o = &outs[0];
    let p = slice_params(node, ins, x.shape, 1)?;
    let n: usize = p.iter().map(|q| q.2).product();
    if n != o.numel() {
        return Err(node.err(format!("the slice has {n} elements, the planned output {:?}", o.shape)));
    }
    copy(ctx, x.dtype.size(), x.ptr, o.ptr, slice_layout(x.shape, &p)?, n)
}

/// SliceGrad(dy, x_shape, starts, ends, axes?, steps?): dy scattered into zeros shaped like x.
fn slice_grad(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let dy = input(node, ins, 0)?;
    let o = &outs[0];
    let p = slice_params(node, ins, o.shape, 2)?;
    let n: usize = p.iter().map(|q| q.2).product();
    if n != dy.numel() {
        return Err(node.err(format!("dy {:?} does not match the slice's {n} elements", dy.shape)));
    }
    zero(ctx, o)?;
    copy(ctx, dy.dtype.size(), dy.ptr, o.ptr, slice_grad_layout(o.shape, &p)?, n)
}

fn concat(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let o = &outs[0];
    let axis = norm_axis(node, node.attrs.req_int("axis")?, o.shape.len())?;
    let parts: Vec<&DView> = ins.iter().flatten().collect();
    let mut before = 0;
    for p in &parts {
        check_part(node, o.shape, axis, before, p.shape)?;
        before += p.shape[axis];
    }
    let shapes: Vec<&[usize]> = parts.iter().map(|p| p.shape).collect();
    for (p, s) in parts.iter().zip(concat_layouts(o.shape, axis, &shapes)?) {
        if let Some(s) = s {
            copy(ctx, o.dtype.size(), p.ptr, o.ptr, s, p.numel())?;
        }
    }
    Ok(())
}

/// ConcatGrad(dy, shape_0..shape_n): the part of dy that came from input `index`; the shapes
/// of the inputs before it (constants) give its offset.
fn concat_grad(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let dy = input(node, ins, 0)?;
    let o = &outs[0];
    let idx = usize::try_from(node.attrs.req_int("index")?).map_err(|_| node.err("index must not be negative"))?;
    let axis = norm_axis(node, node.attrs.req_int("axis")?, dy.shape.len())?;
    let mut before = 0usize;
    for k in 0..idx {
        let s = const_ints(node, ins, 1 + k, "input shape")?
            .ok_or_else(|| node.err(format!("the shape of input {k} (input {}) is missing", 1 + k)))?;
        let d = s.get(axis).copied().ok_or_else(|| node.err(format!("shape {s:?} has no axis {axis}")))?;
        before += usize::try_from(d).map_err(|_| node.err(format!("invalid shape {s:?}")))?;
    }
    check_part(node, dy.shape, axis, before, o.shape)?;
    copy(ctx, dy.dtype.size(), dy.ptr, o.ptr, part_layout(dy.shape, axis, before, o.shape)?, o.numel())
}

fn split(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let axis = norm_axis(node, node.attrs.int("axis", 0)?, x.shape.len())?;
    let mut before = 0;
    for o in outs {
        check_part(node, x.shape, axis, before, o.shape)?;
        copy(ctx, x.dtype.size(), x.ptr, o.ptr, part_layout(x.shape, axis, before, o.shape)?, o.numel())?;
        before += o.shape[axis];
    }
    Ok(())
}

/// Trilu(x, k?): keeps j - i >= k (upper) or j - i <= k (lower) of each matrix. A constant k is
/// passed by value, a computed one (an int64 scalar) read by the kernel from device memory.
fn trilu(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let upper = node.attrs.int("upper", 1)? != 0;
    let (k, k_at) = match ins.get(1).and_then(|v| v.as_ref()) {
        Some(kv) if kv.host.is_none() => {
            if kv.dtype != DType::I64 || kv.numel() != 1 {
                return Err(node.err(format!("k (input 1) must be one int64, got {} {:?}", kv.dtype.name(), kv.shape)));
            }
            (0, kv.ptr)
        }
        _ => (const_ints(node, ins, 1, "k")?.and_then(|v| v.first().copied()).unwrap_or(0), 0),
    };
    let r = x.shape.len();
    if r < 2 {
        return Err(node.err("input must have rank ≥ 2"));
    }
    let (rows, cols) = (x.shape[r - 2], x.shape[r - 1]);
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    let kernel = format!("trilu_{}", width(x.dtype.size()));
    ctx.rt.launch(
        ctx.stream,
        &kernel,
        ctx.rt.elementwise_grid(n),
        &[
            KArg::Ptr(x.ptr),
            KArg::Ptr(outs[0].ptr),
            KArg::I64(n as i64),
            KArg::I64(rows as i64),
            KArg::I64(cols as i64),
            KArg::I32(upper as i32),
            KArg::I64(k),
            KArg::Ptr(k_at),
        ],
    )
}

/// A view op the plan kept as a step: the same bytes, copied.
pub(super) fn view_copy(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let bytes = x.numel() * x.dtype.size();
    if bytes != outs[0].numel() * outs[0].dtype.size() {
        return Err(node.err(format!("cannot copy {:?} into {:?}", x.shape, outs[0].shape)));
    }
    if bytes == 0 || x.ptr == outs[0].ptr {
        return Ok(());
    }
    // SAFETY: both addresses hold `bytes` bytes of planned device memory (checked above: input
    // and output have the same size) and do not overlap (distinct live values).
    unsafe { result::memcpy_dtod_async(outs[0].ptr, x.ptr, bytes, ctx.stream) }.map_err(|e| Error::Cuda(format!("copy: {e}")))
}

pub fn register(t: &mut CudaTable) {
    t.add("Transpose", transpose);
    for op in ["Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "FlattenRows"] {
        t.add(op, view_copy);
    }
    t.add("Expand", expand);
    t.add("Slice", slice);
    t.add("SliceGrad", slice_grad);
    t.add("Concat", concat);
    t.add("ConcatGrad", concat_grad);
    t.add("Split", split);
    t.add("Trilu", trilu);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::run as cpu;
    use crate::ir::{Attr, Attrs};
    use crate::ops::InferIn;
    use crate::tensor::Tensor;

    /// copy_W on the host (the offsets of prelude.cuh's `strided_offsets`): dst[o1] = src[o0].
    fn emulate(s: &Strides, n: usize, src: &[i64], dst: &mut [i64]) {
        for i in 0..n as i64 {
            let o = s.offsets(i);
            dst[o[1] as usize] = src[o[0] as usize];
        }
    }

    fn numel(s: &[usize]) -> usize {
        s.iter().product()
    }
    fn iota(shape: &[usize]) -> Tensor {
        Tensor::from_i64(shape.to_vec(), (0..numel(shape) as i64).map(|v| v * 7 + 1).collect())
    }
    fn ints(v: &[i64]) -> Tensor {
        Tensor::from_i64(vec![v.len()], v.to_vec())
    }
    fn shape_of(s: &[usize]) -> Tensor {
        Tensor::from_i64(vec![s.len()], s.iter().map(|&d| d as i64).collect())
    }
    fn node(op: &str) -> Node {
        Node { name: "t".into(), op_type: op.into(), inputs: vec![], outputs: vec![], attrs: Attrs::default() }
    }

    #[test]
    fn expand_and_transpose_layouts_match_the_cpu() {
        for (x, out) in [(&[3usize, 1][..], &[2usize, 3, 4][..]), (&[4], &[3, 4]), (&[1, 1], &[5, 2]), (&[2, 1, 3], &[2, 4, 3])] {
            let s = expand_layout(x, out).unwrap();
            let want = cpu("Expand", Attrs::default(), &[&iota(x), &shape_of(out)])[0].to_i64_vec().unwrap();
            let mut got = vec![0; numel(out)];
            emulate(&s, numel(out), &iota(x).to_i64_vec().unwrap(), &mut got);
            assert_eq!(got, want, "Expand {x:?} to {out:?}");
        }
        // a row broadcast is one 0-stride dimension and one contiguous one
        let s = expand_layout(&[4], &[3, 4]).unwrap();
        assert_eq!((s.rank, &s.dims[..2], &s.stride[0][..2], &s.stride[1][..2]), (2, &[3i64, 4][..], &[0i64, 1][..], &[4i64, 1][..]));
        assert!(expand_layout(&[3], &[2, 4]).is_err());
        let (x, perm) = ([2usize, 3, 4], [2usize, 0, 1]);
        let out: Vec<usize> = perm.iter().map(|&p| x[p]).collect();
        let s = transpose_layout(&x, &perm, &out).unwrap();
        let attrs = Attrs::default().with("perm", Attr::Ints(perm.iter().map(|&p| p as i64).collect()));
        let mut got = vec![0; 24];
        emulate(&s, 24, &iota(&x).to_i64_vec().unwrap(), &mut got);
        assert_eq!(got, cpu("Transpose", attrs, &[&iota(&x)])[0].to_i64_vec().unwrap());
    }

    /// The copy `s` over byte buffers, `size` bytes per index-space element (copy_W with W of
    /// that size, or copy_v16 with 16).
    fn emulate_bytes(s: &Strides, n: usize, size: usize, src: &[u8], dst: &mut [u8]) {
        for i in 0..n as i64 {
            let o = s.offsets(i);
            let (a, b) = (o[0] as usize * size, o[1] as usize * size);
            dst[b..b + size].copy_from_slice(&src[a..a + size]);
        }
    }

    /// Copies rewritten into 16-byte vectors move the same bytes as the element copies, for
    /// every element size: attention's head transposes (both ways), a broadcast over rows, a
    /// Concat part at an offset, a rank-1 copy; and the copies that must stay element copies
    /// are refused (innermost stride not 1, a run or an offset that is not whole vectors, an
    /// unaligned address).
    #[test]
    fn vector_copies_move_the_same_bytes_as_element_copies() {
        let heads = |x: [usize; 4]| transpose_layout(&x, &[0, 2, 1, 3], &[x[0], x[2], x[1], x[3]]).unwrap();
        for size in [1usize, 2, 4, 8] {
            let per = 16 / size;
            let parts: [&[usize]; 2] = [&[2, 3, 32], &[2, 5, 32]];
            let concat_part = make(parts[1], &[contiguous(parts[1]), contiguous(&[2, 8, 32])], &[0, 3 * 32]).unwrap();
            let cases: Vec<(&str, Strides, usize, usize)> = vec![
                ("heads [2, 5, 3, 64] to [2, 3, 5, 64]", heads([2, 5, 3, 64]), 2 * 5 * 3 * 64, 2 * 5 * 3 * 64),
                ("heads back", heads([2, 3, 5, 64]), 2 * 5 * 3 * 64, 2 * 5 * 3 * 64),
                ("Expand [48] to [3, 48]", expand_layout(&[48], &[3, 48]).unwrap(), 48, 3 * 48),
                ("Concat part 1 of 2 on axis 1", concat_part, numel(parts[1]), 2 * 8 * 32),
                ("rank 1", make(&[160], &[vec![1], vec![1]], &[]).unwrap(), 160, 160),
            ];
            for (what, s, src_elems, dst_elems) in cases {
                let n: usize = (0..s.rank as usize).map(|d| s.dims[d] as usize).product();
                let (v, count) =
                    vector_copy(&s, size, 4096, 8192, n).unwrap_or_else(|| panic!("{what}, {size}-byte elements: not vectorised"));
                assert_eq!(count * per, n, "{what}");
                let src: Vec<u8> = (0..src_elems * size).map(|b| (b * 31 % 251) as u8).collect();
                let (mut narrow, mut wide) = (vec![0u8; dst_elems * size], vec![0u8; dst_elems * size]);
                emulate_bytes(&s, n, size, &src, &mut narrow);
                emulate_bytes(&v, count, 16, &src, &mut wide);
                assert_eq!(wide, narrow, "{what}, {size}-byte elements");
            }
            let refused = |s: &Strides, src: u64, n: usize| vector_copy(s, size, src, 0, n).is_none();
            let t = transpose_layout(&[4, 6], &[1, 0], &[6, 4]).unwrap();
            assert!(refused(&t, 0, 24), "a transpose of the innermost dimension");
            let short = heads([2, 5, 3, 6]);
            assert!(refused(&short, 0, 2 * 5 * 3 * 6) == (6 % per != 0), "a run of 6 elements");
            assert!(refused(&heads([2, 5, 3, 64]), 8, 2 * 5 * 3 * 64), "an address off 16 bytes");
            let off = make(&[2, 32], &[vec![64, 1], vec![32, 1]], &[1, 0]).unwrap();
            assert!(refused(&off, 0, 64), "a source offset of one element");
        }
        // 16-byte elements are already vectors
        assert!(vector_copy(&heads([2, 5, 3, 64]), 16, 0, 0, 2 * 5 * 3 * 64).is_none());
    }

    #[test]
    fn slice_and_slice_grad_layouts_match_the_cpu() {
        type Case = (&'static [usize], &'static [i64], &'static [i64], &'static [i64], &'static [i64]);
        let cases: &[Case] = &[
            (&[7, 9, 5], &[5, 1, -1], &[-100, 8, -100], &[0, 1, 2], &[-2, 3, -1]),
            (&[6, 10], &[-2], &[1], &[-1], &[-3]),
            (&[4, 6, 8], &[1, 7], &[100, 0], &[0, -1], &[1, -2]),
            (&[3, 4], &[1], &[3], &[0], &[1]),
        ];
        for &(x, starts, ends, axes, steps) in cases {
            let (st, en, ax, sp) = (ints(starts), ints(ends), ints(axes), ints(steps));
            fn inf(t: &Tensor) -> Option<InferIn<'_>> {
                Some(InferIn { dtype: t.dtype(), shape: &t.shape, value: Some(t) })
            }
            let p = crate::ops::movement_slice_params(&node("Slice"), &[None, inf(&st), inf(&en), inf(&ax), inf(&sp)], x).unwrap();
            let n: usize = p.iter().map(|q| q.2).product();
            let xv = iota(x);
            let want = cpu("Slice", Attrs::default(), &[&xv, &st, &en, &ax, &sp]);
            let mut got = vec![0; n];
            emulate(&slice_layout(x, &p).unwrap(), n, &xv.to_i64_vec().unwrap(), &mut got);
            assert_eq!(got, want[0].to_i64_vec().unwrap(), "Slice of {x:?} starts {starts:?} steps {steps:?}");
            // SliceGrad: zeros, then dy into the sliced positions
            let dy = iota(&want[0].shape);
            let want = cpu("SliceGrad", Attrs::default(), &[&dy, &shape_of(x), &st, &en, &ax, &sp])[0].to_i64_vec().unwrap();
            let mut got = vec![0; numel(x)];
            emulate(&slice_grad_layout(x, &p).unwrap(), n, &dy.to_i64_vec().unwrap(), &mut got);
            assert_eq!(got, want, "SliceGrad of {x:?} starts {starts:?} steps {steps:?}");
        }
        // columns 1..3 of [3, 4]: rows keep their stride, the base is at the start
        let s = slice_layout(&[3, 4], &[(0, 1, 3), (1, 1, 2)]).unwrap();
        assert_eq!((s.rank, &s.dims[..2], &s.stride[0][..2], s.base[0]), (2, &[3i64, 2][..], &[4i64, 1][..], 1));
        // every other column is one stride-2 walk: the dimensions merge
        let s = slice_layout(&[3, 4], &[(0, 1, 3), (1, 2, 2)]).unwrap();
        assert_eq!((s.rank, s.dims[0], s.stride[0][0], s.base[0]), (1, 6, 2, 1));
    }

    #[test]
    fn concat_split_and_concat_grad_layouts_match_the_cpu() {
        let parts: [&[usize]; 4] = [&[2, 3, 4], &[2, 0, 4], &[2, 5, 4], &[2, 1, 4]];
        let out = [2usize, 9, 4];
        for axis_attr in [1i64, -2] {
            let tensors: Vec<Tensor> = parts
                .iter()
                .enumerate()
                .map(|(k, p)| Tensor::from_i64(p.to_vec(), (0..numel(p) as i64).map(|v| v + 100 * k as i64).collect()))
                .collect();
            let attrs = Attrs::default().with("axis", Attr::Int(axis_attr));
            let want = cpu("Concat", attrs.clone(), &tensors.iter().collect::<Vec<_>>())[0].to_i64_vec().unwrap();
            let axis = norm_axis(&node("Concat"), axis_attr, 3).unwrap();
            let mut got = vec![0; numel(&out)];
            for (t, s) in tensors.iter().zip(concat_layouts(&out, axis, &parts).unwrap()) {
                if let Some(s) = s {
                    emulate(&s, numel(&t.shape), &t.to_i64_vec().unwrap(), &mut got);
                }
            }
            assert_eq!(got, want, "Concat on axis {axis_attr}");
            // ConcatGrad and Split: each part read back at its offset
            let shapes: Vec<Tensor> = parts.iter().map(|p| shape_of(p)).collect();
            let dy = Tensor::from_i64(out.to_vec(), want.clone());
            let mut before = 0;
            for (i, p) in parts.iter().enumerate() {
                let mut ins = vec![&dy];
                ins.extend(shapes.iter());
                let want_i = cpu("ConcatGrad", attrs.clone().with("index", Attr::Int(i as i64)), &ins)[0].to_i64_vec().unwrap();
                let mut got = vec![0; numel(p)];
                emulate(&part_layout(&out, axis, before, p).unwrap(), numel(p), &want, &mut got);
                assert_eq!(got, want_i, "ConcatGrad/Split part {i} {p:?}");
                assert_eq!(got, tensors[i].to_i64_vec().unwrap());
                before += p[axis];
            }
        }
        // a part that does not fit is an error, not an out-of-bounds copy
        assert!(check_part(&node("Split"), &[2, 9, 4], 1, 7, &[2, 3, 4]).is_err());
        assert!(check_part(&node("Split"), &[2, 9, 4], 1, 6, &[2, 3, 4]).is_ok());
        assert!(check_part(&node("Split"), &[2, 9, 4], 1, 0, &[3, 3, 4]).is_err());
    }
}
