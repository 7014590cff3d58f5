//! CPU kernels of ops/softmax.rs, parallel over rows.

use rayon::prelude::*;

use super::elementwise::{first, FloatElem};
use super::tensor_view::{In, Out};
use super::{CpuCtx, KernelTable};
use crate::error::Result;
use crate::ir::Node;
use crate::ops::softmax_layout_of;

/// Runs `f(group_in..., group_out)` over each (outer index) block of n·inner elements.
fn softmax_rows<T: FloatElem>(x: &[T], y: &mut [T], n: usize, inner: usize, log: bool) {
    let block = n * inner;
    if block == 0 {
        return;
    }
    let run = |(xb, yb): (&[T], &mut [T])| {
        for j in 0..inner {
            let mut m = T::neg_infinity();
            for k in 0..n {
                m = m.max(xb[k * inner + j]);
            }
            let mut s = T::zero();
            for k in 0..n {
                let e = (xb[k * inner + j] - m).exp();
                yb[k * inner + j] = e;
                s = s + e;
            }
            if log {
                let ls = s.ln() + m;
                for k in 0..n {
                    yb[k * inner + j] = xb[k * inner + j] - ls;
                }
            } else {
                let inv = T::one() / s;
                for k in 0..n {
                    yb[k * inner + j] = yb[k * inner + j] * inv;
                }
            }
        }
    };
    if x.len() >= 1 << 14 {
        x.par_chunks(block).zip(y.par_chunks_mut(block)).for_each(run);
    } else {
        x.chunks(block).zip(y.chunks_mut(block)).for_each(run);
    }
}

fn softmax(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let (_, n, inner) = softmax_layout_of(node, x.shape)?;
    let log = node.op_type == "LogSoftmax";
    fn go<T: FloatElem>(x: &In, o: &mut Out, n: usize, inner: usize, log: bool) -> Result<()> {
        softmax_rows(x.slice::<T>()?, o.slice::<T>()?, n, inner, log);
        Ok(())
    }
    crate::dispatch_float!(x.dtype, node, go::<T>(x, &mut out[0], n, inner, log))
}

fn softmax_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    let y = inputs.get(1).and_then(|v| v.as_ref()).ok_or_else(|| node.err("input 1 missing"))?;
    let (_, n, inner) = softmax_layout_of(node, dy.shape)?;
    let log = node.op_type == "LogSoftmaxGrad";
    fn go<T: FloatElem>(dy: &In, y: &In, o: &mut Out, n: usize, inner: usize, log: bool) -> Result<()> {
        let (dv, yv, ov) = (dy.slice::<T>()?, y.slice::<T>()?, o.slice::<T>()?);
        let block = n * inner;
        if block == 0 {
            return Ok(());
        }
        let run = |((db, yb), ob): ((&[T], &[T]), &mut [T])| {
            for j in 0..inner {
                let mut s = T::zero();
                for k in 0..n {
                    let i = k * inner + j;
                    s = s + if log { db[i] } else { db[i] * yb[i] };
                }
                for k in 0..n {
                    let i = k * inner + j;
                    ob[i] = if log { db[i] - yb[i].exp() * s } else { yb[i] * (db[i] - s) };
                }
            }
        };
        if dv.len() >= 1 << 14 {
            dv.par_chunks(block).zip(yv.par_chunks(block)).zip(ov.par_chunks_mut(block)).for_each(run);
        } else {
            dv.chunks(block).zip(yv.chunks(block)).zip(ov.chunks_mut(block)).for_each(run);
        }
        Ok(())
    }
    crate::dispatch_float!(dy.dtype, node, go::<T>(dy, y, &mut out[0], n, inner, log))
}

pub fn register(t: &mut KernelTable) {
    t.add("Softmax", softmax);
    t.add("LogSoftmax", softmax);
    t.add("SoftmaxGrad", softmax_grad);
    t.add("LogSoftmaxGrad", softmax_grad);
}
