//! The gradient half of LinearCrossEntropy's CPU kernel for one chunk, by vocabulary tiles: the
//! threads claim groups of column tiles of the chunk's gradient G (`over_tiles`) and, while a
//! tile is in cache, add its share to dW (rows of the tile), db and the group's dX partial; the
//! partials are summed in tile order at the end. One-thread gemm calls on cache-sized tiles beat
//! the three whole-chunk parallel gemms (dX, dW, db passes over the 29 MB chunk): the chunk is
//! read from memory once (by the db sums, row by row, which also brings the tile into L2 before
//! the gemm packers read it column-wise), and on the bf16 path both bf16 packings of a tile read
//! it from L2. The bf16 path multiplies each tile with the bf16 kernel on the calling thread.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

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

/// Runs `body(group, worker, j, j0, cols)` for every tile j (columns j0..j0 + cols of n). The
/// tiles are cut into groups of contiguous tiles (`tile_groups`), which the pool's threads claim
/// one at a time as they become free: a thread slowed by other work on its core (a shared
/// machine) takes fewer groups instead of holding the others up at the end. Each group's tiles
/// run in order on one thread, on the group's own `group()` state; `worker()` is scratch a
/// thread keeps across its groups. Returns the group states in tile order: sums over them in
/// that order do not depend on which thread ran which group, so results depend on n and the
/// thread count only.
pub(super) fn over_tiles<S: Send, W>(
    n: usize,
    group: impl Fn() -> S + Sync,
    worker: impl Fn() -> W + Sync,
    body: impl Fn(&mut S, &mut W, usize, usize, usize) + Sync,
) -> Vec<S> {
    let threads = rayon::current_num_threads().max(1);
    let groups = tile_groups(tile_count(n), threads);
    let next = AtomicUsize::new(0);
    let done: Vec<Mutex<Option<S>>> = groups.iter().map(|_| Mutex::new(None)).collect();
    (0..threads.min(groups.len())).into_par_iter().for_each(|_| {
        let mut scratch: Option<W> = None;
        loop {
            let gi = next.fetch_add(1, Ordering::Relaxed);
            let Some(&(t0, t1)) = groups.get(gi) else { break };
            let w = scratch.get_or_insert_with(&worker);
            let mut state = group();
            for j in t0..t1 {
                body(&mut state, w, j, j * TILE, TILE.min(n - j * TILE));
            }
            *done[gi].lock().unwrap_or_else(|e| e.into_inner()) = Some(state);
        }
    });
    done.into_iter().filter_map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner())).collect()
}

/// The tile groups (start, end) of `over_tiles`: all tiles in one group on one thread, else
/// groups of ⌈remaining / 2·threads⌉ tiles, largest first, so that the last ones claimed are
/// small (57 tiles on 2 threads: 15, 11, 8, 6, 5, 3, 3, 2, 1, 1, 1, 1).
fn tile_groups(tiles: usize, threads: usize) -> Vec<(usize, usize)> {
    if threads <= 1 {
        return if tiles == 0 { vec![] } else { vec![(0, tiles)] };
    }
    let mut groups = Vec::new();
    let mut t0 = 0;
    while t0 < tiles {
        let size = (tiles - t0).div_ceil(2 * threads).max(1);
        groups.push((t0, t0 + size));
        t0 += size;
    }
    groups
}

/// The number of tiles `over_tiles` walks for n columns.
pub(super) fn tile_count(n: usize) -> usize {
    n.div_ceil(TILE)
}

/// One tile's share of the gradient products: dW's rows (or columns) of the tile (+)= their
/// product (accumulated when `accumulate_dw`; none when `dwp` is null: a frozen weight's
/// gradient nobody reads), and the dX partial `p` ([r, k]) += G_tile ·
/// op(W)ᵀ_tile. `gm` is G_tile seen as [r, cols]: stored by rows (rs = the row stride, cs = 1)
/// or, as the fp32 path writes it, by columns (rs = 1, cs = r).
///
/// # Safety
/// `gm` covers r × cols elements at its strides; j0 + cols ≤ n; `dwp` is null or dW's start,
/// and no other thread writes this tile's part of dW while the call runs.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tile_products<T: FloatElem + 'static>(
    c: &ChunkGrads<T>,
    j0: usize,
    cols: usize,
    gm: Mat<T>,
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
        if dwp.is_null() {
            // no weight gradient wanted
        } else if c.trans_b {
            // dW[j0.., :] (+)= G_tileᵀ · X_c
            let lhs = Mat { ptr: gm.ptr, rs: gm.cs, cs: gm.rs };
            gemm_call_ld(c.path, cols, k, r, dwp.add(j0 * k), k, lhs, xc, T::one(), accumulate_dw);
        } else {
            // dW[:, j0..] (+)= X_cᵀ · G_tile
            let lhs = Mat { ptr: x, rs: 1, cs: k as isize };
            let rhs = Mat { ptr: gm.ptr, rs: gm.rs, cs: gm.cs };
            gemm_call_ld(c.path, k, cols, r, dwp.add(j0), n, lhs, rhs, T::one(), accumulate_dw);
        }
        // dX partial += G_tile · op(W)ᵀ_tile ([cols, k] view of w)
        let wt = if c.trans_b { Mat { ptr: w.add(j0 * k), rs: k as isize, cs: 1 } } else { Mat { ptr: w.add(j0), rs: 1, cs: n as isize } };
        gemm_call_ld(c.path, r, k, cols, p.as_mut_ptr(), k, gm, wt, T::one(), true);
    })
}

/// Elements of dX per parallel task of `sum_partials`.
const SUM_CHUNK: usize = 1 << 13;

/// dx[..r·k] = the sum of the tile groups' dX partials, in tile order: each element is
/// 0 + p₀ + p₁ + … whichever thread sums its part (a machine with many threads has many groups).
pub(super) fn sum_partials<T: FloatElem + Send + Sync>(dx: &mut [T], parts: &[Vec<T>]) {
    dx.par_chunks_mut(SUM_CHUNK).enumerate().for_each(|(c, d)| {
        let at = c * SUM_CHUNK..c * SUM_CHUNK + d.len();
        d.iter_mut().for_each(|v| *v = T::zero());
        for p in parts {
            d.iter_mut().zip(&p[at.clone()]).for_each(|(d, &v)| *d = *d + v);
        }
    });
}

/// dX_c = G · op(W)ᵀ (overwritten), dW (+)= the chunk's G-product (accumulated when
/// `accumulate_dw`), db += column sums of G.
/// `dw`: None where the weight's gradient is not wanted.
pub(super) fn chunk_grads<T: FloatElem + 'static>(
    c: &ChunkGrads<T>,
    dx: &mut [T],
    dw: Option<&mut [T]>,
    db: &mut [T],
    accumulate_dw: bool,
) {
    let (r, n, k) = (c.r, c.n, c.k);
    let dwa = dw.map_or(0, |d| d.as_mut_ptr() as usize);
    let (ga, dba) = (c.g.as_ptr() as usize, db.as_mut_ptr() as usize);
    let parts = over_tiles(
        n,
        || vec![T::zero(); r * k],
        || (),
        |p, _, _, j0, cols| {
            let (g, dwp, dbp) = (ga as *const T, dwa as *mut T, dba as *mut T);
            // SAFETY: the tile's columns of G exist (row stride n); tiles are disjoint between
            // threads, so are their db entries and dW parts.
            unsafe {
                let dbt = std::slice::from_raw_parts_mut(dbp.add(j0), cols);
                for i in 0..r {
                    let row = std::slice::from_raw_parts(g.add(j0 + i * n), cols);
                    dbt.iter_mut().zip(row).for_each(|(d, &v)| *d = *d + v);
                }
                tile_products(c, j0, cols, Mat { ptr: g.add(j0), rs: n as isize, cs: 1 }, dwp, p, accumulate_dw);
            }
        },
    );
    sum_partials(&mut dx[..r * k], &parts);
}

#[cfg(test)]
mod tests {
    use super::{over_tiles, sum_partials, tile_count, tile_groups, SUM_CHUNK, TILE};

    /// The parallel sum is bit for bit the serial one in tile order, across task edges.
    #[test]
    fn partials_sum_in_tile_order_on_any_thread() {
        let len = 3 * SUM_CHUNK + 17;
        let parts: Vec<Vec<f32>> = (0..7).map(|p| (0..len).map(|i| ((i * 31 + p * 7) % 97) as f32 / 9.0 - 5.0).collect()).collect();
        let want: Vec<u32> = (0..len).map(|i| parts.iter().fold(0f32, |a, p| a + p[i]).to_bits()).collect();
        let Ok(pool) = rayon::ThreadPoolBuilder::new().num_threads(3).build() else { panic!("pool") };
        let mut dx = vec![f32::NAN; len];
        pool.install(|| sum_partials(&mut dx, &parts));
        assert_eq!(dx.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want);
    }

    #[test]
    fn tile_groups_cover_the_tiles_in_order_largest_first() {
        assert_eq!(tile_groups(57, 2).iter().map(|(a, b)| b - a).collect::<Vec<_>>(), [15, 11, 8, 6, 5, 3, 3, 2, 1, 1, 1, 1]);
        assert_eq!(tile_groups(57, 1), [(0, 57)]);
        assert!(tile_groups(0, 1).is_empty() && tile_groups(0, 4).is_empty());
        for threads in 1..9 {
            for tiles in 0..200 {
                let g = tile_groups(tiles, threads);
                let mut end = 0;
                for (k, &(a, b)) in g.iter().enumerate() {
                    assert!(a == end && b > a, "{tiles} tiles, {threads} threads: {g:?}");
                    assert!(k == 0 || b - a <= g[k - 1].1 - g[k - 1].0, "sizes must not grow: {g:?}");
                    end = b;
                }
                assert_eq!(end, tiles);
            }
        }
    }

    /// Whatever thread claims which group (threads slowed at random), each group's tiles run in
    /// order on one state and the states come back in tile order: a sum over them is bit for
    /// bit the same every time.
    #[test]
    fn over_tiles_returns_group_states_in_tile_order_whoever_ran_them() {
        let n = 40 * TILE + 7;
        let tiles = tile_count(n);
        let Ok(pool) = rayon::ThreadPoolBuilder::new().num_threads(3).build() else { panic!("pool") };
        let run = |seed: u64| {
            pool.install(|| {
                over_tiles(
                    n,
                    Vec::new,
                    || seed,
                    |seen: &mut Vec<(usize, usize, usize, f32)>, s: &mut u64, j, j0, cols| {
                        *s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                        std::thread::sleep(std::time::Duration::from_micros((*s >> 33) % 300));
                        seen.push((j, j0, cols, 1.0 / (j as f32 + 3.0)));
                    },
                )
            })
        };
        let sums: Vec<Vec<u32>> = (0..4)
            .map(|seed| {
                let groups = run(seed);
                assert_eq!(groups.len(), tile_groups(tiles, 3).len());
                let flat: Vec<_> = groups.iter().flatten().collect();
                assert_eq!(flat.iter().map(|t| t.0).collect::<Vec<_>>(), (0..tiles).collect::<Vec<_>>());
                assert!(flat.iter().all(|&&(j, j0, cols, _)| j0 == j * TILE && cols == TILE.min(n - j0)));
                groups.iter().map(|g| g.iter().fold(0f32, |a, t| a + t.3).to_bits()).collect()
            })
            .collect();
        assert!(sums.windows(2).all(|w| w[0] == w[1]));
    }
}
