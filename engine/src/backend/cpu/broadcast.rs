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
        if ov.len() >= PAR_MIN {
            ov.par_iter_mut().zip(av.par_iter().zip(bv.par_iter())).for_each(|(o, (&x, &y))| *o = f(x, y));
        } else {
            ov.iter_mut().zip(av.iter().zip(bv)).for_each(|(o, (&x, &y))| *o = f(x, y));
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
        for (j, o) in row.iter_mut().enumerate() {
            *o = f(av[oa + j * ia], bv[ob + j * ib]);
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
