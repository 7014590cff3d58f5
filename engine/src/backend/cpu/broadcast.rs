//! Broadcasting element-wise maps over kernel views, parallel over rows for large outputs.

use rayon::prelude::*;

use super::tensor_view::{Elem, In, Out};
use super::PAR_MIN;
use crate::error::Result;

/// Strides (in elements) of `in_shape` indexed by positions of `out_shape`; 0 on broadcast dims.
pub fn bcast_strides(in_shape: &[usize], out_shape: &[usize]) -> Vec<usize> {
    let rank = out_shape.len();
    let off = rank - in_shape.len();
    let mut strides = vec![0usize; rank];
    let mut s = 1usize;
    for i in (0..in_shape.len()).rev() {
        if in_shape[i] != 1 {
            strides[off + i] = s;
        }
        s *= in_shape[i];
    }
    strides
}

/// Offset in an input of the first element of output row `row` (rows span the last dim).
#[inline]
fn row_offset(row: usize, out_shape: &[usize], strides: &[usize]) -> usize {
    let mut r = row;
    let mut off = 0;
    for d in (0..out_shape.len().saturating_sub(1)).rev() {
        let n = out_shape[d];
        off += (r % n) * strides[d];
        r /= n;
    }
    off
}

fn for_rows<O: Elem>(ov: &mut [O], inner: usize, f: impl Fn(usize, &mut [O]) + Sync + Send) {
    if inner == 0 {
        return;
    }
    if ov.len() >= PAR_MIN {
        ov.par_chunks_mut(inner).enumerate().for_each(|(r, row)| f(r, row));
    } else {
        ov.chunks_mut(inner).enumerate().for_each(|(r, row)| f(r, row));
    }
}

pub fn map1<A: Elem, O: Elem>(a: &In, out: &mut Out, f: impl Fn(A) -> O + Sync + Send) -> Result<()> {
    let av = a.slice::<A>()?;
    let ov = out.slice::<O>()?;
    if ov.len() >= PAR_MIN {
        ov.par_iter_mut().zip(av.par_iter()).for_each(|(o, &x)| *o = f(x));
    } else {
        ov.iter_mut().zip(av).for_each(|(o, &x)| *o = f(x));
    }
    Ok(())
}

/// out[i] = f(x[i]) over blocks of contiguous elements (in parallel for large outputs).
fn map_blocks<X: Elem, O: Elem>(ov: &mut [O], xv: &[X], f: impl Fn(X) -> O + Sync + Send) {
    const BLOCK: usize = 1 << 14;
    let block = |(o, x): (&mut [O], &[X])| o.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x));
    if ov.len() >= PAR_MIN {
        ov.par_chunks_mut(BLOCK).zip(xv.par_chunks(BLOCK)).for_each(block);
    } else {
        block((ov, xv));
    }
}

pub fn map2<A: Elem, B: Elem, O: Elem>(a: &In, b: &In, out: &mut Out, f: impl Fn(A, B) -> O + Sync + Send) -> Result<()> {
    let shape = out.shape.to_vec();
    let av = a.slice::<A>()?;
    let bv = b.slice::<B>()?;
    let ov = out.slice::<O>()?;
    if a.shape == shape.as_slice() && b.shape == shape.as_slice() {
        // by blocks of slices: a loop LLVM vectorises (rayon's element-wise zip is not one)
        const BLOCK: usize = 1 << 14;
        let block = |(o, (x, y)): (&mut [O], (&[A], &[B]))| o.iter_mut().zip(x.iter().zip(y)).for_each(|(o, (&x, &y))| *o = f(x, y));
        if ov.len() >= PAR_MIN {
            ov.par_chunks_mut(BLOCK).zip(av.par_chunks(BLOCK).zip(bv.par_chunks(BLOCK))).for_each(block);
        } else {
            block((ov, (av, bv)));
        }
        return Ok(());
    }
    // one operand a scalar (a gradient scaled by a loss seed): a plain map over blocks
    if a.shape == shape.as_slice() && bv.len() == 1 {
        let y = bv[0];
        map_blocks(ov, av, |x| f(x, y));
        return Ok(());
    }
    if b.shape == shape.as_slice() && av.len() == 1 {
        let x = av[0];
        map_blocks(ov, bv, |y| f(x, y));
        return Ok(());
    }
    let inner = shape.last().copied().unwrap_or(1);
    let sa = bcast_strides(a.shape, &shape);
    let sb = bcast_strides(b.shape, &shape);
    let (ia, ib) = (sa.last().copied().unwrap_or(0), sb.last().copied().unwrap_or(0));
    for_rows(ov, inner, |r, row| {
        let (oa, ob) = (row_offset(r, &shape, &sa), row_offset(r, &shape, &sb));
        // the usual rows (each operand contiguous along the row, or one value for it: RoPE's
        // cos/sin, a norm's per-row scale or per-column weight) as slices, which vectorise
        match (ia, ib) {
            (1, 1) => row.iter_mut().zip(av[oa..oa + inner].iter().zip(&bv[ob..ob + inner])).for_each(|(o, (&x, &y))| *o = f(x, y)),
            (1, 0) => {
                let y = bv[ob];
                row.iter_mut().zip(&av[oa..oa + inner]).for_each(|(o, &x)| *o = f(x, y));
            }
            (0, 1) => {
                let x = av[oa];
                row.iter_mut().zip(&bv[ob..ob + inner]).for_each(|(o, &y)| *o = f(x, y));
            }
            _ => {
                for (j, o) in row.iter_mut().enumerate() {
                    *o = f(av[oa + j * ia], bv[ob + j * ib]);
                }
            }
        }
    });
    Ok(())
}

pub fn map3<A: Elem, B: Elem, C: Elem, O: Elem>(
    a: &In,
    b: &In,
    c: &In,
    out: &mut Out,
    f: impl Fn(A, B, C) -> O + Sync + Send,
) -> Result<()> {
    let shape = out.shape.to_vec();
    let (av, bv, cv) = (a.slice::<A>()?, b.slice::<B>()?, c.slice::<C>()?);
    let ov = out.slice::<O>()?;
    let inner = shape.last().copied().unwrap_or(1);
    let (sa, sb, sc) = (bcast_strides(a.shape, &shape), bcast_strides(b.shape, &shape), bcast_strides(c.shape, &shape));
    let last = |s: &[usize]| s.last().copied().unwrap_or(0);
    let (ia, ib, ic) = (last(&sa), last(&sb), last(&sc));
    for_rows(ov, inner, |r, row| {
        let (oa, ob, oc) = (row_offset(r, &shape, &sa), row_offset(r, &shape, &sb), row_offset(r, &shape, &sc));
        for (j, o) in row.iter_mut().enumerate() {
            *o = f(av[oa + j * ia], bv[ob + j * ib], cv[oc + j * ic]);
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::run;
    use crate::ir::Attrs;
    use crate::tensor::Tensor;

    fn numbered(shape: &[usize], seed: usize) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::from_f32(shape.to_vec(), (0..n).map(|i| ((i + seed) * 37 % 101) as f32 / 7.0 - 6.0).collect())
    }

    /// Sub of every broadcasting pair whose rows take a sliced path (both contiguous along the
    /// row, one of them one value per row, either side) and of one that takes the strided loop,
    /// element by element against the broadcasting rule, in outputs large enough to run in parallel.
    #[test]
    fn broadcast_rows_match_the_rule_on_every_path() {
        let cases: [(&[usize], &[usize]); 6] = [
            (&[8, 64, 33, 64], &[1, 1, 33, 64]), // (1, 1): RoPE's cos/sin
            (&[8, 64, 33, 64], &[8, 64, 33, 1]), // (1, 0): a per-row scale
            (&[8, 64, 33, 1], &[8, 64, 33, 64]), // (0, 1)
            (&[64], &[8, 64, 33, 64]),           // (1, 1) with a's rows all the same
            (&[8, 64, 33, 64], &[64, 33, 64]),
            (&[5, 1, 7], &[1, 9, 1]), // (0, 0) and a strided row on neither side
        ];
        for (sa, sb) in cases {
            let (a, b) = (numbered(sa, 1), numbered(sb, 5));
            let out = &run("Sub", Attrs::default(), &[&a, &b])[0];
            let rank = out.shape.len();
            let pad = |s: &[usize]| [vec![1; rank - s.len()], s.to_vec()].concat();
            let (pa, pb) = (pad(sa), pad(sb));
            let (av, bv, ov) = (a.to_f64_vec(), b.to_f64_vec(), out.to_f64_vec());
            for (i, &got) in ov.iter().enumerate() {
                let (mut r, mut ia, mut ib, mut stride_a, mut stride_b) = (i, 0, 0, 1, 1);
                for d in (0..rank).rev() {
                    let idx = r % out.shape[d];
                    r /= out.shape[d];
                    ia += if pa[d] == 1 { 0 } else { idx * stride_a };
                    ib += if pb[d] == 1 { 0 } else { idx * stride_b };
                    stride_a *= pa[d];
                    stride_b *= pb[d];
                }
                assert_eq!(got, (av[ia] as f32 - bv[ib] as f32) as f64, "{sa:?} - {sb:?} at {i}");
            }
        }
    }
}
