//! CPU kernels of ops/reduce.rs: one accumulate loop over rows of the input, mapped onto the
//! kept-dims output by broadcast strides.

use super::broadcast::bcast_strides;
use super::elementwise::{first, Arith, FloatElem};
use super::tensor_view::{In, Out};
use super::{CpuCtx, KernelTable};
use crate::error::Result;
use crate::ir::Node;
use crate::ops::{reduce_axes_of, InferIn};

fn axes(node: &Node, inputs: &[Option<In>], rank: usize) -> Result<Vec<usize>> {
    let t = inputs.get(1).and_then(|x| x.as_ref()).map(|x| x.to_tensor());
    let infer: Vec<Option<InferIn>> = vec![None, t.as_ref().map(|x| InferIn { dtype: x.dtype(), shape: &x.shape, value: Some(x) })];
    reduce_axes_of(node, &infer, rank)
}

/// Folds every element of x into acc[out_index] with `f`.
fn fold<T: Arith>(x: &[T], shape: &[usize], keep: &[usize], acc: &mut [T], f: impl Fn(T, T) -> T) {
    let st = bcast_strides(keep, shape);
    let inner = shape.last().copied().unwrap_or(1).max(1);
    let is = st.last().copied().unwrap_or(0);
    for (r, row) in x.chunks(inner).enumerate() {
        let mut rr = r;
        let mut off = 0;
        for d in (0..shape.len().saturating_sub(1)).rev() {
            off += (rr % shape[d]) * st[d];
            rr /= shape[d];
        }
        if is == 0 {
            let mut a = acc[off];
            for &v in row {
                a = f(a, v);
            }
            acc[off] = a;
        } else {
            for (j, &v) in row.iter().enumerate() {
                acc[off + j] = f(acc[off + j], v);
            }
        }
    }
}

fn reduce(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let ax = axes(node, inputs, x.shape.len())?;
    let (keep, _) = crate::ops::reduced_shapes_of(x.shape, &ax, true);
    let count: usize = ax.iter().map(|&a| x.shape[a]).product();
    fn go<T: FloatElem>(node: &Node, x: &In, keep: &[usize], count: usize, o: &mut Out) -> Result<()> {
        let xv = x.slice::<T>()?;
        let ov = o.slice::<T>()?;
        match node.op_type.as_str() {
            "ReduceSum" | "ReduceMean" => {
                ov.iter_mut().for_each(|v| *v = T::zero());
                fold(xv, x.shape, keep, ov, |a, v| a + v);
                if node.op_type == "ReduceMean" {
                    let inv = T::one() / T::from_f64(count.max(1) as f64);
                    ov.iter_mut().for_each(|v| *v = *v * inv);
                }
            }
            "ReduceMax" => {
                ov.iter_mut().for_each(|v| *v = T::neg_infinity());
                fold(xv, x.shape, keep, ov, |a, v| if v > a || v.partial_cmp(&v).is_none() { v } else { a });
            }
            _ => {
                ov.iter_mut().for_each(|v| *v = T::infinity());
                fold(xv, x.shape, keep, ov, |a, v| if v < a || v.partial_cmp(&v).is_none() { v } else { a });
            }
        }
        Ok(())
    }
    match x.dtype {
        crate::tensor::DType::I64 if node.op_type == "ReduceSum" => {
            let xv = x.slice::<i64>()?;
            let ov = out[0].slice::<i64>()?;
            ov.iter_mut().for_each(|v| *v = 0);
            fold(xv, x.shape, &keep, ov, |a, v| a + v);
            Ok(())
        }
        d => crate::dispatch_float!(d, node, go::<T>(node, x, &keep, count, &mut out[0])),
    }
}

fn reduce_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    let o = &mut out[0];
    let shape = o.shape.to_vec();
    let t = inputs.get(2).and_then(|x| x.as_ref()).map(|x| x.to_tensor());
    let infer: Vec<Option<InferIn>> = vec![None, t.as_ref().map(|x| InferIn { dtype: x.dtype(), shape: &x.shape, value: Some(x) })];
    let ax = reduce_axes_of(node, &infer, shape.len())?;
    let (keep, _) = crate::ops::reduced_shapes_of(&shape, &ax, true);
    let mean = node.attrs.int("mean", 0)? != 0;
    let count: usize = ax.iter().map(|&a| shape[a]).product();
    fn go<T: FloatElem>(dy: &In, o: &mut Out, shape: &[usize], keep: &[usize], scale: f64) -> Result<()> {
        let st = bcast_strides(keep, shape);
        let dv = dy.slice::<T>()?;
        let ov = o.slice::<T>()?;
        let s = T::from_f64(scale);
        let inner = shape.last().copied().unwrap_or(1).max(1);
        let is = st.last().copied().unwrap_or(0);
        for (r, row) in ov.chunks_mut(inner).enumerate() {
            let mut rr = r;
            let mut off = 0;
            for d in (0..shape.len().saturating_sub(1)).rev() {
                off += (rr % shape[d]) * st[d];
                rr /= shape[d];
            }
            for (j, v) in row.iter_mut().enumerate() {
                *v = dv[off + j * is] * s;
            }
        }
        Ok(())
    }
    let scale = if mean { 1.0 / count.max(1) as f64 } else { 1.0 };
    crate::dispatch_float!(dy.dtype, node, go::<T>(dy, o, &shape, &keep, scale))
}

pub fn register(t: &mut KernelTable) {
    for op in ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"] {
        t.add(op, reduce);
    }
    t.add("ReduceGrad", reduce_grad);
}
