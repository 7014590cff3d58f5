//! Packing f32 operands into bf16 pair panels. A panel holds `lines` (rows of A, columns of B)
//! times `kp` k-pairs; each u32 is one pair: bf16(x[line, 2p]) in the low half and
//! bf16(x[line, 2p + 1]) in the high half, the operand layout of `vdpbf16ps` and `tdpbf16ps`.
//! Rounding is to nearest even; lines and pairs past the valid range are written as zeros, so
//! kernels never branch on the k or line edges.

use std::ops::Range;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::round_bits as bf16_bits;

/// An f32 operand seen as lines along k: element (line l, k) at `ptr + l·ls + k·ks`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lines {
    pub ptr: *const f32,
    pub ls: isize,
    pub ks: isize,
}
impl Lines {
    /// The view starting at (line l, k).
    pub fn at(self, l: usize, k: usize) -> Lines {
        Lines { ptr: self.ptr.wrapping_offset(l as isize * self.ls + k as isize * self.ks), ..self }
    }
}

// SAFETY: a read-only view of memory the GEMM caller keeps valid and unmodified for the call.
unsafe impl Send for Lines {}
// SAFETY: as above.
unsafe impl Sync for Lines {}

/// One packing call: pairs `pairs` of `lines × kc` of `src` into the panel at `dst`, lines
/// padded with zeros to `lines_pad` (pairs past `kc` are zeros too).
#[derive(Clone, Debug)]
pub(crate) struct PackJob {
    pub src: Lines,
    pub lines: usize,
    pub kc: usize,
    pub dst: *mut u32,
    pub lay: PanelLayout,
    pub lines_pad: usize,
    pub pairs: Range<usize>,
}

/// Where pair (line l, pair p) goes in a panel: `dst[l·si + p·sp]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PanelLayout {
    pub si: usize,
    pub sp: usize,
}

/// `x` rounded to bf16 and widened back to f32.
#[cfg(test)]
pub(crate) fn round_bf16(x: f32) -> f32 {
    f32::from_bits((bf16_bits(x) as u32) << 16)
}

/// Runs `job` one element at a time: the reference the vector packer is tested against, and the
/// path for operands with no unit stride.
///
/// # Safety
/// `job.src` must cover `lines × kc` elements; `job.dst` must be valid for writes at every
/// `l·si + p·sp` (l < lines_pad, p in `pairs`), and not be written by anyone else meanwhile.
pub(crate) unsafe fn pack_scalar(job: &PackJob) {
    let PackJob { src, lines, kc, dst, lay, lines_pad, ref pairs } = *job;
    let at = |l: usize, k: usize| -> u32 {
        if l < lines && k < kc {
            // SAFETY: l < lines and k < kc: inside the caller's operand.
            bf16_bits(unsafe { *src.ptr.offset(l as isize * src.ls + k as isize * src.ks) }) as u32
        } else {
            0
        }
    };
    for l in 0..lines_pad {
        for p in pairs.clone() {
            // SAFETY: inside the panel (caller's contract).
            unsafe { *dst.add(l * lay.si + p * lay.sp) = at(l, 2 * p) | (at(l, 2 * p + 1) << 16) };
        }
    }
}

/// As `pack_scalar`, vectorized where one of the source strides and one of the panel strides
/// is 1 (every operand the matmul kernels pass, and both kernels' panels).
///
/// # Safety
/// As `pack_scalar`, and the CPU has avx512f, avx512bw and avx512bf16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(crate) unsafe fn pack(job: &PackJob) {
    let (src, lay) = (job.src, job.lay);
    // SAFETY (all three): forwarded from this function's contract.
    unsafe {
        if src.ks == 1 && (lay.si == 1 || lay.sp == 1) {
            pack_k_contiguous(job)
        } else if src.ls == 1 && lay.si == 1 {
            pack_lines_contiguous(job)
        } else if src.ls == 1 && lay.sp == 1 {
            pack_lines_to_pair_rows(job)
        } else {
            pack_scalar(job)
        }
    }
}

/// Mask of the first `n` (≤ 16) lanes.
#[cfg(target_arch = "x86_64")]
fn lanes(n: usize) -> __mmask16 {
    if n >= 16 {
        0xFFFF
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}

/// Each line's k run is contiguous: 32 floats of one line become 16 pairs in one conversion.
/// With `sp == 1` they are stored as they are; with `si == 1` blocks of 16 lines × 16 pairs are
/// transposed in registers first.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_k_contiguous(job: &PackJob) {
    let PackJob { src, lines, kc, dst, lay, lines_pad, ref pairs } = *job;
    let mut r = [_mm512_setzero_si512(); 16];
    for p0 in pairs.clone().step_by(16) {
        let np = (pairs.end - p0).min(16);
        let nk = kc.saturating_sub(2 * p0).min(32);
        for l0 in (0..lines_pad).step_by(16) {
            let nl = (lines_pad - l0).min(16);
            for (i, v) in r.iter_mut().enumerate() {
                let l = l0 + i;
                *v = if i < nl && l < lines && nk > 0 {
                    // SAFETY: k in [2·p0, 2·p0 + nk) < kc on line l < lines, masked beyond.
                    unsafe {
                        let base = src.ptr.offset(l as isize * src.ls + 2 * p0 as isize);
                        let lo = _mm512_maskz_loadu_ps(lanes(nk), base);
                        let hi = _mm512_maskz_loadu_ps(lanes(nk.saturating_sub(16)), base.add(16));
                        std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo))
                    }
                } else {
                    _mm512_setzero_si512()
                };
            }
            if lay.sp == 1 {
                for (i, v) in r.iter().enumerate().take(nl) {
                    // SAFETY: pairs p0..p0+np of line l0 + i are inside the panel (caller's contract).
                    unsafe { _mm512_mask_storeu_epi32(dst.add((l0 + i) * lay.si + p0) as *mut i32, lanes(np), *v) };
                }
            } else {
                let t = transpose16(&r);
                for (q, v) in t.iter().enumerate().take(np) {
                    // SAFETY: lines l0..l0+nl of pair p0 + q are inside the panel (si == 1).
                    unsafe { _mm512_mask_storeu_epi32(dst.add((p0 + q) * lay.sp + l0) as *mut i32, lanes(nl), *v) };
                }
            }
        }
    }
}

/// The 16 × 16 transpose of 32-bit lanes: out[c] lane r = inp[r] lane c.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn transpose16(r: &[__m512i; 16]) -> [__m512i; 16] {
    // rows (2i, 2i + 1) interleaved by dword, then by qword: b[4i + c] holds, in 128-bit lane L,
    // column 4L + c of rows 4i..4i + 4
    let a: [__m512i; 16] = std::array::from_fn(|j| {
        let (x, y) = (r[j & !1], r[j | 1]);
        if j % 2 == 0 {
            _mm512_unpacklo_epi32(x, y)
        } else {
            _mm512_unpackhi_epi32(x, y)
        }
    });
    let b: [__m512i; 16] = std::array::from_fn(|j| {
        let (i, c) = (j / 4, j % 4);
        let (x, y) = (a[4 * i + c / 2], a[4 * i + 2 + c / 2]);
        if c % 2 == 0 {
            _mm512_unpacklo_epi64(x, y)
        } else {
            _mm512_unpackhi_epi64(x, y)
        }
    });
    // gather lane L of b[c], b[4 + c], b[8 + c], b[12 + c] into out[4L + c]
    let mut out = [_mm512_setzero_si512(); 16];
    for c in 0..4 {
        let e0 = _mm512_shuffle_i32x4::<0x44>(b[c], b[4 + c]);
        let e1 = _mm512_shuffle_i32x4::<0xEE>(b[c], b[4 + c]);
        let f0 = _mm512_shuffle_i32x4::<0x44>(b[8 + c], b[12 + c]);
        let f1 = _mm512_shuffle_i32x4::<0xEE>(b[8 + c], b[12 + c]);
        out[c] = _mm512_shuffle_i32x4::<0x88>(e0, f0);
        out[4 + c] = _mm512_shuffle_i32x4::<0xDD>(e0, f0);
        out[8 + c] = _mm512_shuffle_i32x4::<0x88>(e1, f1);
        out[12 + c] = _mm512_shuffle_i32x4::<0xDD>(e1, f1);
    }
    out
}

/// 16 lines at k = 2p and 2p + 1 (`ls == 1`) as 16 pairs, lane i for line l0 + i.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn line_pairs(src: Lines, lines: usize, kc: usize, l0: usize, p: usize, idx: __m512i) -> __m512i {
    let m = lanes(lines.saturating_sub(l0));
    let load = |k: usize| {
        if k < kc && lines > l0 {
            // SAFETY: lines l0.. (masked to < lines) at k < kc are inside the operand (caller's
            // contract).
            unsafe { _mm512_maskz_loadu_ps(m, src.ptr.offset(k as isize * src.ks + l0 as isize)) }
        } else {
            _mm512_setzero_ps()
        }
    };
    let v = _mm512_cvtne2ps_pbh(load(2 * p + 1), load(2 * p));
    // SAFETY: a bit cast between two 512-bit vector types.
    _mm512_permutexvar_epi16(idx, unsafe { std::mem::transmute::<__m512bh, __m512i>(v) })
}

/// The permutation that interleaves `_mm512_cvtne2ps_pbh(hi, lo)`: bf16 lane 2i takes lo[i],
/// lane 2i + 1 takes hi[i] (hi sits in lanes 16..32).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn pair_interleave() -> __m512i {
    let idx: [i16; 32] = std::array::from_fn(|j| if j % 2 == 0 { (j / 2) as i16 } else { (16 + j / 2) as i16 });
    // SAFETY: idx is 64 bytes.
    unsafe { _mm512_loadu_si512(idx.as_ptr() as *const __m512i) }
}

/// Lines are contiguous for one k (`ls == 1`) and the panel keeps each line's pairs together
/// (`sp == 1`: the AMX kernel's A panel of a transposed operand, as dW = Gᵀ·X's Gᵀ): blocks of
/// 16 lines × 16 pairs are converted a pair at a time (lane = line) and transposed in registers.
/// One element at a time this was 11.5% of the tutorial head's bf16 time in `perf`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_lines_to_pair_rows(job: &PackJob) {
    let PackJob { src, lines, kc, dst, lay, lines_pad, ref pairs } = *job;
    let idx = pair_interleave();
    let mut r = [_mm512_setzero_si512(); 16];
    for p0 in pairs.clone().step_by(16) {
        let np = (pairs.end - p0).min(16);
        for l0 in (0..lines_pad).step_by(16) {
            let nl = (lines_pad - l0).min(16);
            for (q, v) in r.iter_mut().enumerate() {
                // SAFETY: forwarded from this function's contract.
                *v = if q < np { unsafe { line_pairs(src, lines, kc, l0, p0 + q, idx) } } else { _mm512_setzero_si512() };
            }
            let t = transpose16(&r);
            for (i, v) in t.iter().enumerate().take(nl) {
                // SAFETY: pairs p0..p0+np of line l0 + i are inside the panel (caller's contract, sp == 1).
                unsafe { _mm512_mask_storeu_epi32(dst.add((l0 + i) * lay.si + p0) as *mut i32, lanes(np), *v) };
            }
        }
    }
}

/// Lines are contiguous for one k: 16 lines at k = 2p and 2p + 1 are converted together and
/// interleaved into 16 pairs, stored along the panel's lines (`si == 1`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_lines_contiguous(job: &PackJob) {
    let PackJob { src, lines, kc, dst, lay, lines_pad, ref pairs } = *job;
    let idx = pair_interleave();
    for p in pairs.clone() {
        for l0 in (0..lines_pad).step_by(16) {
            let nl = (lines_pad - l0).min(16);
            // SAFETY: forwarded from this function's contract.
            let v = unsafe { line_pairs(src, lines, kc, l0, p, idx) };
            // SAFETY: lines l0..l0+nl of pair p are inside the panel (caller's contract, si == 1).
            unsafe { _mm512_mask_storeu_epi32(dst.add(p * lay.sp + l0) as *mut i32, lanes(nl), v) };
        }
    }
}
