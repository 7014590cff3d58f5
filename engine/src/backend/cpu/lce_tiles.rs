//! The gradient half of LinearCrossEntropy's CPU kernel for one chunk, by vocabulary tiles: each
//! thread walks its own run of column tiles of the chunk's gradient G and, while a tile is in
//! cache, adds its share to dW (rows of the tile, owned by the thread), db and a private dX
//! partial; the partials are summed at the end. One-thread gemm calls on cache-sized tiles beat
//! the three whole-chunk parallel gemms (dX, dW, db passes over the 29 MB chunk).

use rayon::prelude::*;

use super::elementwise::FloatElem;
use super::matmul::{gemm_serial, Mat};

/// Columns of G per tile: [chunk rows × 512] is 512 KB at 256 rows, within a core's L2.
const TILE: usize = 512;

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
}

/// Raw addresses shared by the threads: each writes disjoint parts (its own tiles' dW rows or
/// columns and db entries).
#[derive(Clone, Copy)]
struct Dst {
    dw: usize,
    db: usize,
}

/// dX_c = G · op(W)ᵀ (overwritten), dW (+)= the chunk's G-product (accumulated when
/// `accumulate_dw`), db += column sums of G.
pub(super) fn chunk_grads<T: FloatElem + 'static>(c: &ChunkGrads<T>, dx: &mut [T], dw: &mut [T], db: &mut [T], accumulate_dw: bool) {
    let (r, n, k) = (c.r, c.n, c.k);
    let tiles = n.div_ceil(TILE);
    let nt = rayon::current_num_threads().clamp(1, tiles.max(1));
    let dst = Dst { dw: dw.as_mut_ptr() as usize, db: db.as_mut_ptr() as usize };
    let (ga, xa, wa) = (c.g.as_ptr() as usize, c.x.as_ptr() as usize, c.w.as_ptr() as usize);
    let parts: Vec<Vec<T>> = (0..nt)
        .into_par_iter()
        .map(|ti| {
            let dst = dst;
            let (g, x, w) = (ga as *const T, xa as *const T, wa as *const T);
            let (dwp, dbp) = (dst.dw as *mut T, dst.db as *mut T);
            let mut p = vec![T::zero(); r * k];
            for j in ti * tiles / nt..(ti + 1) * tiles / nt {
                let (j0, cols) = (j * TILE, TILE.min(n - j * TILE));
                // SAFETY: j0 + cols ≤ n: the tile's columns of G (row stride n), of op(W) and
                // of dW exist; tiles are disjoint between threads, so are their dW and db parts.
                unsafe {
                    let gt = g.add(j0);
                    let xc = Mat { ptr: x, rs: k as isize, cs: 1 };
                    if c.trans_b {
                        // dW[j0.., :] (+)= G_tileᵀ · X_c
                        let lhs = Mat { ptr: gt, rs: 1, cs: n as isize };
                        gemm_serial(cols, k, r, dwp.add(j0 * k), k as isize, 1, lhs, xc, accumulate_dw);
                    } else {
                        // dW[:, j0..] (+)= X_cᵀ · G_tile
                        let lhs = Mat { ptr: x, rs: 1, cs: k as isize };
                        let rhs = Mat { ptr: gt, rs: n as isize, cs: 1 };
                        gemm_serial(k, cols, r, dwp.add(j0), n as isize, 1, lhs, rhs, accumulate_dw);
                    }
                    let dbt = std::slice::from_raw_parts_mut(dbp.add(j0), cols);
                    for i in 0..r {
                        let row = std::slice::from_raw_parts(gt.add(i * n), cols);
                        dbt.iter_mut().zip(row).for_each(|(d, &v)| *d = *d + v);
                    }
                    // dX partial += G_tile · op(W)ᵀ_tile ([cols, k] view of w)
                    let wt = if c.trans_b {
                        Mat { ptr: w.add(j0 * k), rs: k as isize, cs: 1 }
                    } else {
                        Mat { ptr: w.add(j0), rs: 1, cs: n as isize }
                    };
                    let gm = Mat { ptr: gt, rs: n as isize, cs: 1 };
                    gemm_serial(r, k, cols, p.as_mut_ptr(), k as isize, 1, gm, wt, true);
                }
            }
            p
        })
        .collect();
    let dx = &mut dx[..r * k];
    dx.iter_mut().for_each(|v| *v = T::zero());
    for p in &parts {
        dx.iter_mut().zip(p).for_each(|(d, &v)| *d = *d + v);
    }
}
