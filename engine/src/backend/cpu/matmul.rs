//! CPU kernels of ops/matmul.rs on the `gemm` crate. Batched products fold the batch into M (or
//! K) where the layout allows, so that one large gemm call replaces many small ones.

use gemm::Parallelism;

use super::broadcast::bcast_strides;
use super::elementwise::{first, FloatElem};
use super::tensor_view::{In, Out};
use super::{CpuCtx, KernelTable};
use crate::error::Result;
use crate::ir::Node;
use crate::ops::util::broadcast_shapes;

/// Row-major matrix operand: pointer plus (row stride, column stride) for the logical view.
#[derive(Clone, Copy)]
pub(super) struct Mat<T> {
    pub ptr: *const T,
    pub rs: isize,
    pub cs: isize,
}

/// dst[m×n] = (accumulate ? dst : 0) + alpha · lhs[m×k] · rhs[k×n]
///
/// # Safety
/// The pointers must cover the m×k, k×n and m×n views with the given strides, dst not
/// overlapping the operands.
pub(super) unsafe fn gemm_call<T: FloatElem>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    lhs: Mat<T>,
    rhs: Mat<T>,
    alpha: T,
    accumulate: bool,
) {
    let flops = m * n * k;
    let par = if flops >= 1 << 16 { Parallelism::Rayon(0) } else { Parallelism::None };
    // SAFETY: forwarded from the caller's contract; dst is row-major contiguous (rs = n, cs = 1).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            n as isize,
            accumulate,
            lhs.ptr,
            lhs.cs,
            lhs.rs,
            rhs.ptr,
            rhs.cs,
            rhs.rs,
            T::one(),
            alpha,
            false,
            false,
            false,
            par,
        );
    }
}

/// out = alpha · op(a) · op(b), batched with broadcasting; out's batch dims may be fewer than the
/// broadcast batch (those batches are summed), as FusedMatMul's target shape asks.
fn batched<T: FloatElem>(node: &Node, a: &In, b: &In, o: &mut Out, ta: bool, tb: bool, alpha: f64, accumulate: bool) -> Result<()> {
    let a2: Vec<usize> = if a.shape.len() == 1 { vec![1, a.shape[0]] } else { a.shape.to_vec() };
    let b2: Vec<usize> = if b.shape.len() == 1 { vec![b.shape[0], 1] } else { b.shape.to_vec() };
    let (ra, rb) = (a2.len(), b2.len());
    let (m, k) = if ta { (a2[ra - 1], a2[ra - 2]) } else { (a2[ra - 2], a2[ra - 1]) };
    let n = if tb { b2[rb - 2] } else { b2[rb - 1] };
    let (ba, bb) = (&a2[..ra - 2], &b2[..rb - 2]);
    let full = broadcast_shapes(node, &[ba, bb])?;
    let out_numel = o.numel();
    let out_batch: Vec<usize> = if a.shape.len() > 1 && b.shape.len() > 1 { o.shape[..o.shape.len() - 2].to_vec() } else { full.clone() };
    let alpha = T::from_f64(alpha);
    let av = a.slice::<T>()?;
    let bv = b.slice::<T>()?;
    let ov = o.slice::<T>()?;
    if out_numel == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            ov.iter_mut().for_each(|v| *v = T::zero());
        }
        return Ok(());
    }
    // strides of the logical (possibly transposed) matrices inside one batch
    let mat_a = |off: usize, rows_total: usize| -> Mat<T> {
        let _ = rows_total;
        // SAFETY (of the later use): offsets stay inside av by construction of the batch loops.
        let ptr = av[off..].as_ptr();
        if ta {
            Mat { ptr, rs: 1, cs: m as isize }
        } else {
            Mat { ptr, rs: k as isize, cs: 1 }
        }
    };
    let mat_b = |off: usize| -> Mat<T> {
        let ptr = bv[off..].as_ptr();
        if tb {
            Mat { ptr, rs: 1, cs: k as isize }
        } else {
            Mat { ptr, rs: n as isize, cs: 1 }
        }
    };
    let batch_a: usize = ba.iter().product();
    let batch_full: usize = full.iter().product();
    let batch_out: usize = out_batch.iter().product();
    // fast path 1: b has no batch and a is not transposed: fold a's batch into M
    if bb.is_empty() && !ta && batch_out == batch_a {
        // SAFETY: a is [batch·m, k] row-major, b is k×n, out is [batch·m, n].
        unsafe { gemm_call(batch_a * m, n, k, ov.as_mut_ptr(), mat_a(0, batch_a * m), mat_b(0), alpha, accumulate) };
        return Ok(());
    }
    // fast path 2: aᵀ·b over identical batches summed into one 2-D output: fold the batch into K
    if ta && !tb && batch_out == 1 && ba == bb && batch_a > 1 {
        let kk = k * batch_a;
        let lhs = Mat { ptr: av.as_ptr(), rs: 1, cs: m as isize };
        let rhs = Mat { ptr: bv.as_ptr(), rs: n as isize, cs: 1 };
        // SAFETY: a is [batch·k, m] and b is [batch·k, n] row-major; out is m×n.
        unsafe { gemm_call(m, n, kk, ov.as_mut_ptr(), lhs, rhs, alpha, accumulate) };
        return Ok(());
    }
    let sa = bcast_strides(ba, &full);
    let sb = bcast_strides(bb, &full);
    let so = bcast_strides(&out_batch, &full);
    let reduced = batch_out != batch_full;
    if reduced && !accumulate {
        ov.iter_mut().for_each(|v| *v = T::zero());
    }
    for bi in 0..batch_full {
        let (mut r, mut oa, mut ob, mut oo) = (bi, 0, 0, 0);
        for d in (0..full.len()).rev() {
            let i = r % full[d];
            r /= full[d];
            oa += i * sa[d];
            ob += i * sb[d];
            oo += i * so[d];
        }
        // SAFETY: batch offsets index whole matrices inside each buffer.
        unsafe { gemm_call(m, n, k, ov[oo * m * n..].as_mut_ptr(), mat_a(oa * m * k, m), mat_b(ob * k * n), alpha, accumulate || reduced) };
    }
    Ok(())
}

fn second<'a, 'b>(node: &Node, inputs: &'b [Option<In<'a>>]) -> Result<&'b In<'a>> {
    inputs.get(1).and_then(|x| x.as_ref()).ok_or_else(|| node.err("input 1 missing"))
}

fn matmul(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let (a, b) = (first(node, inputs)?, second(node, inputs)?);
    crate::dispatch_float!(a.dtype, node, batched::<T>(node, a, b, &mut out[0], false, false, 1.0, false))
}

fn fused_matmul(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let (a, b) = (first(node, inputs)?, second(node, inputs)?);
    let ta = node.attrs.int("transA", 0)? != 0;
    let tb = node.attrs.int("transB", 0)? != 0;
    let alpha = node.attrs.float("alpha", 1.0)? as f64;
    // a MatMul gradient with 1-D operands: the same memory seen with the dropped dims restored
    let target = if inputs.get(2).is_some_and(|x| x.is_some()) { Some(out[0].shape) } else { None };
    let (sa, sb, st) = crate::ops::matmul_fused_shapes(node, a.shape, b.shape, target)?;
    let st = st.unwrap_or_else(|| out[0].shape.to_vec());
    let (a, b) = (a.reshaped(&sa), b.reshaped(&sb));
    let mut o = out[0].reshaped(&st);
    crate::dispatch_float!(a.dtype, node, batched::<T>(node, &a, &b, &mut o, ta, tb, alpha, false))
}

fn gemm_op(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let (a, b) = (first(node, inputs)?, second(node, inputs)?);
    let ta = node.attrs.int("transA", 0)? != 0;
    let tb = node.attrs.int("transB", 0)? != 0;
    let alpha = node.attrs.float("alpha", 1.0)? as f64;
    let beta = node.attrs.float("beta", 1.0)? as f64;
    let c = inputs.get(2).and_then(|x| x.as_ref());
    fn go<T: FloatElem>(node: &Node, a: &In, b: &In, c: Option<&In>, o: &mut Out, ta: bool, tb: bool, alpha: f64, beta: f64) -> Result<()> {
        let accumulate = match c {
            Some(c) if beta != 0.0 => {
                let shape = o.shape.to_vec();
                let cv = c.slice::<T>()?;
                let st = bcast_strides(c.shape, &shape);
                let beta = T::from_f64(beta);
                let n = shape[1];
                let ov = o.slice::<T>()?;
                for (i, row) in ov.chunks_mut(n.max(1)).enumerate() {
                    for (j, v) in row.iter_mut().enumerate() {
                        *v = beta * cv[i * st[0] + j * st[1]];
                    }
                }
                true
            }
            _ => false,
        };
        batched::<T>(node, a, b, o, ta, tb, alpha, accumulate)
    }
    crate::dispatch_float!(a.dtype, node, go::<T>(node, a, b, c, &mut out[0], ta, tb, alpha, beta))
}

pub fn register(t: &mut KernelTable) {
    t.add("MatMul", matmul);
    t.add("FusedMatMul", fused_matmul);
    t.add("Gemm", gemm_op);
}
