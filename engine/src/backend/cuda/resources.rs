//! What each kernel of a CUBIN takes from an SM, as ptxas decided when NVRTC compiled it: its
//! registers a thread, its stack frame (local memory: spilled registers and local arrays), its
//! static shared memory and its `__launch_bounds__` block size. All are read from the CUBIN
//! (the global `.nv.info` records, the `.nv.info.<kernel>` and `.nv.shared.<kernel>` sections),
//! so no GPU is needed; the CI compile test reports them for every kernel and holds the stack
//! frames to budgets, so that a change that makes a kernel spill shows before any GPU runs it.

use std::collections::BTreeMap;

use super::elf::{self, InfoRecord};

/// `.nv.info` attributes: in the global section a (symbol index, value) pair each, in a
/// kernel's own section the launch bound's (x, y, z).
const EIATTR_MAX_THREADS: u8 = 0x05;
const EIATTR_FRAME_SIZE: u8 = 0x11;
const EIATTR_REGCOUNT: u8 = 0x2f;

/// The registers of one SM sub-partition's file a block may use, and how a warp's share is
/// allocated (sm_80 to sm_90: units of 256, i.e. a thread's count rounded up to 8).
const REGISTERS_A_BLOCK: u32 = 65_536;
const WARP_ALLOCATION_UNIT: u32 = 256;
const MAX_BLOCK_THREADS: u32 = 1024;

/// sm_90 CUBINs have a `.nv.shared.reserved.0` section, and every kernel's
/// `.nv.shared.<kernel>` section then starts with the 1 KiB of shared memory a block reserves
/// for the system (CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK): the kernel's own is
/// the rest, what ptxas reports. sm_80 CUBINs have neither.
const RESERVED_SHARED_SECTION: &str = "reserved.0";
const RESERVED_SHARED_BYTES: u64 = 1024;

/// One kernel's share of an SM.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    pub registers: u32,
    /// Local memory a thread: spilled registers and arrays the compiler could not keep in
    /// registers. Every byte of it is a round trip through the L1 cache.
    pub frame_bytes: u32,
    /// `__shared__` arrays, without the block's reserved 1 KiB.
    pub static_shared_bytes: u64,
    /// The block size `__launch_bounds__` promised ptxas, if the kernel declares one.
    pub launch_bound: Option<u32>,
}

impl Resources {
    /// The most threads a block of this kernel can have before a launch fails with "too many
    /// resources requested": what the register file holds, at most 1024 and the launch bound.
    pub fn max_block_threads(&self) -> u32 {
        let per_warp = self.registers.max(1).div_ceil(8) * 8 * 32;
        let warps = REGISTERS_A_BLOCK / per_warp.next_multiple_of(WARP_ALLOCATION_UNIT);
        let by_registers = (warps * 32).min(MAX_BLOCK_THREADS);
        self.launch_bound.map_or(by_registers, |b| b.min(by_registers))
    }
}

fn value_of(r: &InfoRecord) -> Result<(usize, u32), String> {
    if r.payload.len() != 8 {
        return Err(format!("global .nv.info attribute {:#x} has {} bytes, not a (symbol, value) pair", r.attr, r.payload.len()));
    }
    Ok((elf::u32_at(r.payload, 0)? as usize, elf::u32_at(r.payload, 4)?))
}

/// Every kernel's resources, by name.
pub fn kernel_resources(cubin: &[u8]) -> Result<BTreeMap<String, Resources>, String> {
    let mut out: BTreeMap<String, Resources> = elf::kernel_names(cubin)?.into_iter().map(|k| (k, Resources::default())).collect();
    let symbols = elf::symbols_by_index(cubin)?;
    for s in elf::sections_named(cubin, ".nv.info")?.iter().filter(|s| s.rest.is_empty()) {
        for r in elf::info_records(".nv.info", s.data)? {
            if r.attr != EIATTR_REGCOUNT && r.attr != EIATTR_FRAME_SIZE {
                continue;
            }
            let (sym, value) = value_of(&r)?;
            let name = symbols.get(sym).ok_or_else(|| format!("global .nv.info names symbol {sym} of {}", symbols.len()))?;
            if let Some(k) = out.get_mut(name) {
                if r.attr == EIATTR_REGCOUNT {
                    k.registers = value;
                } else {
                    k.frame_bytes = value;
                }
            }
        }
    }
    for s in elf::sections_named(cubin, ".nv.info.")? {
        let section = format!(".nv.info.{}", s.rest);
        let Some(k) = out.get_mut(&s.rest) else { continue };
        for r in elf::info_records(&section, s.data)?.iter().filter(|r| r.attr == EIATTR_MAX_THREADS) {
            let dim = |i: u64| elf::u32_at(r.payload, i * 4);
            k.launch_bound = Some(dim(0)? * dim(1)? * dim(2)?);
        }
    }
    let shared = elf::sections_named(cubin, ".nv.shared.")?;
    let reserved = if shared.iter().any(|s| s.rest == RESERVED_SHARED_SECTION) { RESERVED_SHARED_BYTES } else { 0 };
    for s in shared {
        if let Some(k) = out.get_mut(&s.rest) {
            k.static_shared_bytes = s.size.saturating_sub(reserved);
        }
    }
    if let Some((name, _)) = out.iter().find(|(_, r)| r.registers == 0) {
        return Err(format!("the CUBIN gives kernel {name} no register count"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_register_file_bounds_a_block() {
        let r = |registers, launch_bound| Resources { registers, launch_bound, ..Default::default() }.max_block_threads();
        assert_eq!(r(255, None), 256); // 256 a thread after rounding: 8 warps of 8192
        assert_eq!(r(168, None), 384); // 5376 a warp: 12 warps
        assert_eq!(r(64, None), 1024);
        assert_eq!(r(32, None), 1024); // never over 1024
        assert_eq!(r(90, Some(128)), 128);
    }
}
