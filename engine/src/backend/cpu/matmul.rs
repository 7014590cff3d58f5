//! CPU kernels of ops/matmul.rs on the `gemm` crate, or on the bf16 GEMM (bf16/) when the
//! session's matmul path is bf16 and the operands are f32. Batched products fold the batch into M
//! (or K) where the layout allows, so that one large gemm call replaces many small ones.

use std::any::TypeId;
use std::cell::Cell;

use gemm::Parallelism;
use rayon::prelude::*;

use super::bf16::{self, MatRef, MatmulPath};
use super::broadcast::bcast_strides;
use super::elementwise::{first, FloatElem};
use super::linear::column_sums;
use super::tensor_view::{In, Out};
use super::{CpuCtx, KernelTable};
use crate::error::Result;
use crate::ir::Node;
use crate::ops::util::broadcast_shapes;

/// The largest m·n·k of one batch of a batched product that runs whole on one thread (the
/// batches then spread over the threads): 2 M multiply-adds, ~20 µs on one core.
const SMALL_PRODUCT: usize = 1 << 21;

/// Row-major matrix operand: pointer plus (row stride, column stride) for the logical view.
#[derive(Clone, Copy)]
pub(super) struct Mat<T> {
    pub ptr: *const T,
    pub rs: isize,
    pub cs: isize,
}

thread_local! {
    /// Set while this thread's matmuls must not fork (see `on_this_thread`).
    static ONE_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with every matmul it makes on the calling thread alone: for callers that already
/// run several independent products side by side, one per thread.
pub fn on_this_thread<R>(f: impl FnOnce() -> R) -> R {
    let before = ONE_THREAD.with(|c| c.replace(true));
    let r = f();
    ONE_THREAD.with(|c| c.set(before));
    r
}

fn one_thread() -> bool {
    ONE_THREAD.with(|c| c.get())
}

/// dst[m×n] = (accumulate ? dst : 0) + alpha · lhs[m×k] · rhs[k×n]; f32 products go through
/// the bf16 GEMM when `path` says so. Multithreaded over rayon's pool unless the product is
/// small or the caller runs `on_this_thread`.
///
/// # Safety
/// The pointers must cover the m×k, k×n and m×n views with the given strides, dst not
/// overlapping the operands.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_call<T: FloatElem + 'static>(
    path: MatmulPath,
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    lhs: Mat<T>,
    rhs: Mat<T>,
    alpha: T,
    accumulate: bool,
) {
    // SAFETY: the caller's contract; dst is row-major contiguous (row stride n).
    unsafe { gemm_call_ld(path, m, n, k, dst, n, lhs, rhs, alpha, accumulate) }
}

/// As `gemm_call`, with dst's rows `ldc` elements apart (ldc ≥ n).
///
/// # Safety
/// As `gemm_call`, dst covering m rows of n at stride ldc.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_call_ld<T: FloatElem + 'static>(
    path: MatmulPath,
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    ldc: usize,
    lhs: Mat<T>,
    rhs: Mat<T>,
    alpha: T,
    accumulate: bool,
) {
    if let (MatmulPath::Bf16(isa), true) = (path, TypeId::of::<T>() == TypeId::of::<f32>()) {
        let f32_view = |x: Mat<T>| MatRef { ptr: x.ptr as *const f32, rs: x.rs, cs: x.cs };
        let beta = if accumulate { 1.0 } else { 0.0 };
        // SAFETY: T is f32, so the pointer casts are identities; the views are the caller's.
        unsafe { bf16::gemm(isa, m, n, k, alpha.as_() as f32, f32_view(lhs), f32_view(rhs), beta, dst as *mut f32, ldc, !one_thread()) };
        return;
    }
    let flops = m * n * k;
    let par = if flops >= 1 << 16 && !one_thread() { Parallelism::Rayon(0) } else { Parallelism::None };
    // SAFETY: forwarded from the caller's contract; dst is row-major (rs = ldc, cs = 1).
    unsafe { crate_gemm(m, n, k, dst, ldc as isize, 1, lhs, rhs, alpha, accumulate, par) }
}

/// The most bytes of packed right-hand side one call into the `gemm` crate may allocate. The
/// crate packs a k-block of all n columns into a buffer it allocates and frees on every call
/// (23 MB for the tutorial's LM head, 200 × 28782 f32); glibc then serves such blocks from its
/// heap and keeps the freed ones, which fragments and grew the process by ~45 MiB over ten steps.
/// Wider products are therefore split into column blocks that each pack about this much (blocks
/// of at least 64 columns keep the crate's k blocking, which depends on k alone for them, so
/// every sum runs in the same order: the results are unchanged).
const PACK_BUDGET_BYTES: usize = 2 << 20;

/// The crate's k-block upper bound (its `kernel_params` picks kc ≤ max(512, …) and ≤ k; 512
/// covers the f32/f64 kernels on x86 and aarch64).
const CRATE_KC_MAX: usize = 512;

/// Columns per `gemm` crate call: all n when the packed right-hand side fits PACK_BUDGET_BYTES,
/// else a multiple of 64 columns that does.
fn column_block<T>(n: usize, k: usize) -> usize {
    let per_col = k.clamp(1, CRATE_KC_MAX) * std::mem::size_of::<T>();
    let cols = (PACK_BUDGET_BYTES / per_col.max(1)) / 64 * 64;
    if cols == 0 || cols >= n {
        n
    } else {
        cols
    }
}

/// dst[m×n] = alpha · lhs · rhs (+ dst when `accumulate`) on the `gemm` crate, dst at explicit
/// strides, in column blocks of `column_block` (see PACK_BUDGET_BYTES).
///
/// # Safety
/// As gemm_call, with dst covering the m×n view at (dst_rs, dst_cs).
#[allow(clippy::too_many_arguments)]
unsafe fn crate_gemm<T: FloatElem + 'static>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    dst_rs: isize,
    dst_cs: isize,
    lhs: Mat<T>,
    rhs: Mat<T>,
    alpha: T,
    accumulate: bool,
    par: Parallelism,
) {
    let block = column_block::<T>(n, k).max(1);
    let mut j0 = 0;
    while j0 < n || (j0 == 0 && n == 0) {
        // a short last block would take the crate's small-matrix path (another k blocking):
        // the last block takes the rest instead when fewer than 2 × 64 columns would remain
        let rest = n - j0;
        let cols = if rest < block + 128 { rest } else { block };
        let off = j0 as isize;
        // SAFETY: columns j0..j0 + cols of the caller's n-column views of dst and rhs (the
        // caller's contract covers them); for n = 0 one call with no columns, as before.
        unsafe {
            gemm::gemm(
                m,
                cols,
                k,
                dst.offset(off * dst_cs),
                dst_cs,
                dst_rs,
                accumulate,
                lhs.ptr,
                lhs.cs,
                lhs.rs,
                rhs.ptr.offset(off * rhs.cs),
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
        if n == 0 {
            break;
        }
        j0 += cols;
    }
}

/// dst[m×n] (+)= lhs[m×k] · rhs[k×n] on the calling thread alone (the `gemm` crate, no
/// parallelism), dst with explicit strides: for callers that split the work among threads.
///
/// # Safety
/// As gemm_call, with dst covering the m×n view at (dst_rs, dst_cs).
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_serial<T: FloatElem + 'static>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    dst_rs: isize,
    dst_cs: isize,
    lhs: Mat<T>,
    rhs: Mat<T>,
    accumulate: bool,
) {
    // SAFETY: forwarded from the caller's contract.
    unsafe { crate_gemm(m, n, k, dst, dst_rs, dst_cs, lhs, rhs, T::one(), accumulate, Parallelism::None) }
}

/// out = alpha · op(a) · op(b), batched with broadcasting; out's batch dims may be fewer than the
/// broadcast batch (those batches are summed), as FusedMatMul's target shape asks.
#[allow(clippy::too_many_arguments)]
fn batched<T: FloatElem + 'static>(
    path: MatmulPath,
    node: &Node,
    a: &In,
    b: &In,
    o: &mut Out,
    ta: bool,
    tb: bool,
    alpha: f64,
    accumulate: bool,
) -> Result<()> {
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
        unsafe { gemm_call(path, batch_a * m, n, k, ov.as_mut_ptr(), mat_a(0, batch_a * m), mat_b(0), alpha, accumulate) };
        return Ok(());
    }
    // fast path 2: aᵀ·b over identical batches summed into one 2-D output: fold the batch into K
    if ta && !tb && batch_out == 1 && ba == bb && batch_a > 1 {
        let kk = k * batch_a;
        let lhs = Mat { ptr: av.as_ptr(), rs: 1, cs: m as isize };
        let rhs = Mat { ptr: bv.as_ptr(), rs: n as isize, cs: 1 };
        // SAFETY: a is [batch·k, m] and b is [batch·k, n] row-major; out is m×n.
        unsafe { gemm_call(path, m, n, kk, ov.as_mut_ptr(), lhs, rhs, alpha, accumulate) };
        return Ok(());
    }
    let sa = bcast_strides(ba, &full);
    let sb = bcast_strides(bb, &full);
    let so = bcast_strides(&out_batch, &full);
    let reduced = batch_out != batch_full;
    if reduced && !accumulate {
        ov.iter_mut().for_each(|v| *v = T::zero());
    }
    let offsets = |bi: usize| {
        let (mut r, mut oa, mut ob, mut oo) = (bi, 0, 0, 0);
        for d in (0..full.len()).rev() {
            let i = r % full[d];
            r /= full[d];
            oa += i * sa[d];
            ob += i * sb[d];
            oo += i * so[d];
        }
        (oa, ob, oo)
    };
    // Many small products (attention's per-head score and value products) run one per thread
    // instead of each being split across the threads; summed batches share an output and stay
    // in order.
    let spread = !reduced && batch_full > 1 && m * n * k <= SMALL_PRODUCT && rayon::current_num_threads() > 1 && !one_thread();
    if spread {
        let (op, out_len) = (ov.as_mut_ptr() as usize, ov.len());
        (0..batch_full).into_par_iter().for_each(|bi| {
            let (oa, ob, oo) = offsets(bi);
            debug_assert!(oo * m * n + m * n <= out_len);
            // SAFETY: batch offsets index whole matrices inside each buffer; without a summed
            // batch each output batch is written by exactly one task.
            on_this_thread(|| unsafe {
                gemm_call(path, m, n, k, (op as *mut T).add(oo * m * n), mat_a(oa * m * k, m), mat_b(ob * k * n), alpha, accumulate)
            });
        });
        return Ok(());
    }
    for bi in 0..batch_full {
        let (oa, ob, oo) = offsets(bi);
        // SAFETY: batch offsets index whole matrices inside each buffer.
        unsafe {
            gemm_call(path, m, n, k, ov[oo * m * n..].as_mut_ptr(), mat_a(oa * m * k, m), mat_b(ob * k * n), alpha, accumulate || reduced)
        };
    }
    Ok(())
}

fn second<'a, 'b>(node: &Node, inputs: &'b [Option<In<'a>>]) -> Result<&'b In<'a>> {
    inputs.get(1).and_then(|x| x.as_ref()).ok_or_else(|| node.err("input 1 missing"))
}

fn matmul(node: &Node, inputs: &[Option<In>], out: &mut [Out], ctx: &mut CpuCtx) -> Result<()> {
    let (a, b) = (first(node, inputs)?, second(node, inputs)?);
    crate::dispatch_float!(a.dtype, node, batched::<T>(ctx.matmul, node, a, b, &mut out[0], false, false, 1.0, false))
}

fn fused_matmul(node: &Node, inputs: &[Option<In>], out: &mut [Out], ctx: &mut CpuCtx) -> Result<()> {
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
    crate::dispatch_float!(a.dtype, node, batched::<T>(ctx.matmul, node, &a, &b, &mut o, ta, tb, alpha, false))
}

fn gemm_op(node: &Node, inputs: &[Option<In>], out: &mut [Out], ctx: &mut CpuCtx) -> Result<()> {
    let (a, b) = (first(node, inputs)?, second(node, inputs)?);
    let ta = node.attrs.int("transA", 0)? != 0;
    let tb = node.attrs.int("transB", 0)? != 0;
    let alpha = node.attrs.float("alpha", 1.0)? as f64;
    let beta = node.attrs.float("beta", 1.0)? as f64;
    let c = inputs.get(2).and_then(|x| x.as_ref());
    #[allow(clippy::too_many_arguments)]
    fn go<T: FloatElem + 'static>(
        path: MatmulPath,
        node: &Node,
        a: &In,
        b: &In,
        c: Option<&In>,
        o: &mut Out,
        ta: bool,
        tb: bool,
        alpha: f64,
        beta: f64,
    ) -> Result<()> {
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
        batched::<T>(path, node, a, b, o, ta, tb, alpha, accumulate)
    }
    crate::dispatch_float!(a.dtype, node, go::<T>(ctx.matmul, node, a, b, c, &mut out[0], ta, tb, alpha, beta))
}

/// MatMulGeluGrad (ops/matmul_gelu_grad.rs): the product into the output, then the GELU's
/// gradient over it (in f32 for 16-bit tensors: backend/cpu/widen.rs widens them, so the
/// product is rounded once, as cuBLASLt's epilogue rounds it), then output 1's sums of its rows.
fn matmul_gelu_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], ctx: &mut CpuCtx) -> Result<()> {
    let (a, b) = (first(node, inputs)?, second(node, inputs)?);
    let x = inputs.get(2).and_then(|x| x.as_ref()).ok_or_else(|| node.err("input 2 (the GELU input) missing"))?;
    let ta = node.attrs.int("transA", 0)? != 0;
    let tb = node.attrs.int("transB", 0)? != 0;
    let (m, k, n, _) = crate::ops::matmul_gelu_grad::product_dims(node, a.shape, b.shape)?;
    let (rows_a, rows_o) = (if ta { [k, m] } else { [m, k] }, [m, n]);
    let a = a.reshaped(&rows_a);
    let mut o = out[0].reshaped(&rows_o);
    crate::dispatch_float!(a.dtype, node, batched::<T>(ctx.matmul, node, &a, b, &mut o, ta, tb, 1.0, false))?;
    super::activation::gelu_tanh_grad_in_place(node, x, &mut out[0])?;
    let [y, sums] = out else { return Ok(()) };
    let y = y.as_input();
    let y = y.reshaped(&rows_o);
    crate::dispatch_float!(y.dtype, node, column_sums::<T>(&y, sums))
}

pub fn register(t: &mut KernelTable) {
    t.add("MatMul", matmul);
    t.add("MatMulGeluGrad", matmul_gelu_grad);
    t.add("FusedMatMul", fused_matmul);
    t.add("Gemm", gemm_op);
}

#[cfg(test)]
mod tests {
    use super::super::bf16::{detect, MatmulPath};
    use super::super::testutil::{run, try_run_ctx};
    use super::super::CpuCtx;
    use crate::ir::{Attr, Attrs};
    use crate::tensor::Tensor;

    /// Products wider than one packing block (column_block) are split into blocks: the result
    /// equals one unsplit call bit for bit, for a contiguous and a transposed right-hand side,
    /// with accumulation.
    #[test]
    fn column_blocks_give_the_unsplit_result() {
        let (m, k, n) = (37, 600, 2 * super::column_block::<f32>(usize::MAX, 600) + 200);
        assert!(super::column_block::<f32>(n, k) < n, "the case must split");
        let (a, b) = (vals(m * k, 1), vals(k * n, 2));
        for trans in [false, true] {
            // op(B) [k, n]: B stored [k, n] (rs n, cs 1) or as its transpose [n, k] (rs 1, cs k)
            let bt: Vec<f32> = if trans { (0..n * k).map(|i| b[(i % k) * n + i / k]).collect() } else { b.clone() };
            let rhs = if trans {
                super::Mat { ptr: bt.as_ptr(), rs: 1, cs: k as isize }
            } else {
                super::Mat { ptr: bt.as_ptr(), rs: n as isize, cs: 1 }
            };
            let lhs = super::Mat { ptr: a.as_ptr(), rs: k as isize, cs: 1 };
            let (mut split, mut whole) = (vals(m * n, 3), vals(m * n, 3));
            // SAFETY: every view lies inside its vector; dst is distinct from the operands.
            unsafe {
                super::crate_gemm(m, n, k, split.as_mut_ptr(), n as isize, 1, lhs, rhs, 0.5, true, gemm::Parallelism::Rayon(0));
                gemm::gemm(
                    m,
                    n,
                    k,
                    whole.as_mut_ptr(),
                    1,
                    n as isize,
                    true,
                    a.as_ptr(),
                    1,
                    k as isize,
                    rhs.ptr,
                    rhs.cs,
                    rhs.rs,
                    1.0,
                    0.5,
                    false,
                    false,
                    false,
                    gemm::Parallelism::Rayon(0),
                );
            }
            assert!(split.iter().zip(&whole).all(|(x, y)| x.to_bits() == y.to_bits()), "trans {trans}");
        }
    }

    /// Small batched products spread over the threads (one whole product per thread) give the
    /// definition's result, with broadcast batches, transposes and alpha; so do the same
    /// products on one thread (`on_this_thread`).
    #[test]
    fn small_batches_spread_over_threads_match_the_definition() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap_or_else(|e| panic!("{e}"));
        // a [4, 1, 35, 20] · b [1, 3, 20, 30] → [4, 3, 35, 30]; FusedMatMul transB, alpha 0.5:
        // a [2, 5, 35, 20] · b[2, 5, 30, 20]ᵀ → [2, 5, 35, 30]
        let tb = Attrs::default().with("transB", Attr::Int(1)).with("alpha", Attr::Float(0.5));
        let cases = [("MatMul", Attrs::default(), [4usize, 1], [1usize, 3], false, 1.0), ("FusedMatMul", tb, [2, 5], [2, 5], true, 0.5)];
        for (op, attrs, ba, bb, trans_b, alpha) in cases {
            let (m, k, n) = (35usize, 20usize, 30usize);
            let (na, nb) = (ba[0] * ba[1], bb[0] * bb[1]);
            let a = Tensor::from_f32(vec![ba[0], ba[1], m, k], vals(na * m * k, 1));
            let bshape = if trans_b { vec![bb[0], bb[1], n, k] } else { vec![bb[0], bb[1], k, n] };
            let b = Tensor::from_f32(bshape, vals(nb * k * n, 2));
            let (av, bv) = (a.to_f64_vec(), b.to_f64_vec());
            let full = [ba[0].max(bb[0]), ba[1].max(bb[1])];
            let mut want = vec![0f64; full[0] * full[1] * m * n];
            for (i0, i1) in (0..full[0]).flat_map(|i| (0..full[1]).map(move |j| (i, j))) {
                let ia = (i0 % ba[0]) * ba[1] + i1 % ba[1];
                let ib = (i0 % bb[0]) * bb[1] + i1 % bb[1];
                for (r, c) in (0..m).flat_map(|r| (0..n).map(move |c| (r, c))) {
                    let bat = |kk: usize| if trans_b { bv[ib * n * k + c * k + kk] } else { bv[ib * k * n + kk * n + c] };
                    let dot: f64 = (0..k).map(|kk| av[ia * m * k + r * k + kk] * bat(kk)).sum();
                    want[((i0 * full[1] + i1) * m + r) * n + c] = alpha * dot;
                }
            }
            for one_thread in [false, true] {
                let got = pool.install(|| {
                    let go = || try_run_ctx(op, attrs.clone(), &[&a, &b], &mut CpuCtx::new(0)).unwrap_or_else(|e| panic!("{op}: {e}"));
                    if one_thread {
                        super::on_this_thread(go)
                    } else {
                        go()
                    }
                });
                assert_eq!(got[0].shape, vec![full[0], full[1], m, n], "{op}");
                let d = got[0].to_f64_vec().iter().zip(&want).fold(0f64, |x, (g, w)| x.max((g - w).abs()));
                assert!(d < 1e-4, "{op} (one thread: {one_thread}): {d:.2e}");
            }
        }
    }

    fn vals(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2654435761).wrapping_add(seed * 97)) % 1999) as f32 / 997.0 - 1.0 + 1e-4 * i as f32)
            .collect()
    }

    fn rounded(t: &Tensor) -> Tensor {
        let v = t.to_f64_vec().iter().map(|&x| f32::from_bits(((super::super::bf16::round_bits(x as f32)) as u32) << 16)).collect();
        Tensor::from_f32(t.shape.clone(), v)
    }

    /// Every matmul kernel on the bf16 path equals the fp32 kernel on bf16-rounded inputs
    /// (forward MatMul, the gradient FusedMatMuls with transposes, alpha and the batch folded
    /// into K, Gemm with a bias), and differs from the unrounded fp32 result.
    #[test]
    fn bf16_path_equals_fp32_on_rounded_inputs() {
        let Some(isa) = detect() else {
            eprintln!("skipped: no bf16 instruction set on this CPU");
            return;
        };
        let t = |shape: Vec<usize>, seed| Tensor::from_f32(shape.clone(), vals(shape.iter().product(), seed));
        let ta = Attrs::default().with("transA", Attr::Int(1));
        let tb = Attrs::default().with("transB", Attr::Int(1)).with("alpha", Attr::Float(0.5));
        let gemm = Attrs::default().with("transB", Attr::Int(1)).with("beta", Attr::Float(0.25));
        let cases: Vec<(&str, Attrs, Vec<Tensor>)> = vec![
            ("MatMul", Attrs::default(), vec![t(vec![5, 7, 40], 1), t(vec![40, 33], 2)]),
            ("MatMul", Attrs::default(), vec![t(vec![3, 9, 20], 3), t(vec![3, 20, 17], 4)]),
            ("FusedMatMul", ta, vec![t(vec![5, 7, 40], 5), t(vec![5, 7, 33], 6)]),
            ("FusedMatMul", tb, vec![t(vec![35, 33], 7), t(vec![40, 33], 8)]),
            ("Gemm", gemm, vec![t(vec![19, 30], 9), t(vec![21, 30], 10), t(vec![21], 11)]),
        ];
        for (op, attrs, ins) in cases {
            let refs: Vec<&Tensor> = ins.iter().collect();
            let mut ctx = CpuCtx::new(0).with_matmul(MatmulPath::Bf16(isa));
            let got = try_run_ctx(op, attrs.clone(), &refs, &mut ctx).unwrap_or_else(|e| panic!("{op}: {e}"))[0].to_f64_vec();
            // the bias of Gemm is not a matmul operand: keep it unrounded
            let r: Vec<Tensor> = ins.iter().enumerate().map(|(i, x)| if i < 2 { rounded(x) } else { x.clone() }).collect();
            let want = run(op, attrs.clone(), &r.iter().collect::<Vec<_>>())[0].to_f64_vec();
            let exact = run(op, attrs, &refs)[0].to_f64_vec();
            let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
            let d = got.iter().zip(&want).fold(0f64, |m, (a, b)| m.max((a - b).abs())) / scale;
            let d_exact = got.iter().zip(&exact).fold(0f64, |m, (a, b)| m.max((a - b).abs())) / scale;
            assert!(d < 1e-5, "{op}: bf16 path vs fp32 on rounded inputs: {d:.2e}");
            assert!(d_exact > 1e-4, "{op}: bf16 path looks unrounded ({d_exact:.2e} from fp32)");
        }
    }

    #[test]
    fn f64_matmuls_ignore_the_bf16_path() {
        let Some(isa) = detect() else {
            return;
        };
        let a = Tensor::new(vec![2, 2], crate::tensor::Data::F64(vec![1.0 + 1e-9, 2.0, 3.0, 4.0])).unwrap_or_else(|e| panic!("{e}"));
        let mut ctx = CpuCtx::new(0).with_matmul(MatmulPath::Bf16(isa));
        let got = try_run_ctx("MatMul", Attrs::default(), &[&a, &a], &mut ctx).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(got[0].to_f64_vec(), run("MatMul", Attrs::default(), &[&a, &a])[0].to_f64_vec());
    }
}
