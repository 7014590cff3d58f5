//! The avx512_bf16 micro-kernel: a 14-row × 32-column (or × 16 for a last narrow panel) block of
//! C accumulated in 28 zmm registers with `vdpbf16ps`, one broadcast A pair and two B vectors per
//! k-pair. Also the masked alpha/beta store of an f32 block into C, shared with the AMX kernel.

use std::arch::x86_64::*;

use super::driver::{Block, Kernel};
use super::pack::PanelLayout;

/// Rows of C per A panel: 14 × 2 accumulators + 2 B vectors + 1 broadcast fit 32 registers.
pub(crate) const MR: usize = 14;

pub(crate) struct Avx512Bf16;

impl Kernel for Avx512Bf16 {
    type Task = ();
    const MR: usize = MR;
    const NARROW: bool = true;
    const KP_ALIGN: usize = 1;

    fn a_layout(_kp_pad: usize) -> PanelLayout {
        PanelLayout { si: 1, sp: MR }
    }

    unsafe fn begin(&self) {}

    unsafe fn run(&self, _: &mut (), blk: &Block) {
        // SAFETY: the driver's contract on `blk`; this kernel is only built after avx512bf16
        // was detected.
        unsafe {
            if blk.width == 32 {
                tile::<2>(blk)
            } else {
                tile::<1>(blk)
            }
        }
    }
}

/// C[rows × cols] = alpha · (A panel · B panel) + beta · C over `blk.kp` pairs.
///
/// # Safety
/// `blk` as the driver documents it; the CPU has avx512f and avx512bf16.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile<const NV: usize>(blk: &Block) {
    let mut acc = [[_mm512_setzero_ps(); NV]; MR];
    let (mut pa, mut pb) = (blk.a, blk.b);
    for _ in 0..blk.kp {
        // SAFETY: the B panel holds NV·16 u32 per pair and the A panel MR per pair, kp pairs.
        unsafe {
            let bv: [__m512bh; NV] = std::array::from_fn(|v| std::mem::transmute(_mm512_loadu_si512(pb.add(16 * v) as *const __m512i)));
            for (i, row) in acc.iter_mut().enumerate() {
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*pa.add(i) as i32));
                for (v, a) in row.iter_mut().enumerate() {
                    *a = _mm512_dpbf16_ps(*a, av, bv[v]);
                }
            }
            pa = pa.add(MR);
            pb = pb.add(16 * NV);
        }
    }
    for (i, row) in acc.iter().enumerate().take(blk.rows) {
        for (v, a) in row.iter().enumerate() {
            // SAFETY: row i < rows of C, columns masked to < cols (driver's contract).
            unsafe { store16(blk.c.add(i * blk.ldc + 16 * v), *a, blk.cols.saturating_sub(16 * v), blk.alpha, blk.beta) };
        }
    }
}

/// c[0..n] = alpha · acc + beta · c[0..n] for the first `n` (clamped to 16) lanes; C is not read
/// when beta is 0.
///
/// # Safety
/// `c` must be valid for `min(n, 16)` floats; the CPU has avx512f.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn store16(c: *mut f32, acc: __m512, n: usize, alpha: f32, beta: f32) {
    if n == 0 {
        return;
    }
    let m: __mmask16 = if n >= 16 { 0xFFFF } else { ((1u32 << n) - 1) as __mmask16 };
    let r = _mm512_mul_ps(acc, _mm512_set1_ps(alpha));
    // SAFETY: masked to the caller's n valid floats.
    unsafe {
        let r = if beta != 0.0 { _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, c), _mm512_set1_ps(beta), r) } else { r };
        _mm512_mask_storeu_ps(c, m, r);
    }
}
