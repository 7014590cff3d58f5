//! The AMX micro-kernel (Intel Xeon with amx_bf16): a 32 × 32 block of C in four tiles, A in two
//! 16-row tiles and B in two 16-column tiles, `tdpbf16ps` over 16 k-pairs per step. The AMX
//! intrinsics are unstable in Rust 1.95, so the tile instructions are stable inline `asm!`;
//! detection is CPUID leaf 7 (EDX bits 22 amx_bf16 and 24 amx_tile) plus XCR0 tile state, and
//! the tile data permission is requested once per process with arch_prctl(ARCH_REQ_XCOMP_PERM).
//!
//! The kernel is written against `TileOps` so that a software model of the five tile
//! instructions (`Emu`, tests only) runs the same packing, addressing and store code on CPUs
//! without AMX; only the `asm!` bodies of `Hw` need the real thing.

use std::arch::asm;
use std::arch::x86_64::*;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::sync::OnceLock;
use std::time::Duration;

use super::avx512::store16;
use super::driver::{Block, Kernel};
use super::pack::PanelLayout;
use super::trial;

/// The four accumulator tiles (tmm0..tmm3), loads into tmm4..tmm7, the final store.
pub(crate) trait TileOps {
    /// Configures the tiles for this thread (all eight: 16 rows × 64 bytes).
    ///
    /// # Safety
    /// For the real tiles: the CPU has AMX with tile state enabled and permitted (`available`).
    unsafe fn begin() -> Self;
    /// # Safety
    /// The tile configuration is loaded (`begin`).
    unsafe fn zero(&mut self);
    /// C tiles += A tiles (rows 0..16 at a0, 16..32 at a1) · B tiles (columns 0..16 at b0, 16..32
    /// at b1), 16 k-pairs; strides in bytes.
    ///
    /// # Safety
    /// Each pointer covers 16 rows of 64 bytes at its stride.
    unsafe fn step(&mut self, a0: *const u32, a1: *const u32, a_stride: usize, b0: *const u32, b1: *const u32, b_stride: usize);
    /// Loads the 32 × 32 f32 accumulator from `c` (row stride `stride` bytes).
    ///
    /// # Safety
    /// The tile configuration is loaded; `c` covers 32 rows of 32 floats at `stride`.
    unsafe fn load(&mut self, c: *const f32, stride: usize);
    /// Stores the 32 × 32 f32 accumulator at `out` (row stride `stride` bytes).
    ///
    /// # Safety
    /// `out` covers 32 rows of 32 floats at `stride`.
    unsafe fn store(&mut self, out: *mut f32, stride: usize);
}

pub(crate) struct Amx<T>(std::marker::PhantomData<fn() -> T>);

impl<T> Amx<T> {
    pub(crate) fn new() -> Self {
        Amx(std::marker::PhantomData)
    }
}

#[repr(C, align(64))]
struct Out([[f32; 32]; 32]);

impl<T: TileOps> Kernel for Amx<T> {
    type Task = T;
    const MR: usize = 32;
    const NARROW: bool = false;
    const KP_ALIGN: usize = 16;

    /// Rows of pairs: an A tile is 16 rows × 16 pairs at row stride `kp_pad` u32s.
    fn a_layout(kp_pad: usize) -> PanelLayout {
        PanelLayout { si: kp_pad, sp: 1 }
    }

    unsafe fn begin(&self) -> T {
        // SAFETY: the caller's contract (the CPU has what T needs).
        unsafe { T::begin() }
    }

    unsafe fn run(&self, t: &mut T, blk: &Block) {
        debug_assert!(blk.width == 32 && blk.kp.is_multiple_of(16));
        // SAFETY (both): the driver's contract: the A panel holds 32 rows × kp pairs at row
        // stride a_rs, the B panel kp pairs × 32 columns (128 bytes per pair); kp is a multiple
        // of 16.
        let steps = |t: &mut T| unsafe {
            for p in (0..blk.kp).step_by(16) {
                let (a0, b0) = (blk.a.add(p), blk.b.add(p * 32));
                t.step(a0, a0.add(16 * blk.a_rs), blk.a_rs * 4, b0, b0.add(16), 128);
            }
        };
        if blk.rows == 32 && blk.cols == 32 && blk.alpha == 1.0 && (blk.beta == 0.0 || blk.beta == 1.0) {
            // a whole block of C, plain product or accumulation: the tiles start from C (or
            // zero) and are stored straight back. Through the 4 KiB staging block and the
            // vector store below, the stores were 15% of the bf16 LM head's time in `perf`.
            let stride = blk.ldc * 4;
            // SAFETY: the block's 32 rows of 32 floats are inside C at row stride ldc, and
            // written by this call only (driver's contract).
            unsafe {
                if blk.beta == 0.0 {
                    t.zero();
                } else {
                    t.load(blk.c, stride);
                }
                steps(t);
                t.store(blk.c, stride);
            }
            return;
        }
        let mut out = MaybeUninit::<Out>::uninit();
        // SAFETY: as above; `out` holds 32 × 32 floats at row stride 128 bytes.
        unsafe {
            t.zero();
            steps(t);
            t.store(out.as_mut_ptr() as *mut f32, 128);
            // SAFETY: `store` wrote all 32 × 32 floats; the AMX path is chosen only on CPUs
            // that also have avx512f (and avx512bf16 for packing).
            store_block(out.assume_init_ref(), blk);
        }
    }
}

/// C's rows × cols block = alpha · out + beta · C, compiled for avx512f so that the loads and
/// masked stores inline.
///
/// # Safety
/// The driver's contract on `blk`; the CPU has avx512f.
#[target_feature(enable = "avx512f")]
unsafe fn store_block(out: &Out, blk: &Block) {
    for (i, row) in out.0.iter().enumerate().take(blk.rows) {
        for v in 0..2 {
            // SAFETY: row i < rows of C, columns masked to < cols.
            unsafe {
                let acc = _mm512_loadu_ps(row.as_ptr().add(16 * v));
                store16(blk.c.add(i * blk.ldc + 16 * v), acc, blk.cols.saturating_sub(16 * v), blk.alpha, blk.beta);
            }
        }
    }
}

/// The real tile unit: the tile configuration is per thread, so Hw stays on the thread that
/// loaded it (not Send).
pub(crate) struct Hw(PhantomData<*const ()>);

#[repr(C, align(64))]
struct TileCfg([u8; 64]);

impl TileOps for Hw {
    unsafe fn begin() -> Self {
        let mut cfg = TileCfg([0; 64]);
        cfg.0[0] = 1; // palette 1
        for t in 0..8 {
            cfg.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
            cfg.0[48 + t] = 16;
        }
        // SAFETY: the caller's contract (CPU support, OS state, permission); the configuration
        // is a valid palette-1 layout.
        unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly)) };
        Hw(PhantomData)
    }

    unsafe fn zero(&mut self) {
        // SAFETY: tiles configured in `begin`.
        unsafe { asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem)) };
    }

    unsafe fn step(&mut self, a0: *const u32, a1: *const u32, a_stride: usize, b0: *const u32, b1: *const u32, b_stride: usize) {
        // SAFETY: the caller's contract: 16 rows of 64 bytes at each pointer and stride.
        unsafe {
            asm!(
                "tileloadd tmm4, [{a0} + {as_}*1]",
                "tileloadd tmm5, [{a1} + {as_}*1]",
                "tileloadd tmm6, [{b0} + {bs}*1]",
                "tileloadd tmm7, [{b1} + {bs}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a0,
                a1 = in(reg) a1,
                as_ = in(reg) a_stride,
                b0 = in(reg) b0,
                b1 = in(reg) b1,
                bs = in(reg) b_stride,
                options(nostack, readonly),
            )
        };
    }

    unsafe fn load(&mut self, c: *const f32, stride: usize) {
        // SAFETY: c covers 32 rows of 32 floats at `stride` bytes: tile (r, q) at row 16r,
        // column 16q.
        unsafe {
            asm!(
                "tileloadd tmm0, [{p0} + {s}*1]",
                "tileloadd tmm1, [{p1} + {s}*1]",
                "tileloadd tmm2, [{p2} + {s}*1]",
                "tileloadd tmm3, [{p3} + {s}*1]",
                p0 = in(reg) c,
                p1 = in(reg) c.add(16),
                p2 = in(reg) c.byte_add(16 * stride),
                p3 = in(reg) c.byte_add(16 * stride).add(16),
                s = in(reg) stride,
                options(nostack, readonly),
            )
        };
    }

    unsafe fn store(&mut self, out: *mut f32, stride: usize) {
        // SAFETY: out covers 32 rows of 32 floats at `stride` bytes: tile (r, q) at row 16r,
        // column 16q.
        unsafe {
            asm!(
                "tilestored [{p0} + {s}*1], tmm0",
                "tilestored [{p1} + {s}*1], tmm1",
                "tilestored [{p2} + {s}*1], tmm2",
                "tilestored [{p3} + {s}*1], tmm3",
                p0 = in(reg) out,
                p1 = in(reg) out.add(16),
                p2 = in(reg) out.byte_add(16 * stride),
                p3 = in(reg) out.byte_add(16 * stride).add(16),
                s = in(reg) stride,
                options(nostack),
            )
        };
    }
}

impl Drop for Hw {
    fn drop(&mut self) {
        // SAFETY: releases this thread's tile state loaded in `begin`.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// Whether this process uses the AMX kernel, and why not when the CPU has AMX.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    /// The CPU reports no amx_bf16 + amx_tile.
    Absent,
    /// The CPU has AMX, but the OS does not enable its tile state (XCR0).
    OsDisabled,
    /// The CPU has AMX, but it is not used (why).
    Unusable(String),
    Usable,
}

static STATUS: OnceLock<Status> = OnceLock::new();

/// Checked once: CPU support, tile state enabled by the OS, (on Linux) the permission to use
/// tile data granted to this process, then a trial run of the kernel in a child process
/// (trial.rs): the tile path has never run on the project's own machines, and a fault there
/// must not end the user's training.
pub(crate) fn status() -> &'static Status {
    STATUS.get_or_init(|| {
        if !cpu_has_amx_bf16() {
            return Status::Absent;
        }
        if !os_enables_tiles() {
            return Status::OsDisabled;
        }
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512bf16")) {
            return Status::Unusable("the CPU lacks avx512_bf16, which the packers need".into());
        }
        if let Err(why) = request_permission() {
            return Status::Unusable(why);
        }
        // SAFETY: the CPU has the packers' features (checked above) and AMX with tile state
        // enabled and permitted, which `Hw` needs.
        let trial = trial::in_child(|| unsafe { trial::exact_products(&Amx::<Hw>::new()) }, Duration::from_secs(10));
        trial.failure().map_or(Status::Usable, Status::Unusable)
    })
}

/// The status if it has been checked already (explain does not start a trial).
pub(crate) fn known_status() -> Option<&'static Status> {
    STATUS.get()
}

pub(crate) fn available() -> bool {
    *status() == Status::Usable
}

fn cpu_has_amx_bf16() -> bool {
    // leaf 7 is read only if the CPU reports it
    if __cpuid(0).eax < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    edx & (1 << 22) != 0 && edx & (1 << 24) != 0
}

fn os_enables_tiles() -> bool {
    let osxsave = __cpuid(1).ecx & (1 << 27) != 0;
    // XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA)
    // SAFETY: OSXSAVE set means xgetbv is enabled.
    osxsave && (unsafe { xcr0() } >> 17) & 3 == 3
}

/// # Safety
/// The CPU reports OSXSAVE.
#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    _xgetbv(0)
}

/// Asks Linux for this process's permission to use tile data: Err(why) when refused.
#[cfg(target_os = "linux")]
fn request_permission() -> Result<(), String> {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) only extends this process's permitted
    // xsave features.
    if unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) } == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    Err(match err.raw_os_error() {
        // the kernel refuses while any thread's signal stack is too small for the tile state
        Some(libc::ENOSPC) => "Linux refused the tile data permission: a thread's signal stack is too small for AMX state (ENOSPC)".into(),
        _ => format!("Linux refused the tile data permission ({err})"),
    })
}

#[cfg(not(target_os = "linux"))]
fn request_permission() -> Result<(), String> {
    Err("AMX tile data is requested on Linux only".into())
}

/// A software model of the tile instructions the kernel uses (tests only): same data layout,
/// products of bf16 pairs accumulated in f32.
#[cfg(test)]
pub(crate) struct Emu {
    tiles: Box<[[[u32; 16]; 16]; 8]>,
}

#[cfg(test)]
impl Emu {
    /// # Safety
    /// `p` covers 16 rows of 64 bytes at `stride` bytes.
    unsafe fn load(&mut self, t: usize, p: *const u32, stride: usize) {
        for r in 0..16 {
            for c in 0..16 {
                // SAFETY: the caller's contract.
                self.tiles[t][r][c] = unsafe { *((p as *const u8).add(r * stride) as *const u32).add(c) };
            }
        }
    }

    fn dp(&mut self, c: usize, a: usize, b: usize) {
        let half = |x: u32, hi: bool| f32::from_bits(if hi { x & 0xFFFF_0000 } else { x << 16 });
        for m in 0..16 {
            for n in 0..16 {
                let mut acc = f32::from_bits(self.tiles[c][m][n]);
                for k in 0..16 {
                    let (x, y) = (self.tiles[a][m][k], self.tiles[b][k][n]);
                    acc += half(x, false) * half(y, false) + half(x, true) * half(y, true);
                }
                self.tiles[c][m][n] = acc.to_bits();
            }
        }
    }
}

#[cfg(test)]
impl TileOps for Emu {
    unsafe fn begin() -> Self {
        Emu { tiles: Box::new([[[0; 16]; 16]; 8]) }
    }

    unsafe fn zero(&mut self) {
        for t in 0..4 {
            self.tiles[t] = [[0; 16]; 16];
        }
    }

    unsafe fn step(&mut self, a0: *const u32, a1: *const u32, a_stride: usize, b0: *const u32, b1: *const u32, b_stride: usize) {
        // SAFETY: the caller's contract.
        unsafe {
            self.load(4, a0, a_stride);
            self.load(5, a1, a_stride);
            self.load(6, b0, b_stride);
            self.load(7, b1, b_stride);
        }
        self.dp(0, 4, 6);
        self.dp(1, 4, 7);
        self.dp(2, 5, 6);
        self.dp(3, 5, 7);
    }

    unsafe fn load(&mut self, c: *const f32, stride: usize) {
        for (t, (r0, c0)) in [(0, 0), (0, 16), (16, 0), (16, 16)].into_iter().enumerate() {
            for r in 0..16 {
                for q in 0..16 {
                    // SAFETY: c covers 32 rows of 32 floats at `stride` bytes (caller's contract).
                    self.tiles[t][r][q] = unsafe { *c.byte_add((r0 + r) * stride).add(c0 + q) }.to_bits();
                }
            }
        }
    }

    unsafe fn store(&mut self, out: *mut f32, stride: usize) {
        for (t, (r0, c0)) in [(0, 0), (0, 16), (16, 0), (16, 16)].into_iter().enumerate() {
            for r in 0..16 {
                for c in 0..16 {
                    // SAFETY: out covers 32 rows of 32 floats at `stride` bytes (caller's contract).
                    unsafe { *out.byte_add((r0 + r) * stride).add(c0 + c) = f32::from_bits(self.tiles[t][r][c]) };
                }
            }
        }
    }
}
