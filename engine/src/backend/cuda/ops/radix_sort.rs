//! A stable sort of u32 keys carrying u32 values on the device (kernels/sort.cu): least
//! significant digit first, 8 bits a pass, as many passes as the largest key needs (2 for a
//! vocabulary under 65536). Each pass counts the digits tile by tile, scans the counts and
//! moves every key to its digit's slots in its tile's order, so equal keys keep the order they
//! came in. GatherGrad sorts its indices with it (ops/gather.rs), which is how it sums repeated
//! rows in a fixed order without float atomics.

use super::CudaCtx;
use crate::backend::cuda::launch::{Grid, KArg};
use crate::error::Result;

/// Keys a block of radix_hist and radix_scatter takes (kernels/sort.cu `RADIX_TILE`).
const TILE: usize = 1024;
/// radix_scatter's block size (`RADIX_THREADS`).
const THREADS: u32 = 256;
const DIGITS: usize = 256;
/// Scratch regions start at this alignment (the runtime's own).
const ALIGN: usize = 256;

/// The passes needed for keys up to `max_key`.
pub(crate) fn passes(max_key: u32) -> u32 {
    (u32::BITS - max_key.leading_zeros()).div_ceil(8)
}

/// Where the sort's arrays lie in one scratch region: keys and values twice (the passes move
/// them back and forth), the digit counts, and the caller's `extra` bytes after them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Layout {
    pub keys: [u64; 2],
    pub vals: [u64; 2],
    pub hist: u64,
    pub extra: u64,
    pub tiles: usize,
    pub bytes: usize,
}

impl Layout {
    pub(super) fn at(base: u64, n: usize, extra: usize) -> Self {
        let array = (n * 4).div_ceil(ALIGN) * ALIGN;
        let tiles = n.div_ceil(TILE).max(1);
        let at = |k: usize| base + (k * array) as u64;
        let hist = (DIGITS * tiles * 4).div_ceil(ALIGN) * ALIGN;
        Layout {
            keys: [at(0), at(1)],
            vals: [at(2), at(3)],
            hist: at(4),
            extra: at(4) + hist as u64,
            tiles,
            bytes: 4 * array + hist + extra,
        }
    }
}

/// A sort's result in the runtime's scratch, valid until the scratch is next asked for.
pub(crate) struct Sorted {
    pub keys: u64,
    pub vals: u64,
    /// the `extra` bytes the caller asked for beside the sort's arrays (256-byte aligned)
    pub extra: u64,
}

/// Sorts n (key, value) pairs stably by key on `ctx`'s stream, in the runtime's scratch:
/// `fill(keys, values)` queues what writes them (n u32 each, no key above `max_key`). Returns
/// the addresses of the sorted keys and values and of `extra` more bytes of scratch.
pub(crate) fn sort_pairs(ctx: &CudaCtx, n: usize, max_key: u32, extra: usize, fill: impl FnOnce(u64, u64) -> Result<()>) -> Result<Sorted> {
    let base = ctx.rt.scratch(Layout::at(0, n, extra).bytes)?;
    let l = Layout::at(base, n, extra);
    fill(l.keys[0], l.vals[0])?;
    let tiles = l.tiles as i64;
    let blocks = (l.tiles as u32).min(ctx.rt.sms * 8);
    let mut from = 0;
    for pass in 0..passes(max_key) {
        let shift = KArg::I32(8 * pass as i32);
        let (src_k, src_v, dst_k, dst_v) = (l.keys[from], l.vals[from], l.keys[1 - from], l.vals[1 - from]);
        let grid = Grid::new(blocks, THREADS);
        ctx.rt.launch(
            ctx.stream,
            "radix_hist_u32",
            grid,
            &[KArg::Ptr(src_k), KArg::Ptr(l.hist), KArg::I64(n as i64), shift, KArg::I64(tiles)],
        )?;
        ctx.rt.launch(ctx.stream, "radix_scan_u32", Grid::new(1, 1024), &[KArg::Ptr(l.hist), KArg::I64((DIGITS * l.tiles) as i64)])?;
        ctx.rt.launch(
            ctx.stream,
            "radix_scatter_u32",
            grid,
            &[
                KArg::Ptr(src_k),
                KArg::Ptr(src_v),
                KArg::Ptr(dst_k),
                KArg::Ptr(dst_v),
                KArg::Ptr(l.hist),
                KArg::I64(n as i64),
                shift,
                KArg::I64(tiles),
            ],
        )?;
        from = 1 - from;
    }
    Ok(Sorted { keys: l.keys[from], vals: l.vals[from], extra: l.extra })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_cover_the_largest_key() {
        assert_eq!(passes(0), 0);
        assert_eq!(passes(1), 1);
        assert_eq!(passes(255), 1);
        assert_eq!(passes(256), 2);
        assert_eq!(passes(50257), 2);
        assert_eq!(passes(65536), 3);
        assert_eq!(passes(u32::MAX), 4);
    }

    #[test]
    fn layout_regions_do_not_overlap() {
        for (n, extra) in [(0, 0), (1, 8), (700, 0), (1024, 4096), (1025, 1), (16384, 1 << 20)] {
            let l = Layout::at(4096, n, extra);
            let mut starts = [l.keys[0], l.keys[1], l.vals[0], l.vals[1], l.hist];
            starts.sort();
            for w in starts.windows(2) {
                assert!(w[1] - w[0] >= (n * 4) as u64, "n {n}: {l:?}");
            }
            assert!(starts.iter().chain([&l.extra]).all(|s| s % ALIGN as u64 == 0), "n {n}: {l:?}");
            assert!(l.extra >= l.hist + (DIGITS * l.tiles * 4) as u64, "n {n}: {l:?}");
            assert_eq!(4096 + l.bytes as u64, l.extra + extra as u64, "n {n}: {l:?}");
        }
    }
}
