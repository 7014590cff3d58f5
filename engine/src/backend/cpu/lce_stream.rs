//! One chunk of LinearCrossEntropy (f32 tensors, products on the `gemm` crate or, on the bf16
//! path, the bf16 kernel), by vocabulary tiles from end to end, so that the chunk's logits are
//! swept through memory twice instead of four times:
//! 1. per tile (`over_tiles`: the threads claim groups of tiles): the tile's logits (one-thread
//!    gemm into the chunk), then, while the tile is in cache, per row the bias, the tile's max m and
//!    e = exp(v + b − m) in place with its sum s;
//! 2. per row (cheap): lse = M + ln Σ s·exp(m − M) over the row's tiles, the loss term and one
//!    factor per tile, g·exp(m − lse);
//! 3. per tile again: G_tile = factor · e (minus g at the label) into a tile-sized buffer
//!    (the thread's) with db's column sums, then dW's and the dX partial's products from it.
//!
//! Each tile's block of the chunk, and G_tile, are stored column by column (rows contiguous).
//! The `gemm` crate runs a product with the destination's contiguous side as its m and packs its
//! left operand with vector copies only when that operand is contiguous along m: with row-major
//! tiles the logits' left operand was W's tile, gathered one element at a time on every tile
//! (4% of the tutorial's step in `perf`); by columns it is X_c's transpose (`transposed`, once
//! per chunk) and W is read in place. The passes over a block vectorise along its rows.
//!
//! The whole-row version (a row pass over the chunk between a whole-chunk gemm and the tiled
//! products) read and wrote the 27 MB chunk once more. G equals g·exp(v + b − max)/Σ up to
//! rounding (per-tile shifts), as the unfused kernel's softmax gradient.
//!
//! The bf16 path computes each tile's logits as their transpose, op(W)_tile · X_cᵀ (the bf16
//! kernel writes rows; its A panel is W's tile read along k). It used to keep a whole-chunk
//! logits gemm and whole-row log-sum-exp and softmax passes, so that its G was bit for bit the
//! unfused kernel's before the bf16 rounding: those passes over the [256, 28782] chunk were 40%
//! of its time in `perf` (the C stores 16%, the lse and softmax passes 14% and 12%); streamed,
//! `lce_chunk_speed` (tutorial head, 2 threads, AMX) went 84 → 60 ms, and G differs from the
//! unfused one by f32 rounding, as on the fp32 path.

use super::bf16::MatmulPath;
use super::lce_tiles::{over_tiles, sum_partials, tile_count, tile_products, ChunkGrads, TILE};
use super::matmul::{gemm_call_ld, gemm_serial, on_this_thread, Mat};
use super::vmath;

/// One chunk's rows: (label, loss weight w, gradient factor g = w · 1/Σw or w) each.
pub(super) struct StreamRows<'a> {
    pub targets: Vec<(usize, f64, f64)>,
    pub bias: Option<&'a [f32]>,
}

/// Where a chunk's gradients go: dx ([r, k], overwritten), dW (accumulated when `accumulate_dw`,
/// else overwritten; None: not wanted, a frozen weight), db (accumulated).
pub(super) struct ChunkOut<'a> {
    pub dx: &'a mut [f32],
    pub dw: Option<&'a mut [f32]>,
    pub db: &'a mut [f32],
    pub accumulate_dw: bool,
}

/// Raw addresses the threads write at disjoint places.
#[derive(Clone, Copy)]
struct Shared {
    g: usize,
    stats: usize,
    xy: usize,
}

/// Runs the chunk: `scratch` ([r, n] elements) receives the logits, then e, tile by tile, each
/// tile's block [cols, r] stored column by column at r·j0 (`c.g` is not read); the gradients go
/// to `out`. Returns Σ of the rows' loss terms −w·log softmax(row)[y].
pub(super) fn chunk(c: &ChunkGrads<f32>, scratch: &mut [f32], rows: &StreamRows, out: ChunkOut) -> f64 {
    let (r, n, k) = (c.r, c.n, c.k);
    let tiles = tile_count(n);
    // per (tile, row): m and s, then the tile's factor in place of m; per row: the biased logit
    // at its label
    let mut stats = vec![(0f32, 0f32); tiles * r];
    let mut xy = vec![0f32; r];
    let xt = if c.path == MatmulPath::Fp32 { transposed(c.x, r, k) } else { Vec::new() };
    let sh = Shared { g: scratch[..r * n].as_mut_ptr() as usize, stats: stats.as_mut_ptr() as usize, xy: xy.as_mut_ptr() as usize };
    let bias = rows.bias;
    over_tiles(
        n,
        || (),
        || (vec![0f32; r], vec![0f32; r], vec![0f64; r]),
        |_, (m, s, acc), j, j0, cols| {
            // SAFETY: the tile's block (r·j0.. r·(j0 + cols)) of the chunk belongs to this tile's
            // call alone; xt is X_c's [k, r] transpose (fp32 path; the bf16 path reads X_c [r, k]
            // itself), op(W)'s tile columns exist; stats (tile j's r entries) and xy (the rows
            // whose label is in this tile) are written by this tile only.
            unsafe {
                let blk = (sh.g as *mut f32).add(r * j0);
                if k > 0 {
                    // op(W)'s tile as [cols, k]
                    let w_tile = if c.trans_b {
                        Mat { ptr: c.w.as_ptr().add(j0 * k), rs: k as isize, cs: 1 }
                    } else {
                        Mat { ptr: c.w.as_ptr().add(j0), rs: 1, cs: n as isize }
                    };
                    if c.path == MatmulPath::Fp32 {
                        // the tile's logits by columns: the crate then packs X_c's transpose with
                        // vector copies and reads op(W)'s columns in place
                        let lhs = Mat { ptr: xt.as_ptr(), rs: 1, cs: r as isize };
                        let wt = Mat { ptr: w_tile.ptr, rs: w_tile.cs, cs: w_tile.rs };
                        gemm_serial(r, cols, k, blk, 1, r as isize, lhs, wt, false);
                    } else {
                        // the bf16 kernel writes rows: the block's transpose, op(W)_tile · X_cᵀ
                        let xct = Mat { ptr: c.x.as_ptr(), rs: 1, cs: k as isize };
                        on_this_thread(|| gemm_call_ld(c.path, cols, r, k, blk, r, w_tile, xct, 1.0, false));
                    }
                }
                let block = std::slice::from_raw_parts_mut(blk, r * cols);
                if k == 0 {
                    block.fill(0.0);
                }
                let b = bias.map_or(&[][..], |b| &b[j0..j0 + cols]);
                for (i, &(y, _, _)) in rows.targets.iter().enumerate() {
                    if let Some(d) = y.checked_sub(j0).filter(|&d| d < cols) {
                        // the same single addition the exp pass makes
                        *(sh.xy as *mut f32).add(i) = block[d * r + i] + b.get(d).copied().unwrap_or(0.0);
                    }
                }
                vmath::cols_exp_shifted_inplace::call(block, b, m, s, acc);
                let st = std::slice::from_raw_parts_mut((sh.stats as *mut (f32, f32)).add(j * r), r);
                st.iter_mut().zip(m.iter().zip(s.iter())).for_each(|(t, (&m, &s))| *t = (m, s));
            }
        },
    );
    // per row: log-sum-exp over its tiles, the loss term, and each tile's factor (in place of m)
    let mut total = 0f64;
    for (i, &(_, w, g)) in rows.targets.iter().enumerate() {
        let row = (0..tiles).map(|j| stats[j * r + i]);
        let top = row.clone().fold(f32::NEG_INFINITY, |a, (m, _)| if m.is_nan() || a.is_nan() { f32::NAN } else { a.max(m) });
        let lse = if top.is_nan() || top == f32::NEG_INFINITY {
            f64::NAN
        } else {
            let sum: f64 = row.filter(|&(m, _)| m > f32::NEG_INFINITY).map(|(m, s)| s as f64 * ((m - top) as f64).exp()).sum();
            top as f64 + sum.ln()
        };
        total += -w * (xy[i] as f64 - lse);
        for j in 0..tiles {
            let (m, _) = stats[j * r + i];
            let f = if lse.is_nan() {
                f32::NAN
            } else if m == f32::NEG_INFINITY {
                0.0
            } else {
                (g * (m as f64 - lse).exp()) as f32
            };
            stats[j * r + i].0 = f;
        }
    }
    let (factors, e) = (stats.as_ptr() as usize, sh.g);
    grads_from_tiles(c, out, |buf, f, j, j0, cols, dbt| {
        // SAFETY: stats holds tiles × r entries, only read from here on; the tile's block of e
        // (r·cols at r·j0) was written by the first pass and is only read now.
        let (st, block) = unsafe {
            (
                std::slice::from_raw_parts((factors as *const (f32, f32)).add(j * r), r),
                std::slice::from_raw_parts((e as *const f32).add(r * j0), r * cols),
            )
        };
        f.iter_mut().zip(st).for_each(|(f, &(v, _))| *f = v);
        let out = &mut buf[..r * cols];
        vmath::cols_scale_and_sum::call(out, block, f, dbt);
        for (i, &(y, _, gi)) in rows.targets.iter().enumerate() {
            if let Some(d) = y.checked_sub(j0).filter(|&d| d < cols) {
                out[d * r + i] -= gi as f32;
                dbt[d] -= gi as f32;
            }
        }
        // G_tile by columns
        Mat { ptr: out.as_ptr(), rs: 1, cs: r as isize }
    });
    total
}

/// X_c [r, k] row-major as [k, r] row-major (X_c column-major), the layout the `gemm` crate packs
/// a left operand from with vector copies. From X_c's own layout it gathers the panel one element
/// at a time, and it packs the left operand on every tile's call: `perf record` of the tutorial
/// step put that gather at 4% of the step.
fn transposed(x: &[f32], r: usize, k: usize) -> Vec<f32> {
    let mut t = vec![0f32; r * k];
    for (i, row) in x[..r * k].chunks_exact(k.max(1)).enumerate() {
        for (kk, &v) in row.iter().enumerate() {
            t[kk * r + i] = v;
        }
    }
    t
}

/// The gradient half of a chunk by tiles (groups of tiles claimed by the threads): per tile,
/// `tile_grad(buf, f, j, j0, cols, db_tile)` writes the tile's gradient G_tile (r × cols) into
/// `buf`, adds its column sums to the tile's db entries and returns how it laid G_tile out (`f`:
/// r floats of scratch); then the tile's dW and dX products from it.
fn grads_from_tiles(
    c: &ChunkGrads<f32>,
    out: ChunkOut,
    tile_grad: impl Fn(&mut [f32], &mut [f32], usize, usize, usize, &mut [f32]) -> Mat<f32> + Sync,
) {
    let ChunkOut { dx, dw, db, accumulate_dw } = out;
    let (r, n, k) = (c.r, c.n, c.k);
    let (dwp, dbp) = (dw.map_or(0, |d| d.as_mut_ptr() as usize), db.as_mut_ptr() as usize);
    let parts = over_tiles(
        n,
        || vec![0f32; r * k],
        || (vec![0f32; r * TILE], vec![0f32; r]),
        |p, (buf, f), j, j0, cols| {
            // SAFETY: db's entries j0..j0 + cols belong to this tile alone.
            let dbt = unsafe { std::slice::from_raw_parts_mut((dbp as *mut f32).add(j0), cols) };
            let gm = tile_grad(buf, f, j, j0, cols, dbt);
            // SAFETY: gm views the tile's r × cols gradient in buf; dwp is null (no dW) or
            // dW's start, and this tile's part of dW is written by this call alone.
            unsafe { tile_products(c, j0, cols, gm, dwp as *mut f32, p, accumulate_dw) };
        },
    );
    sum_partials(&mut dx[..r * k], &parts);
}
