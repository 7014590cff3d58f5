//! CPU kernels of ops/internal.rs.

use super::broadcast::{bcast_strides, map1, map2};
use super::elementwise::{first, Arith, FloatElem};
use super::tensor_view::{In, Out};
use super::{CpuCtx, KernelTable};
use crate::error::Result;
use crate::ir::Node;
use num_traits::AsPrimitive;

fn reduce_sum_to(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    // summed in f64 and rounded once (PyTorch's sums are pairwise: a long f32 running sum, the
    // bias gradient over every row, drifts further, and Adam turns that into visible steps)
    fn go<T: Arith>(x: &In, o: &mut Out) -> Result<()>
    where
        f64: AsPrimitive<T>,
    {
        let target = o.shape.to_vec();
        let xv = x.slice::<T>()?;
        let ov = o.slice::<T>()?;
        if target.iter().product::<usize>() == xv.len() {
            ov.copy_from_slice(xv);
            return Ok(());
        }
        let mut acc = vec![0f64; ov.len()];
        let shape = x.shape;
        let strides = bcast_strides(&target, shape);
        let inner = shape.last().copied().unwrap_or(1);
        let inner_stride = strides.last().copied().unwrap_or(0);
        for (r, row) in xv.chunks(inner.max(1)).enumerate() {
            let mut rr = r;
            let mut off = 0;
            for d in (0..shape.len().saturating_sub(1)).rev() {
                off += (rr % shape[d]) * strides[d];
                rr /= shape[d];
            }
            if inner_stride == 0 {
                acc[off] += row.iter().map(|&v| v.as_()).sum::<f64>();
            } else {
                for (a, &v) in acc[off..off + row.len()].iter_mut().zip(row) {
                    *a += v.as_();
                }
            }
        }
        ov.iter_mut().zip(&acc).for_each(|(o, &a)| *o = a.as_());
        Ok(())
    }
    let x = first(node, inputs)?;
    crate::dispatch_num!(x.dtype, node, go::<T>(x, &mut out[0]))
}

fn affine(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let alpha = node.attrs.float("alpha", 1.0)? as f64;
    let beta = node.attrs.float("beta", 0.0)? as f64;
    fn go<T: FloatElem>(x: &In, o: &mut Out, a: f64, b: f64) -> Result<()> {
        let (a, b) = (T::from_f64(a), T::from_f64(b));
        map1::<T, T>(x, o, move |v| v * a + b)
    }
    let x = first(node, inputs)?;
    crate::dispatch_float!(x.dtype, node, go::<T>(x, &mut out[0], alpha, beta))
}

fn mask_select(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let keep = node.attrs.int("keep", 1)? != 0;
    let c = first(node, inputs)?;
    let x = inputs.get(1).and_then(|v| v.as_ref()).ok_or_else(|| node.err("input 1 missing"))?;
    fn go<T: Arith>(c: &In, x: &In, o: &mut Out, keep: bool) -> Result<()> {
        map2::<u8, T, T>(c, x, o, move |c, v| if (c != 0) == keep { v } else { T::zero() })
    }
    crate::dispatch_num!(x.dtype, node, go::<T>(c, x, &mut out[0], keep))
}

fn erf_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    fn go<T: FloatElem>(dy: &In, x: &In, o: &mut Out) -> Result<()> {
        let k = T::from_f64(std::f64::consts::FRAC_2_SQRT_PI);
        map2::<T, T, T>(dy, x, o, move |d, v| d * k * (-(v * v)).exp())
    }
    let dy = first(node, inputs)?;
    let x = inputs.get(1).and_then(|v| v.as_ref()).ok_or_else(|| node.err("input 1 missing"))?;
    crate::dispatch_float!(dy.dtype, node, go::<T>(dy, x, &mut out[0]))
}

pub fn register(t: &mut KernelTable) {
    t.add("ReduceSumTo", reduce_sum_to);
    t.add("Affine", affine);
    t.add("MaskSelect", mask_select);
    t.add("ErfGrad", erf_grad);
}
