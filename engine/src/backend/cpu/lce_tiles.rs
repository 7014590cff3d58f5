//! The gradient half of LinearCrossEntropy's CPU kernel for one chunk, by vocabulary tiles: each
//! thread walks its own run of column tiles of the chunk's gradient G and, while a tile is in
//! cache, adds its share to dW (rows of the tile, owned by the thread), db and a private dX
//! partial; the partials are summed at the end. One-thread gemm calls on cache-sized tiles beat
//! the three whole-chunk parallel gemms (dX, dW, db passes over the 29 MB chunk): the chunk is
//! read from memory once (by the db sums, row by row, which also brings the tile into L2 before
//! the gemm packers read it column-wise), and on the bf16 path both bf16 packings of a tile read
//! it from L2. The bf16 path multiplies each tile with the bf16 kernel on the calling thread.

use rayon::prelude::*;

use super::bf16::MatmulPath;
use super::elementwise::FloatElem;
use super::matmul::{gemm_call_ld, on_this_thread, Mat};

/// Columns of G per tile: [chunk rows × 512] is 512 KB at 256 rows, within a core's L2. On the
/// tutorial's head (chunks of 234 rows, k = 200, Zen 4, 2 threads) tiles of 288 columns were no
/// faster on either path (`lce_phase_speed`, three interleaved runs each).
pub(super) const TILE: usize = 512;

/// One chunk's operands: G [r, n] row-major, X_c [r, k] row-major, W as stored ([n, k] when
/// trans_b, else [k, n]).
pub(super) struct ChunkGrads<'a, T> {
    pub g: &'a [T],
    pub x: &'a [T],
    pub w: &'a [T],
    pub r: usize,
    pub n: usize,
    pub k: usize,
    pub trans_b: bool,
    /// The matmul path: the bf16 one multiplies each tile with the bf16 kernel on this thread.
    pub path: MatmulPath,
}

/// Runs `body(state, j, j0, cols)` for every tile j (columns j0..j0 + cols of n), each thread
/// of rayon's pool over its own contiguous run of tiles with its own `init()` state; returns
/// the states.
pub(super) fn over_tiles<S: Send>(n: usize, init: impl Fn() -> S + Sync, body: impl Fn(&mut S, usize, usize, usize) + Sync) -> Vec<S> {
    let tiles = tile_count(n);
    let nt = rayon::current_num_threads().clamp(1, tiles.max(1));
    (0..nt)
        .into_par_iter()
        .map(|ti| {
            let mut state = init();
            for j in ti * tiles / nt..(ti + 1) * tiles / nt {
                body(&mut state, j, j * TILE, TILE.min(n - j * TILE));
            }
            state
        })
        .collect()
}

/// The number of tiles `over_tiles` walks for n columns.
pub(super) fn tile_count(n: usize) -> usize {
    n.div_ceil(TILE)
}

/// One tile's share of the gradient products: dW's rows (or columns) of the tile (+)= their
/// product (accumulated when `accumulate_dw`), and the dX partial `p` ([r, k]) += G_tile ·
/// op(W)ᵀ_tile. G_tile is [r, cols] at `gt` with row stride `gs`.
///
/// # Safety
/// `gt` covers r rows of `cols` at stride gs; j0 + cols ≤ n; no other thread writes this
/// tile's part of dW (at `dwp`, dW's start) while the call runs.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tile_products<T: FloatElem + 'static>(
    c: &ChunkGrads<T>,
    j0: usize,
    cols: usize,
    gt: *const T,
    gs: usize,
    dwp: *mut T,
    p: &mut [T],
    accumulate_dw: bool,
) {
    let (r, n, k) = (c.r, c.n, c.k);
    if k == 0 {
        return;
    }
    let (x, w) = (c.x.as_ptr(), c.w.as_ptr());
    // each product on the calling thread (the bf16 kernel on the bf16 path, else the gemm crate)
    // SAFETY: the caller's contract: the tile's columns of G, op(W) and dW exist, and this
    // tile's dW part is written by this call alone.
    on_this_thread(|| unsafe {
        let xc = Mat { ptr: x, rs: k as isize, cs: 1 };
        if c.trans_b {
            // dW[j0.., :] (+)= G_tileᵀ · X_c
            let lhs = Mat { ptr: gt, rs: 1, cs: gs as isize };
            gemm_call_ld(c.path, cols, k, r, dwp.add(j0 * k), k, lhs, xc, T::one(), accumulate_dw);
        } else {
            // dW[:, j0..] (+)= X_cᵀ · G_tile
            let lhs = Mat { ptr: x, rs: 1, cs: k as isize };
            let rhs = Mat { ptr: gt, rs: gs as isize, cs: 1 };
            gemm_call_ld(c.path, k, cols, r, dwp.add(j0), n, lhs, rhs, T::one(), accumulate_dw);
        }
        // dX partial += G_tile · op(W)ᵀ_tile ([cols, k] view of w)
        let wt = if c.trans_b { Mat { ptr: w.add(j0 * k), rs: k as isize, cs: 1 } } else { Mat { ptr: w.add(j0), rs: 1, cs: n as isize } };
        let gm = Mat { ptr: gt, rs: gs as isize, cs: 1 };
        gemm_call_ld(c.path, r, k, cols, p.as_mut_ptr(), k, gm, wt, T::one(), true);
    })
}

/// dx[..r·k] = the sum of the threads' dX partials.
pub(super) fn sum_partials<T: FloatElem>(dx: &mut [T], parts: &[Vec<T>]) {
    dx.iter_mut().for_each(|v| *v = T::zero());
    for p in parts {
        dx.iter_mut().zip(p).for_each(|(d, &v)| *d = *d + v);
    }
}

/// dX_c = G · op(W)ᵀ (overwritten), dW (+)= the chunk's G-product (accumulated when
/// `accumulate_dw`), db += column sums of G.
pub(super) fn chunk_grads<T: FloatElem + 'static>(c: &ChunkGrads<T>, dx: &mut [T], dw: &mut [T], db: &mut [T], accumulate_dw: bool) {
    let (r, n, k) = (c.r, c.n, c.k);
    let (ga, dwa, dba) = (c.g.as_ptr() as usize, dw.as_mut_ptr() as usize, db.as_mut_ptr() as usize);
    let parts = over_tiles(
        n,
        || vec![T::zero(); r * k],
        |p, _, j0, cols| {
            let (g, dwp, dbp) = (ga as *const T, dwa as *mut T, dba as *mut T);
            // SAFETY: the tile's columns of G exist (row stride n); tiles are disjoint between
            // threads, so are their db entries and dW parts.
            unsafe {
                let dbt = std::slice::from_raw_parts_mut(dbp.add(j0), cols);
                for i in 0..r {
                    let row = std::slice::from_raw_parts(g.add(j0 + i * n), cols);
                    dbt.iter_mut().zip(row).for_each(|(d, &v)| *d = *d + v);
                }
                tile_products(c, j0, cols, g.add(j0), n, dwp, p, accumulate_dw);
            }
        },
    );
    sum_partials(&mut dx[..r * k], &parts);
}
