//! The blocked bf16 GEMM loop shared by the avx512_bf16 and AMX kernels: for each block of
//! columns (NC) and of k (sized so that packed A + B stay within `PACK_BUDGET`), B and then A are
//! packed once into pooled bf16 buffers (in parallel over panels), and tiles of C are computed in
//! parallel with rayon, each tile walking k in `KC` steps so its B panel slices stay in L1.

use std::sync::Mutex;

use rayon::prelude::*;

use super::pack::{self, Lines, PackJob, PanelLayout};
use super::MatRef;

/// k per kernel call: a 32-column B panel slice of 128 pairs is 16 KiB (L1).
const KC: usize = 256;
/// Columns per packed B block.
const NC: usize = 4096;
/// Rows per packed A block.
const MC: usize = 4096;
/// Bytes of packed A + B per block: fits a share of L3, bounds the pooled buffers.
const PACK_BUDGET: usize = 8 << 20;
/// Column panel width (two zmm vectors, two AMX B tiles).
const NR: usize = 32;
/// k-pairs per step of the row-order packing walk: 8 rows read at a time (measured on the LM
/// head's dY, 700 × 28782: 16 pairs 16-19 ms, 8 pairs 10 ms, 4 pairs 9-13 ms, 1 pair 18 ms).
const ROW_PAIRS: usize = 4;

/// One micro-kernel call: `C[rows × cols] = alpha · A·B + beta · C` over `kp` k-pairs.
pub(crate) struct Block {
    pub kp: usize,
    /// The A panel at this k step, in the kernel's `a_layout`.
    pub a: *const u32,
    /// u32s between rows of the A panel (the layout's `si`).
    pub a_rs: usize,
    /// The B panel at this k step: `width` pairs per k-pair.
    pub b: *const u32,
    pub width: usize,
    pub c: *mut f32,
    pub ldc: usize,
    pub rows: usize,
    pub cols: usize,
    pub alpha: f32,
    /// 0: C is overwritten without being read.
    pub beta: f32,
}

/// A micro-kernel and its packed A layout.
pub(crate) trait Kernel: Sync {
    /// Per-thread state for one tile task (AMX: the loaded tile configuration).
    type Task;
    /// Rows per A panel.
    const MR: usize;
    /// Whether a last panel of ≤ 16 columns may be packed 16 wide.
    const NARROW: bool;
    /// k-pairs are padded to a multiple of this.
    const KP_ALIGN: usize;
    fn a_layout(kp_pad: usize) -> PanelLayout;
    ///
    /// # Safety
    /// The CPU has what the kernel needs (AMX: tile state enabled and permitted).
    unsafe fn begin(&self) -> Self::Task;
    /// # Safety
    /// `blk.a` holds `MR` rows × `kp` pairs in `a_layout`, `blk.b` `width` columns × `kp`
    /// pairs; C covers `rows × cols` (rows ≤ MR, cols ≤ width) at stride `ldc`, written by
    /// this call only.
    unsafe fn run(&self, task: &mut Self::Task, blk: &Block);
}

/// A GEMM problem: C[m×n] (row stride ldc) = alpha · A[m×k] · B[k×n] + beta · C.
pub(crate) struct Problem {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
    pub a: MatRef,
    pub b: MatRef,
    pub beta: f32,
    pub c: *mut f32,
    pub ldc: usize,
}

/// A buffer that several tasks write at disjoint indices (C's tiles, packed panels).
struct SharedMut<T>(*mut T);
// SAFETY: tasks write disjoint regions (row × column blocks of C, (panel, pair range) blocks of
// a packed buffer); the caller owns the buffer for the whole call.
unsafe impl<T> Send for SharedMut<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SharedMut<T> {}

impl<T> Clone for SharedMut<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// A method, so that closures capture the whole (Sync) wrapper rather than its field.
    fn at(self, off: usize) -> *mut T {
        self.0.wrapping_add(off)
    }
}

static POOL: Mutex<Vec<Vec<u32>>> = Mutex::new(Vec::new());

/// A pooled buffer of at least `len` u32s (grown, and so zero-filled, only when too short).
fn take(len: usize) -> Vec<u32> {
    let mut v = POOL.lock().ok().and_then(|mut p| p.pop()).unwrap_or_default();
    if v.len() < len {
        v.resize(len, 0);
    }
    v
}

fn give(v: Vec<u32>) {
    if let Ok(mut p) = POOL.lock() {
        if p.len() < 4 {
            p.push(v);
        }
    }
}

/// Packs `lines` lines × `kc` of `src` into consecutive panels of `w` lines (the last one
/// `last_w` wide) × `kp` pairs, each in `lay(width)`. Parallel over panels when each line's k run
/// is contiguous; otherwise over blocks of `ROW_PAIRS` pairs across all panels, so that memory
/// is read a few rows at a time, each from start to end (a panel-at-a-time walk down a wide
/// row-major operand touches a new page per row: packing dY of the LM head ran 3x slower).
#[allow(clippy::too_many_arguments)]
fn pack_panels(
    src: Lines,
    lines: usize,
    kc: usize,
    kp: usize,
    w: usize,
    last_w: usize,
    lay: &(dyn Fn(usize) -> PanelLayout + Sync),
    dst: &mut [u32],
    par: bool,
) {
    let np = lines.div_ceil(w);
    debug_assert_eq!(dst.len(), (np - 1) * w * kp + last_w * kp);
    let d = SharedMut(dst.as_mut_ptr());
    let panel = |j: usize, pairs: std::ops::Range<usize>| {
        let width = if j + 1 == np { last_w } else { w };
        let job = PackJob {
            src: src.at(j * w, 0),
            lines: width.min(lines - j * w),
            kc,
            dst: d.at(j * w * kp),
            lay: lay(width),
            lines_pad: width,
            pairs,
        };
        // SAFETY: panel j's lines (< lines) and k (< kc) are inside the operand; its
        // width × kp u32s start at j·w·kp inside dst; callers give disjoint (j, pairs).
        unsafe { pack::pack(&job) };
    };
    let par = par && lines * kc >= 1 << 15;
    if src.ls == 1 && np > 1 {
        let blocks = kp.div_ceil(ROW_PAIRS);
        let block = |bi: usize| (0..np).for_each(|j| panel(j, ROW_PAIRS * bi..(ROW_PAIRS * bi + ROW_PAIRS).min(kp)));
        if par {
            (0..blocks).into_par_iter().for_each(block);
        } else {
            (0..blocks).for_each(block);
        }
    } else if par {
        (0..np).into_par_iter().for_each(|j| panel(j, 0..kp));
    } else {
        (0..np).for_each(|j| panel(j, 0..kp));
    }
}

/// Tiles (m panels, n panels) per task: at most 16 × 8 panels (224 × 256 of C), split further
/// until there are 4 tasks per thread (or single panels).
fn tile_shape(mp: usize, np: usize, threads: usize) -> (usize, usize) {
    let (mut tm, mut tn) = (mp.min(16), np.min(8));
    while threads > 1 && mp.div_ceil(tm) * np.div_ceil(tn) < 4 * threads {
        if tm > 1 {
            tm = tm.div_ceil(2);
        } else if tn > 1 {
            tn = tn.div_ceil(2);
        } else {
            break;
        }
    }
    (tm, tn)
}

/// Runs `g` with kernel `kern`; multithreaded over rayon's current pool when `par`.
///
/// # Safety
/// A covers m×k and B k×n elements at their strides, valid and unmodified for the call; C
/// covers m rows of n floats at stride ldc, not overlapping A or B. The CPU has avx512f,
/// avx512bw, avx512bf16 and whatever `kern` needs.
pub(crate) unsafe fn run<K: Kernel>(kern: &K, g: &Problem, par: bool) {
    let (m, n, k) = (g.m, g.n, g.k);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for i in 0..m {
            // SAFETY: row i of C holds n floats (caller's contract).
            let row = unsafe { std::slice::from_raw_parts_mut(g.c.add(i * g.ldc), n) };
            row.iter_mut().for_each(|v| *v = if g.beta == 0.0 { 0.0 } else { g.beta * *v });
        }
        return;
    }
    let threads = if par { rayon::current_num_threads().max(1) } else { 1 };
    let mc_max = if m <= MC { m } else { MC / K::MR * K::MR };
    let (mut abuf, mut bbuf) = (Vec::new(), Vec::new());
    for jc in (0..n).step_by(NC) {
        let nc = NC.min(n - jc);
        let kcp = if k <= KC { k } else { (PACK_BUDGET / (2 * (mc_max + nc)) / KC).max(1) * KC };
        for pc in (0..k).step_by(kcp.min(k)) {
            let kc = kcp.min(k - pc);
            let kp = kc.div_ceil(2).next_multiple_of(K::KP_ALIGN);
            // B block: panels of NR columns, the last one 16 wide when it fits
            let (full, rem) = (nc / NR, nc % NR);
            let last_w = if rem == 0 {
                0
            } else if K::NARROW && rem <= 16 {
                16
            } else {
                NR
            };
            let np = full + usize::from(rem > 0);
            let b_len = (full * NR + last_w) * kp;
            if bbuf.len() < b_len {
                give(std::mem::take(&mut bbuf));
                bbuf = take(b_len);
            }
            let b = Lines { ptr: g.b.ptr, ls: g.b.cs, ks: g.b.rs }.at(jc, pc);
            pack_panels(b, nc, kc, kp, NR, if rem == 0 { NR } else { last_w }, &|w| PanelLayout { si: 1, sp: w }, &mut bbuf[..b_len], par);
            for ic in (0..m).step_by(mc_max) {
                let mc = mc_max.min(m - ic);
                let mp = mc.div_ceil(K::MR);
                let a_len = mp * K::MR * kp;
                if abuf.len() < a_len {
                    give(std::mem::take(&mut abuf));
                    abuf = take(a_len);
                }
                let a = Lines { ptr: g.a.ptr, ls: g.a.rs, ks: g.a.cs }.at(ic, pc);
                let lay = K::a_layout(kp);
                pack_panels(a, mc, kc, kp, K::MR, K::MR, &|_| lay, &mut abuf[..a_len], par);
                let (tm, tn) = tile_shape(mp, np, threads);
                let (tiles_m, tiles_n) = (mp.div_ceil(tm), np.div_ceil(tn));
                let (ap, bp) = (abuf.as_ptr() as usize, bbuf.as_ptr() as usize);
                let (c, ldc, alpha, beta) = (SharedMut(g.c), g.ldc, g.alpha, g.beta);
                let task = |t: usize| {
                    let (ti, tj) = (t % tiles_m, t / tiles_m);
                    // SAFETY: run's contract: the CPU has what `kern` needs.
                    let mut state = unsafe { kern.begin() };
                    for s in (0..kp).step_by(KC / 2) {
                        let kps = (KC / 2).min(kp - s);
                        for j in tj * tn..((tj + 1) * tn).min(np) {
                            let width = if j == full { last_w } else { NR };
                            for i in ti * tm..((ti + 1) * tm).min(mp) {
                                let blk = Block {
                                    kp: kps,
                                    a: (ap as *const u32).wrapping_add(i * K::MR * kp + s * lay.sp),
                                    a_rs: lay.si,
                                    b: (bp as *const u32).wrapping_add(j * NR * kp + s * width),
                                    width,
                                    c: c.at((ic + i * K::MR) * ldc + jc + j * NR),
                                    ldc,
                                    rows: K::MR.min(mc - i * K::MR),
                                    cols: width.min(nc - j * NR),
                                    alpha,
                                    beta: if pc == 0 && s == 0 { beta } else { 1.0 },
                                };
                                // SAFETY: panels i, j were packed above with kp pairs (s + kps ≤
                                // kp); the C block is inside C and owned by this task alone.
                                unsafe { kern.run(&mut state, &blk) };
                            }
                        }
                    }
                };
                if threads > 1 {
                    (0..tiles_m * tiles_n).into_par_iter().for_each(task);
                } else {
                    (0..tiles_m * tiles_n).for_each(task);
                }
            }
        }
    }
    give(abuf);
    give(bbuf);
}
