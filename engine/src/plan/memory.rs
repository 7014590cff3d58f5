//! The memory plan: given each buffer's size and lifetime (first and last step that touches
//! it), place every buffer at an offset in one arena so that buffers alive at the same time never
//! overlap. Greedy by size with best fit (largest buffers first, each into the smallest gap that
//! holds it). Pure data: printable and unit-tested with exact peaks.

/// Alignment of every buffer in the arena, in bytes (one cache line, full AVX-512 vectors).
pub const ALIGN: usize = 64;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buffer {
    pub bytes: usize,
    /// First step at which the buffer is written.
    pub first: usize,
    /// Last step at which it is read (inclusive).
    pub last: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    pub offsets: Vec<usize>,
    pub arena_bytes: usize,
}

pub fn align_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// Places the buffers; `offsets[i]` belongs to `buffers[i]`.
pub fn plan(buffers: &[Buffer]) -> MemoryPlan {
    let mut order: Vec<usize> = (0..buffers.len()).collect();
    order.sort_by(|&a, &b| buffers[b].bytes.cmp(&buffers[a].bytes).then(buffers[a].first.cmp(&buffers[b].first)));
    let mut offsets = vec![usize::MAX; buffers.len()];
    let mut placed: Vec<usize> = Vec::with_capacity(buffers.len());
    let mut arena = 0usize;
    for &i in &order {
        let b = &buffers[i];
        let size = align_up(b.bytes.max(1));
        // occupied intervals of placed buffers whose lifetimes overlap this one
        let mut busy: Vec<(usize, usize)> = placed
            .iter()
            .filter(|&&j| buffers[j].first <= b.last && b.first <= buffers[j].last)
            .map(|&j| (offsets[j], offsets[j] + align_up(buffers[j].bytes.max(1))))
            .collect();
        busy.sort_unstable();
        let mut best: Option<(usize, usize)> = None; // (gap size, offset)
        let mut cursor = 0usize;
        for &(start, end) in &busy {
            if start > cursor {
                let gap = start - cursor;
                if gap >= size && best.is_none_or(|(g, _)| gap < g) {
                    best = Some((gap, cursor));
                }
            }
            cursor = cursor.max(end);
        }
        let offset = best.map(|(_, o)| o).unwrap_or(cursor);
        offsets[i] = offset;
        arena = arena.max(offset + size);
        placed.push(i);
    }
    MemoryPlan { offsets, arena_bytes: arena }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(bytes: usize, first: usize, last: usize) -> Buffer {
        Buffer { bytes, first, last }
    }

    fn check_no_overlap(bufs: &[Buffer], p: &MemoryPlan) {
        for i in 0..bufs.len() {
            for j in i + 1..bufs.len() {
                let live = bufs[i].first <= bufs[j].last && bufs[j].first <= bufs[i].last;
                let (a0, a1) = (p.offsets[i], p.offsets[i] + bufs[i].bytes);
                let (b0, b1) = (p.offsets[j], p.offsets[j] + bufs[j].bytes);
                assert!(!live || a1 <= b0 || b1 <= a0, "buffers {i} and {j} overlap");
            }
        }
    }

    #[test]
    fn chain_reuses_memory() {
        // a -> b -> c -> d: only two buffers alive at a time
        let bufs = vec![b(1024, 0, 1), b(1024, 1, 2), b(1024, 2, 3), b(1024, 3, 4)];
        let p = plan(&bufs);
        check_no_overlap(&bufs, &p);
        assert_eq!(p.arena_bytes, 2048);
    }

    #[test]
    fn all_alive_sums_up_with_alignment() {
        let bufs = vec![b(100, 0, 5), b(10, 0, 5), b(64, 0, 5)];
        let p = plan(&bufs);
        check_no_overlap(&bufs, &p);
        assert_eq!(p.arena_bytes, 128 + 64 + 64);
    }

    #[test]
    fn best_fit_fills_the_gap() {
        // a big long-lived buffer, two short ones that can share the space after a freed one
        let bufs = vec![b(4096, 0, 10), b(2048, 0, 1), b(1024, 2, 3), b(1024, 2, 3)];
        let p = plan(&bufs);
        check_no_overlap(&bufs, &p);
        assert_eq!(p.arena_bytes, 4096 + 2048);
    }

    #[test]
    fn empty_plan() {
        assert_eq!(plan(&[]).arena_bytes, 0);
    }
}
