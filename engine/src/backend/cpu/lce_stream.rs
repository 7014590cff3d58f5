//! One chunk of LinearCrossEntropy on the fp32 `gemm`-crate path, by vocabulary tiles from end
//! to end, so that the chunk's logits are swept through memory twice instead of four times:
//! 1. per tile (`over_tiles`: the threads claim groups of tiles): the tile's logits (one-thread
//!    gemm into the chunk), then, while the tile is in cache, per row the bias, the tile's max m and
//!    e = exp(v + b − m) in place with its sum s;
//! 2. per row (cheap): lse = M + ln Σ s·exp(m − M) over the row's tiles, the loss term and one
//!    factor per tile, g·exp(m − lse);
//! 3. per tile again: G_tile = factor · e (minus g at the label) into a tile-sized buffer
//!    (the thread's) with db's column sums, then dW's and the dX partial's products from it.
//!
//! The whole-row version (a row pass over the chunk between a whole-chunk gemm and the tiled
//! products) read and wrote the 27 MB chunk once more. G equals g·exp(v + b − max)/Σ up to
//! rounding (per-tile shifts), as the unfused kernel's softmax gradient.
//!
//! The bf16 path (`chunk_from_logits`) must reproduce the unfused kernel's gradient bit for bit
//! (see linear_cross_entropy.rs `lce_row`), so it keeps a whole-chunk logits gemm and a
//! whole-row log-sum-exp, and only its gradient half runs by tiles from the logits.

use super::lce_tiles::{over_tiles, sum_partials, tile_count, tile_products, ChunkGrads, TILE};
use super::matmul::{gemm_serial, Mat};
use super::vmath;

/// One chunk's rows: (label, loss weight w, gradient factor g = w · 1/Σw or w) each.
pub(super) struct StreamRows<'a> {
    pub targets: Vec<(usize, f64, f64)>,
    pub bias: Option<&'a [f32]>,
}

/// Where a chunk's gradients go: dx ([r, k], overwritten), dW (accumulated when `accumulate_dw`,
/// else overwritten), db (accumulated).
pub(super) struct ChunkOut<'a> {
    pub dx: &'a mut [f32],
    pub dw: &'a mut [f32],
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

/// Runs the chunk: `scratch` ([r, n]) receives the logits, then e (`c.g` is not read); the
/// gradients go to `out`. Returns Σ of the rows' loss terms −w·log softmax(row)[y].
pub(super) fn chunk(c: &ChunkGrads<f32>, scratch: &mut [f32], rows: &StreamRows, out: ChunkOut) -> f64 {
    let (r, n, k) = (c.r, c.n, c.k);
    let tiles = tile_count(n);
    // per (tile, row): (m, s); per row: the biased logit at its label
    let mut stats = vec![(0f32, 0f32); tiles * r];
    let mut xy = vec![0f32; r];
    let sh = Shared { g: scratch[..r * n].as_mut_ptr() as usize, stats: stats.as_mut_ptr() as usize, xy: xy.as_mut_ptr() as usize };
    let bias = rows.bias;
    over_tiles(
        n,
        || (),
        || (),
        |_, _, j, j0, cols| {
            let g = sh.g as *mut f32;
            // SAFETY: the tile's columns j0..j0 + cols of the chunk (row stride n) belong to this
            // tile's call alone; X_c is [r, k], op(W)'s tile columns exist; stats (tile j's r entries)
            // and xy (the rows whose label is in this tile) are written by this tile only.
            unsafe {
                if k > 0 {
                    let xc = Mat { ptr: c.x.as_ptr(), rs: k as isize, cs: 1 };
                    let wt = if c.trans_b {
                        Mat { ptr: c.w.as_ptr().add(j0 * k), rs: 1, cs: k as isize }
                    } else {
                        Mat { ptr: c.w.as_ptr().add(j0), rs: n as isize, cs: 1 }
                    };
                    gemm_serial(r, cols, k, g.add(j0), n as isize, 1, xc, wt, false);
                } else {
                    (0..r).for_each(|i| std::slice::from_raw_parts_mut(g.add(i * n + j0), cols).fill(0.0));
                }
                let b = bias.map_or(&[][..], |b| &b[j0..j0 + cols]);
                for (i, &(y, _, _)) in rows.targets.iter().enumerate() {
                    let seg = std::slice::from_raw_parts_mut(g.add(i * n + j0), cols);
                    if (j0..j0 + cols).contains(&y) {
                        // the same single addition the exp pass makes
                        *(sh.xy as *mut f32).add(i) = seg[y - j0] + b.get(y - j0).copied().unwrap_or(0.0);
                    }
                    *(sh.stats as *mut (f32, f32)).add(j * r + i) = vmath::row_exp_shifted_inplace::call(seg, b);
                }
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
    let factors = stats.as_ptr() as usize;
    grads_from_tiles(c, scratch, rows, out, |out, e, i, j, j0, dbt| {
        // SAFETY: stats holds tiles × r entries, only read from here on.
        let f = unsafe { (*(factors as *const (f32, f32)).add(j * r + i)).0 };
        if f.is_nan() {
            out.fill(f32::NAN);
            dbt.iter_mut().for_each(|d| *d = f32::NAN);
        } else {
            vmath::scale_into_and_sum::call(out, e, f, dbt);
        }
        let (y, _, gi) = rows.targets[i];
        if let Some(d) = y.checked_sub(j0).filter(|&d| d < out.len()) {
            out[d] -= gi as f32;
            dbt[d] -= gi as f32;
        }
    });
    total
}

/// The bf16 path's chunk after its logits: `scratch` ([r, n]) holds X_c·op(W) without the bias
/// (left as it is). Per row (in parallel) lse = log Σ exp(row + b), read-only; then per tile the
/// unit-seed gradient g·exp(v + b − lse) − g·onehot into a tile buffer, its column sums into db,
/// and the tile's products through the bf16 kernel (`c.path`). The gradient is bit for bit the
/// whole-row pass's (bias added in place, `row_lse`, the scaled softmax, the label), which the
/// bf16 rounding of the products must see unchanged; the chunk is read twice and never
/// rewritten. Returns Σ of the rows' loss terms.
pub(super) fn chunk_from_logits(c: &ChunkGrads<f32>, logits: &[f32], rows: &StreamRows, out: ChunkOut) -> f64 {
    use rayon::prelude::*;
    let n = c.n;
    let bias = rows.bias;
    let lse: Vec<(f32, f64)> = logits[..c.r * n]
        .par_chunks(n)
        .zip(rows.targets.par_iter())
        .map(|(row, &(y, w, _))| {
            let lse = bias.map_or_else(|| vmath::row_lse(row), |b| vmath::row_lse_biased(row, b));
            let xy = bias.map_or(row[y], |b| row[y] + b[y]);
            (lse, -w * (xy as f64 - lse as f64))
        })
        .collect();
    let total = lse.iter().map(|&(_, t)| t).sum();
    grads_from_tiles(c, logits, rows, out, |out, v, i, _, j0, dbt| {
        let (y, _, gi) = rows.targets[i];
        match bias {
            Some(b) => vmath::row_scaled_softmax_biased::call(out, v, &b[j0..j0 + v.len()], lse[i].0, gi as f32),
            None => vmath::row_scaled_softmax::call(out, v, lse[i].0, gi as f32),
        }
        if let Some(d) = y.checked_sub(j0).filter(|&d| d < out.len()) {
            out[d] -= gi as f32;
        }
        dbt.iter_mut().zip(out.iter()).for_each(|(d, &g)| *d += g);
    });
    total
}

/// The gradient half of a chunk by tiles (groups of tiles claimed by the threads): per tile,
/// per row i, `row_grad(out, seg, i, j, j0, db_tile)` writes row i's gradient over the tile's
/// columns (`seg`: the row's part of `scratch`) into `out` and adds it to the tile's db entries;
/// then the tile's dW and dX products from the tile buffer.
fn grads_from_tiles(
    c: &ChunkGrads<f32>,
    scratch: &[f32],
    rows: &StreamRows,
    out: ChunkOut,
    row_grad: impl Fn(&mut [f32], &[f32], usize, usize, usize, &mut [f32]) + Sync,
) {
    let ChunkOut { dx, dw, db, accumulate_dw } = out;
    let (r, n, k) = (c.r, c.n, c.k);
    debug_assert_eq!(rows.targets.len(), r);
    let (dwp, dbp) = (dw.as_mut_ptr() as usize, db.as_mut_ptr() as usize);
    let parts = over_tiles(
        n,
        || vec![0f32; r * k],
        || vec![0f32; r * TILE],
        |p, buf, j, j0, cols| {
            // SAFETY: db's entries j0..j0 + cols belong to this tile alone.
            let dbt = unsafe { std::slice::from_raw_parts_mut((dbp as *mut f32).add(j0), cols) };
            for i in 0..r {
                row_grad(&mut buf[i * cols..(i + 1) * cols], &scratch[i * n + j0..i * n + j0 + cols], i, j, j0, dbt);
            }
            // SAFETY: buf holds the tile's r × cols gradient at row stride cols; this tile's part
            // of dW is written by this call alone.
            unsafe { tile_products(c, j0, cols, buf.as_ptr(), cols, dwp as *mut f32, p, accumulate_dw) };
        },
    );
    sum_partials(&mut dx[..r * k], &parts);
}
