//! CPU kernels of ops/linear.rs: Linear (bias rows, or the residual plus the bias, written
//! first, then one gemm accumulating into them; with a GELU, the product into output 1 and the
//! GELU of it into output 0), FlattenRows (a copy, for when the plan could not make it a view) and SumRows
//! (column sums, split across threads by column blocks).

use rayon::prelude::*;

use super::bf16::MatmulPath;
use super::elementwise::{first, FloatElem};
use super::matmul::{gemm_call, Mat};
use super::tensor_view::{In, Out};
use super::{CpuCtx, KernelTable, PAR_MIN};
use crate::error::Result;
use crate::ir::Node;
use crate::ops::linear::linear_dims;

fn linear(node: &Node, inputs: &[Option<In>], out: &mut [Out], ctx: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let w = inputs.get(1).and_then(|v| v.as_ref()).ok_or_else(|| node.err("input 1 (weight) missing"))?;
    let b = inputs.get(2).and_then(|v| v.as_ref());
    let r = inputs.get(3).and_then(|v| v.as_ref());
    let tb = node.attrs.int("transB", 0)? != 0;
    let (k, n) = linear_dims(node, w.shape)?;
    #[allow(clippy::too_many_arguments)]
    fn go<T: FloatElem + 'static>(
        path: MatmulPath,
        x: &In,
        w: &In,
        b: Option<&In>,
        r: Option<&In>,
        o: &mut Out,
        k: usize,
        n: usize,
        tb: bool,
    ) -> Result<()> {
        let (xv, wv, ov) = (x.slice::<T>()?, w.slice::<T>()?, o.slice::<T>()?);
        if ov.is_empty() {
            return Ok(());
        }
        let rows = ov.len() / n;
        // the rows the product is added to: the residual (plus the bias), or the bias
        if let Some(r) = r {
            ov.copy_from_slice(r.slice::<T>()?);
        }
        if let Some(b) = b {
            let bv = b.slice::<T>()?;
            let fill = |row: &mut [T]| match r {
                Some(_) => row.iter_mut().zip(bv).for_each(|(o, &b)| *o = *o + b),
                None => row.copy_from_slice(bv),
            };
            if ov.len() >= PAR_MIN {
                ov.par_chunks_mut(n).for_each(fill);
            } else {
                ov.chunks_mut(n).for_each(fill);
            }
        }
        let accumulate = b.is_some() || r.is_some();
        if k == 0 {
            if !accumulate {
                ov.iter_mut().for_each(|v| *v = T::zero());
            }
            return Ok(());
        }
        let lhs = Mat { ptr: xv.as_ptr(), rs: k as isize, cs: 1 };
        let rhs = if tb { Mat { ptr: wv.as_ptr(), rs: 1, cs: k as isize } } else { Mat { ptr: wv.as_ptr(), rs: n as isize, cs: 1 } };
        // SAFETY: x is [rows, k] row-major, w is [n, k] (tb) or [k, n] row-major, out is [rows, n]
        // and distinct from both (the plan never places an output over a live input).
        unsafe { gemm_call(path, rows, n, k, ov.as_mut_ptr(), lhs, rhs, T::one(), accumulate) };
        Ok(())
    }
    if !crate::ops::linear::gelu_after(node)? {
        return crate::dispatch_float!(x.dtype, node, go::<T>(ctx.matmul, x, w, b, r, &mut out[0], k, n, tb));
    }
    let [h, pre] = out else { return Err(node.err("a Linear with a GELU writes two outputs")) };
    crate::dispatch_float!(x.dtype, node, go::<T>(ctx.matmul, x, w, b, r, pre, k, n, tb))?;
    super::activation::gelu_tanh(node, &pre.as_input(), h)
}

fn flatten_rows(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let bytes = x.bytes();
    out[0].bytes().copy_from_slice(bytes);
    Ok(())
}

/// The n column sums of the [m, n] matrix `x` (its rows summed) into `o`: SumRows, and
/// MatMulGeluGrad's output 1 (backend/cpu/matmul.rs).
pub(super) fn column_sums<T: FloatElem>(x: &In, o: &mut Out) -> Result<()> {
    let n = x.shape[1];
    let xv = x.slice::<T>()?;
    let ov = o.slice::<T>()?;
    // a block of columns per task: each task walks every row over its own columns, summing
    // in f64 and rounding once (a bias gradient is a sum over every row: an f32 running sum
    // drifts further than PyTorch's pairwise one, and Adam turns that into visible steps)
    const COLS: usize = 256;
    let sum_block = |(c, dst): (usize, &mut [T])| {
        let (start, width) = (c * COLS, dst.len());
        let mut acc = [0f64; COLS];
        for row in xv.chunks_exact(n.max(1)) {
            for (a, &v) in acc.iter_mut().zip(&row[start..start + width]) {
                *a += v.as_();
            }
        }
        dst.iter_mut().zip(&acc).for_each(|(d, &a)| *d = T::from_f64(a));
    };
    if xv.len() >= PAR_MIN {
        ov.par_chunks_mut(COLS).enumerate().for_each(sum_block);
    } else {
        ov.chunks_mut(COLS).enumerate().for_each(sum_block);
    }
    Ok(())
}

fn sum_rows(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    crate::dispatch_float!(x.dtype, node, column_sums::<T>(x, &mut out[0]))
}

pub fn register(t: &mut KernelTable) {
    t.add("Linear", linear);
    t.add("FlattenRows", flatten_rows);
    t.add("SumRows", sum_rows);
}
