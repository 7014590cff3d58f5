//! The CPU's fast kernels of the fused attention (ops/attention.rs) in f32, layouts BHSD and BSHD
//! read in place with their strides. The forward pass takes blocks of query rows: one gemm makes
//! a block's scores in a per-thread buffer, vectorised rows turn them into probabilities (and
//! each row's LSE), one gemm multiplies them by V; the [T, S] scores are never stored. The
//! backward pass recomputes each block's probabilities from the saved LSE and makes dP, dV, dQ and
//! dKᵀ with four gemms, one batch matrix per task (dK and dV sum over its blocks).
//!
//! A dropout on the probabilities (ops/attention.rs) multiplies each row by its keep factors,
//! regenerated from the stream key per row (forward and backward alike), after the softmax and
//! the LSE; the backward takes dP through them and dV from the dropped probabilities.
//!
//! Keys that no query of a block sees (a mask value at or below [`HIDDEN`]: −∞ or finfo.min, a
//! causal mask's upper triangle, padding at the end) are left out of that block's products, as
//! the GPU's flash kernels skip masked tiles: a causal attention over 256 keys makes about 60% of
//! the full products. A block holding a row with no visible key keeps every key (that row's
//! softmax is over all its scores: uniform weights for finfo.min, none for −∞). Unlike the f64
//! reference (attention.rs), a NaN or an infinity in a hidden key's scores does not reach the
//! rows that do not see it.

use std::cell::RefCell;

use rayon::prelude::*;

use super::attention::{KeyPadding, Params, SETTLED};
use super::matmul::{gemm_serial, Mat};
use super::softmax::{exp_or_zero, lane_sum, row_max};
use super::vmath::LANES;
use crate::error::Result;
use crate::ir::Node;
use crate::simd::multiversion;

/// Query rows per block: the unit of the forward pass's parallelism and of the key skipping.
const BLOCK_ROWS: usize = 64;

/// A mask value at or below this hides its key: the key's exp(score − max) is 0 in f32 in every
/// row that has a visible key (finfo.min is −3.4e38, and f32 cannot hold two values near −1e37
/// less than 87 apart).
const HIDDEN: f32 = -1.0e37;

/// The f32 operands of one node: Q, Kᵀ (or K), V and the optional additive mask.
pub(super) struct Operands<'a> {
    pub q: &'a [f32],
    pub kt: &'a [f32],
    pub v: &'a [f32],
    pub mask: Option<&'a [f32]>,
}

/// The base address of an output written by several tasks, each its own elements.
#[derive(Clone, Copy)]
struct Shared(*mut f32);
// SAFETY: the tasks that share it write disjoint elements (their own batch matrix, their own
// query rows), and the slice it came from outlives them (they end before the kernel returns).
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

thread_local! {
    /// Two buffers of a block's rows × keys: scores/probabilities and dP/dS.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Runs `f` with this thread's two scratch buffers, each at least `n` elements.
fn with_scratch<R>(n: usize, f: impl FnOnce(&mut [f32], &mut [f32]) -> R) -> R {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        let (a, b) = &mut *s;
        if a.len() < n {
            a.resize(n, 0.0);
            b.resize(n, 0.0);
        }
        f(&mut a[..n], &mut b[..n])
    })
}

/// dst (m×n at strides `dst_rs`, `dst_cs`) (+)= lhs · rhs (inner size k) on this thread; an empty
/// product writes zeros (or adds nothing).
///
/// # Safety
/// The pointers cover their views (lhs m×k, rhs k×n, dst m×n at the strides given), and dst
/// overlaps neither operand nor any element another thread touches meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn product(m: usize, n: usize, k: usize, dst: *mut f32, dst_rs: usize, dst_cs: usize, lhs: Mat<f32>, rhs: Mat<f32>, acc: bool) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !acc {
            // SAFETY: the caller's m×n view of dst.
            unsafe { zero(dst, m, n, dst_rs, dst_cs) };
        }
        return;
    }
    // SAFETY: the caller's contract; gemm_serial runs on this thread alone.
    unsafe { gemm_serial(m, n, k, dst, dst_rs as isize, dst_cs as isize, lhs, rhs, acc) }
}

/// Zeros the m×n view of dst at strides (rs, cs).
///
/// # Safety
/// dst covers the view, and no other thread touches it meanwhile.
unsafe fn zero(dst: *mut f32, m: usize, n: usize, rs: usize, cs: usize) {
    for i in 0..m {
        for j in 0..n {
            // SAFETY: (i, j) lies in the caller's view.
            unsafe { *dst.add(i * rs + j * cs) = 0.0 };
        }
    }
}

fn mat(ptr: *const f32, rs: usize, cs: usize) -> Mat<f32> {
    Mat { ptr, rs: rs as isize, cs: cs as isize }
}

/// The largest element offset a tensor with these batch strides, `rows` rows `rs` apart and
/// `cols` columns `cs` apart uses, plus one (0 when it has no element).
fn extent(batch: &[usize], strides: &[usize], rows: usize, rs: usize, cols: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 || batch.contains(&0) {
        return 0;
    }
    let last: usize = batch.iter().zip(strides).map(|(n, s)| (n - 1) * s).sum();
    last + (rows - 1) * rs + (cols - 1) * cs + 1
}

/// Checks that every element the kernels address lies in its tensor (the layout was derived
/// from these tensors' shapes; this keeps the unchecked reads honest if it were not).
fn check_extents(node: &Node, p: &Params, x: &Operands, fit: &[(&str, usize, usize)]) -> Result<()> {
    let (l, r) = (&p.l, &p.l.rows);
    let mut all = vec![
        ("Q", extent(&l.batch, &l.q, l.t, r.q_t, l.d, 1), x.q.len()),
        ("Kt", extent(&l.batch, &l.k, l.d, r.k_d, l.s, r.k_s), x.kt.len()),
        ("V", extent(&l.batch, &l.v, l.s, r.v_s, l.dv, 1), x.v.len()),
    ];
    if let (Some(m), Some((mb, mt, ms))) = (x.mask, &l.m) {
        all.push(("the mask", extent(&l.batch, mb, l.t, *mt, l.s, *ms), m.len()));
    }
    if let Some(kp) = &p.kp {
        all.push(("the key padding", extent(&l.batch, &kp.batch, 1, 0, l.s, kp.s), kp.flags.len()));
    }
    all.extend_from_slice(fit);
    match all.iter().find(|(_, need, have)| need > have) {
        Some((what, need, have)) => Err(node.err(format!("{what} holds {have} elements, its layout addresses {need}"))),
        None => Ok(()),
    }
}

/// Where one batch matrix's operands start, and its mask and key-padding flags.
struct Matrix<'a> {
    q: usize,
    kt: usize,
    v: usize,
    /// O and dO.
    o: usize,
    mask: Option<(&'a [f32], usize, usize)>,
    kp: Option<(&'a [u8], usize, f32)>,
}

impl<'a> Matrix<'a> {
    fn at(p: &'a Params, x: &Operands<'a>, b: usize) -> Self {
        let l = &p.l;
        let off = l.offsets(b);
        let mask = match (x.mask, &l.m) {
            (Some(m), Some((_, mt, ms))) => Some((&m[off[3]..], *mt, *ms)),
            _ => None,
        };
        let kp = p.kp.as_ref().map(|KeyPadding { flags, batch, s, value }| (&flags[l.batch_offset(batch, b)..], *s, *value as f32));
        Matrix { q: off[0], kt: off[1], v: off[2], o: l.batch_offset(&l.o, b), mask, kp }
    }

    /// The additive mask of query `t` and key `j` (the padding value for a padded key).
    #[inline]
    fn mask_at(&self, t: usize, j: usize) -> f32 {
        match self.kp {
            Some((flags, s, value)) if flags[j * s] == 0 => value,
            _ => self.mask.map_or(0.0, |(m, mt, ms)| m[t * mt + j * ms]),
        }
    }

    /// How many leading keys the queries `rows` need: past the last key any of them sees, or all
    /// `s` when one of them sees none.
    fn visible_keys(&self, rows: std::ops::Range<usize>, s: usize) -> usize {
        if self.mask.is_none() && self.kp.is_none_or(|(_, _, value)| value > HIDDEN) {
            return s;
        }
        let hidden = |t: usize, j: usize| self.mask_at(t, j) <= HIDDEN;
        let mut need = 0;
        for t in rows {
            // row t's last visible key, searched down to the keys already kept
            let mut j = s;
            while j > need && hidden(t, j - 1) {
                j -= 1;
            }
            if j > need {
                need = j;
            } else if (0..need).all(|k| hidden(t, k)) {
                return s;
            }
        }
        need
    }

    /// Scales the scores of query `t` (keys 0..row.len()) and adds its mask.
    fn mask_row(&self, row: &mut [f32], t: usize, scale: f32) {
        match (self.mask, self.kp) {
            (None, None) => scale_add::call(row, &[], scale),
            (Some((m, mt, 1)), None) => scale_add::call(row, &m[t * mt..t * mt + row.len()], scale),
            _ => row.iter_mut().enumerate().for_each(|(j, x)| *x = *x * scale + self.mask_at(t, j)),
        }
    }
}

/// x = x · scale + m (m empty: no mask).
#[inline(always)]
fn scale_add_body<const FMA: bool>(x: &mut [f32], m: &[f32], scale: f32) {
    if m.is_empty() {
        x.iter_mut().for_each(|v| *v *= scale);
    } else {
        x.iter_mut().zip(m).for_each(|(v, &m)| *v = *v * scale + m);
    }
}

/// The row's softmax in place; returns its LSE (−∞ for a row of −∞ scores, which becomes zeros).
#[inline(always)]
fn softmax_in_place_body<const FMA: bool>(x: &mut [f32]) -> f32 {
    let m = row_max(x);
    if m == f32::NEG_INFINITY {
        x.iter_mut().for_each(|v| *v = 0.0);
        return m;
    }
    let mut acc = [0f32; LANES];
    let mut chunks = x.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (v, s) in c.iter_mut().zip(acc.iter_mut()) {
            *v = exp_or_zero::<FMA>(*v - m);
            *s += *v;
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for v in chunks.into_remainder() {
        *v = exp_or_zero::<FMA>(*v - m);
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
    m + sum.ln()
}

/// p = e^(x − lse) in place (the probabilities of a row whose LSE was saved).
#[inline(always)]
fn exp_shifted_body<const FMA: bool>(x: &mut [f32], lse: f32) {
    x.iter_mut().for_each(|v| *v = exp_or_zero::<FMA>(*v - lse));
}

/// dS = scale · P ∘ (dP − Σ dO∘O), into dp; `d_o` and `o` are the row's dO and O. With dropout
/// factors `z` (empty: none), dp holds d(P∘Z) and dP = Z ∘ it.
#[inline(always)]
fn score_grad_body<const FMA: bool>(dp: &mut [f32], p: &[f32], z: &[f32], d_o: &[f32], o: &[f32], scale: f32) {
    let delta = lane_sum(d_o, o, |a, b| a * b);
    if z.is_empty() {
        dp.iter_mut().zip(p).for_each(|(g, &p)| *g = scale * p * (*g - delta));
    } else {
        dp.iter_mut().zip(p).zip(z).for_each(|((g, &p), &z)| *g = scale * p * (z * *g - delta));
    }
}

/// x = x ∘ z.
#[inline(always)]
fn times_body<const FMA: bool>(x: &mut [f32], z: &[f32]) {
    x.iter_mut().zip(z).for_each(|(x, &z)| *x *= z);
}

multiversion!(scale_add, scale_add_body, (x: &mut [f32], m: &[f32], scale: f32) -> ());
multiversion!(softmax_in_place, softmax_in_place_body, (x: &mut [f32]) -> f32);
multiversion!(exp_shifted, exp_shifted_body, (x: &mut [f32], lse: f32) -> ());
multiversion!(score_grad, score_grad_body, (dp: &mut [f32], p: &[f32], z: &[f32], d_o: &[f32], o: &[f32], scale: f32) -> ());
multiversion!(times, times_body, (x: &mut [f32], z: &[f32]) -> ());

/// The dropout factors of query `t` of batch matrix `b` over its first `z.len()` keys into `z`
/// (Some(z)), or None without a dropout.
fn dropout_row<'z>(p: &Params, b: usize, t: usize, z: &'z mut [f32]) -> Option<&'z [f32]> {
    let d = p.dropout.as_ref()?;
    d.factors(&p.l, b, t, z, d.scale as f32);
    Some(z)
}

/// Row ranges of the blocks of `t` query rows.
fn blocks(t: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..t.div_ceil(BLOCK_ROWS)).map(move |i| i * BLOCK_ROWS..((i + 1) * BLOCK_ROWS).min(t))
}

/// scores[rows × kmax] = Q[rows] · Kᵀ[:, ..kmax] of matrix `mx`, scaled and masked.
fn block_scores(p: &Params, x: &Operands, mx: &Matrix, rows: &std::ops::Range<usize>, kmax: usize, scores: &mut [f32]) {
    let (l, r) = (&p.l, &p.l.rows);
    let q = mat(x.q[mx.q + rows.start * r.q_t..].as_ptr(), r.q_t, 1);
    let kt = mat(x.kt[mx.kt..].as_ptr(), r.k_d, r.k_s);
    // SAFETY: check_extents bounds Q's rows and Kᵀ's keys read here; scores is this thread's
    // rows × kmax buffer.
    unsafe { product(rows.len(), kmax, l.d, scores.as_mut_ptr(), kmax, 1, q, kt, false) };
    for (i, t) in rows.clone().enumerate() {
        mx.mask_row(&mut scores[i * kmax..(i + 1) * kmax], t, p.scale as f32);
    }
}

/// Attention(Q, Kt, V, M?, KP?) -> (O, LSE) in f32.
pub(super) fn forward(node: &Node, p: &Params, x: &Operands, o: &mut [f32], lse: &mut [f32]) -> Result<()> {
    let l = &p.l;
    let nb = l.batch_count();
    check_extents(node, p, x, &[("O", extent(&l.batch, &l.o, l.t, l.rows.o_t, l.dv, 1), o.len()), ("LSE", nb * l.t, lse.len())])?;
    if l.t == 0 {
        return Ok(());
    }
    let (o_ptr, lse_ptr) = (Shared(o.as_mut_ptr()), Shared(lse.as_mut_ptr()));
    let tasks: Vec<(usize, std::ops::Range<usize>)> = (0..nb).flat_map(|b| blocks(l.t).map(move |r| (b, r))).collect();
    tasks.into_par_iter().for_each(|(b, rows)| {
        let mx = Matrix::at(p, x, b);
        let kmax = mx.visible_keys(rows.clone(), l.s);
        let o_t = l.rows.o_t;
        with_scratch(rows.len() * kmax, |scores, _| {
            block_scores(p, x, &mx, &rows, kmax, scores);
            let mut dead = vec![];
            let mut z = vec![0f32; if p.dropout.is_some() { kmax } else { 0 }];
            for i in 0..rows.len() {
                let row = &mut scores[i * kmax..(i + 1) * kmax];
                let row_lse = softmax_in_place::call(row);
                if row_lse == f32::NEG_INFINITY {
                    dead.push(rows.start + i);
                }
                if let Some(z) = dropout_row(p, b, rows.start + i, &mut z) {
                    times::call(row, z);
                }
                // SAFETY: this task's own LSE entry, within nb·t (check_extents).
                unsafe { *{ lse_ptr }.0.add(b * l.t + rows.start + i) = row_lse };
            }
            let o_blk = { o_ptr }.0.wrapping_add(mx.o + rows.start * o_t);
            // SAFETY: O's rows of this block of matrix b (within O by check_extents) are this
            // task's alone; the probabilities and V are read only.
            unsafe {
                product(
                    rows.len(),
                    l.dv,
                    kmax,
                    o_blk,
                    o_t,
                    1,
                    mat(scores.as_ptr(), kmax, 1),
                    mat(x.v[mx.v..].as_ptr(), l.rows.v_s, 1),
                    false,
                )
            };
            // a row of −∞ scores: 0 under the NaN guard, else NaN as a plain softmax gives
            let fill = if p.guard { 0.0 } else { f32::NAN };
            for t in dead {
                for c in 0..l.dv {
                    // SAFETY: as above, row t of this task's block.
                    unsafe { *o_blk.add((t - rows.start) * o_t + c) = fill };
                }
            }
        });
    });
    Ok(())
}

/// The f32 outputs of AttentionGrad.
pub(super) struct Grads<'a> {
    pub dq: &'a mut [f32],
    pub dk: &'a mut [f32],
    pub dv: &'a mut [f32],
}

/// AttentionGrad(dO, Q, Kt, V, M?, O, LSE, KP?) -> (dQ, dKt, dV) in f32.
pub(super) fn backward(node: &Node, p: &Params, x: &Operands, dout: &[f32], o: &[f32], lse: &[f32], g: Grads) -> Result<()> {
    let (l, r) = (&p.l, &p.l.rows);
    let nb = l.batch_count();
    let o_need = extent(&l.batch, &l.o, l.t, r.o_t, l.dv, 1);
    let fit = [
        ("dO", o_need, dout.len()),
        ("O", o_need, o.len()),
        ("LSE", nb * l.t, lse.len()),
        ("dQ", extent(&l.batch, &l.gq, l.t, r.q_t, l.d, 1), g.dq.len()),
        ("dKt", extent(&l.batch, &l.gk, l.d, r.k_d, l.s, r.k_s), g.dk.len()),
        ("dV", extent(&l.batch, &l.gv, l.s, r.v_s, l.dv, 1), g.dv.len()),
    ];
    check_extents(node, p, x, &fit)?;
    let (dq_ptr, dk_ptr, dv_ptr) = (Shared(g.dq.as_mut_ptr()), Shared(g.dk.as_mut_ptr()), Shared(g.dv.as_mut_ptr()));
    let scale = p.scale as f32;
    (0..nb).into_par_iter().for_each(|b| {
        let mx = Matrix::at(p, x, b);
        let (dq, dk, dv) = (
            { dq_ptr }.0.wrapping_add(l.batch_offset(&l.gq, b)),
            { dk_ptr }.0.wrapping_add(l.batch_offset(&l.gk, b)),
            { dv_ptr }.0.wrapping_add(l.batch_offset(&l.gv, b)),
        );
        // dKᵀ and dV sum over the blocks: zeros first
        // SAFETY: matrix b's dKᵀ and dV (within them by check_extents) are this task's alone.
        unsafe {
            zero(dk, l.d, l.s, r.k_d, r.k_s);
            zero(dv, l.s, l.dv, r.v_s, 1);
        }
        for rows in blocks(l.t) {
            let kmax = mx.visible_keys(rows.clone(), l.s);
            let n = rows.len();
            with_scratch(n * kmax, |probs, ds| {
                block_scores(p, x, &mx, &rows, kmax, probs);
                for i in 0..n {
                    let row = &mut probs[i * kmax..(i + 1) * kmax];
                    let saved = lse[b * l.t + rows.start + i];
                    if saved > SETTLED as f32 {
                        exp_shifted::call(row, saved);
                    } else {
                        // no real score (finfo.min or −∞ everywhere): f32 cannot hold its LSE
                        softmax_in_place::call(row);
                    }
                }
                let d_o = mat(dout[mx.o + rows.start * r.o_t..].as_ptr(), r.o_t, 1);
                let v_t = mat(x.v[mx.v..].as_ptr(), 1, r.v_s);
                // SAFETY: dO's rows and V's keys (within them by check_extents) are read; ds is
                // this thread's buffer.
                unsafe { product(n, kmax, l.dv, ds.as_mut_ptr(), kmax, 1, d_o, v_t, false) };
                let mut z = vec![0f32; if p.dropout.is_some() { kmax } else { 0 }];
                for i in 0..n {
                    let at = mx.o + (rows.start + i) * r.o_t;
                    let (g_row, p_row) = (&mut ds[i * kmax..(i + 1) * kmax], &mut probs[i * kmax..(i + 1) * kmax]);
                    let z = dropout_row(p, b, rows.start + i, &mut z);
                    score_grad::call(g_row, p_row, z.unwrap_or(&[]), &dout[at..at + l.dv], &o[at..at + l.dv], scale);
                    // dV = (P ∘ Z)ᵀ · dO
                    if let Some(z) = z {
                        times::call(p_row, z);
                    }
                }
                // SAFETY: dV's first kmax keys, dQ's rows of this block and dKᵀ's first kmax
                // keys of matrix b are this task's alone (within them by check_extents); the
                // buffers, dO, Q and Kᵀ are read only.
                unsafe {
                    product(kmax, l.dv, n, dv, r.v_s, 1, mat(probs.as_ptr(), 1, kmax), d_o, true);
                    let kt_t = mat(x.kt[mx.kt..].as_ptr(), r.k_s, r.k_d);
                    product(n, l.d, kmax, dq.wrapping_add(rows.start * r.q_t), r.q_t, 1, mat(ds.as_ptr(), kmax, 1), kt_t, false);
                    let q_t = mat(x.q[mx.q + rows.start * r.q_t..].as_ptr(), 1, r.q_t);
                    product(l.d, kmax, n, dk, r.k_d, r.k_s, q_t, mat(ds.as_ptr(), kmax, 1), true);
                }
            });
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests;
