//! A minimal reader of a CUBIN (a 64-bit little-endian ELF file whose machine is `EM_CUDA`):
//! the kernel entry points of its symbol table, and each kernel's parameter layout from its
//! `.nv.info.<kernel>` section, and the records and sections [`super::resources`] reads. Enough to check the kernel registry, and the launch ABI the
//! host will use, against what NVRTC compiled, without a GPU; and to check a cached CUBIN before
//! it is used. Every read is bounds-checked; a malformed file is an error.

use std::collections::HashMap;

/// `e_machine` of NVIDIA CUDA objects.
pub const EM_CUDA: u16 = 190;
const SHT_SYMTAB: u32 = 2;
const SHT_NOBITS: u32 = 8;
const STT_FUNC: u8 = 2;
const STB_GLOBAL: u8 = 1;
/// `st_other` flag NVIDIA sets on kernel entry points (`__global__` functions).
const STO_CUDA_ENTRY: u8 = 0x10;

/// One symbol of the symbol table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Symbol {
    pub name: String,
    /// A global function symbol.
    pub global_func: bool,
    /// Marked as a kernel entry point (`__global__`).
    pub entry: bool,
}

/// The parts of the ELF header this reader needs.
#[derive(Clone, Copy, Debug)]
pub struct Header {
    pub machine: u16,
    /// `e_ident[EI_ABIVERSION]`: NVIDIA's CUDA ELF ABI version (8 for CUDA 12.8+ and 13).
    pub abi_version: u8,
    pub flags: u32,
}

impl Header {
    /// The target SM (90 for sm_90): bits 8..16 of `e_flags` from ABI version 8 on, the low byte
    /// before.
    pub fn sm(&self) -> u32 {
        if self.abi_version >= 8 {
            (self.flags >> 8) & 0xff
        } else {
            self.flags & 0xff
        }
    }
}

fn slice(b: &[u8], at: u64, len: u64) -> Result<&[u8], String> {
    let end = at.checked_add(len).ok_or("offset overflow")?;
    b.get(at as usize..end as usize).ok_or_else(|| format!("truncated ELF: bytes {at}..{end} of {}", b.len()))
}
pub(crate) fn u16_at(b: &[u8], at: u64) -> Result<u16, String> {
    Ok(u16::from_le_bytes(slice(b, at, 2)?.try_into().expect("2 bytes")))
}
pub(crate) fn u32_at(b: &[u8], at: u64) -> Result<u32, String> {
    Ok(u32::from_le_bytes(slice(b, at, 4)?.try_into().expect("4 bytes")))
}
fn u64_at(b: &[u8], at: u64) -> Result<u64, String> {
    Ok(u64::from_le_bytes(slice(b, at, 8)?.try_into().expect("8 bytes")))
}

/// Checks the identification bytes and returns the header fields.
pub fn header(b: &[u8]) -> Result<Header, String> {
    let ident = slice(b, 0, 16)?;
    if &ident[..4] != b"\x7fELF" {
        return Err("not an ELF file".into());
    }
    if ident[4] != 2 || ident[5] != 1 {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    Ok(Header { machine: u16_at(b, 0x12)?, abi_version: ident[8], flags: u32_at(b, 0x30)? })
}

struct Section {
    name_at: u32,
    kind: u32,
    offset: u64,
    size: u64,
    link: u32,
    entsize: u64,
}

fn sections(b: &[u8]) -> Result<Vec<Section>, String> {
    let shoff = u64_at(b, 0x28)?;
    let shentsize = u16_at(b, 0x3A)? as u64;
    let shnum = u16_at(b, 0x3C)? as u64;
    if shentsize < 0x40 {
        return Err(format!("section header size {shentsize} is too small"));
    }
    (0..shnum)
        .map(|i| {
            let at = shoff.saturating_add(i * shentsize);
            Ok(Section {
                name_at: u32_at(b, at)?,
                kind: u32_at(b, at.saturating_add(4))?,
                offset: u64_at(b, at.saturating_add(0x18))?,
                size: u64_at(b, at.saturating_add(0x20))?,
                link: u32_at(b, at.saturating_add(0x28))?,
                entsize: u64_at(b, at.saturating_add(0x38))?,
            })
        })
        .collect()
}

fn c_str(table: &[u8], at: u32) -> Result<String, String> {
    let rest = table.get(at as usize..).ok_or_else(|| format!("string offset {at} past the table"))?;
    let end = rest.iter().position(|&c| c == 0).ok_or("unterminated string")?;
    String::from_utf8(rest[..end].to_vec()).map_err(|_| "symbol name is not UTF-8".to_string())
}

/// The entries of symbol table `s` in order: name (empty for none), `st_info`, `st_other`.
fn table_entries(b: &[u8], secs: &[Section], s: &Section) -> Result<Vec<(String, u8, u8)>, String> {
    let strtab = secs.get(s.link as usize).ok_or("symbol table links to a missing string table")?;
    let names = slice(b, strtab.offset, strtab.size)?;
    let ent = if s.entsize == 0 { 24 } else { s.entsize };
    if ent < 24 {
        return Err(format!("symbol entry size {ent} is too small"));
    }
    let table = slice(b, s.offset, s.size)?;
    (0..s.size / ent)
        .map(|k| {
            let e = &table[(k * ent) as usize..(k * ent + 24) as usize];
            Ok((c_str(names, u32::from_le_bytes(e[..4].try_into().expect("4 bytes")))?, e[4], e[5]))
        })
        .collect()
}

/// Every symbol of every symbol table in the file.
pub fn symbols(b: &[u8]) -> Result<Vec<Symbol>, String> {
    header(b)?;
    let secs = sections(b)?;
    let mut out = Vec::new();
    for s in secs.iter().filter(|s| s.kind == SHT_SYMTAB) {
        for (name, info, other) in table_entries(b, &secs, s)? {
            if name.is_empty() {
                continue;
            }
            out.push(Symbol { name, global_func: info & 0xf == STT_FUNC && info >> 4 == STB_GLOBAL, entry: other & STO_CUDA_ENTRY != 0 });
        }
    }
    Ok(out)
}

/// Names of the kernel entry points (global functions) of a CUBIN, sorted.
pub fn kernel_names(cubin: &[u8]) -> Result<Vec<String>, String> {
    let h = header(cubin)?;
    if h.machine != EM_CUDA {
        return Err(format!("ELF machine {} is not CUDA ({EM_CUDA})", h.machine));
    }
    let mut names: Vec<String> = symbols(cubin)?.into_iter().filter(|s| s.global_func).map(|s| s.name).collect();
    names.sort();
    names.dedup();
    Ok(names)
}

/// One kernel parameter as the compiler laid it out: its position in the signature, byte
/// offset in the parameter buffer and size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Param {
    pub ordinal: u16,
    pub offset: u16,
    pub size: u32,
}

/// `.nv.info` attribute formats (a record is a format byte, an attribute byte, then: nothing
/// for NVAL, one byte for BVAL, two for HVAL, each padded to 4 bytes; for SVAL a u16 size and
/// that many bytes), and the attribute holding one parameter's layout.
const EIFMT_NVAL: u8 = 1;
const EIFMT_BVAL: u8 = 2;
const EIFMT_HVAL: u8 = 3;
const EIFMT_SVAL: u8 = 4;
const EIATTR_KPARAM_INFO: u8 = 0x17;

/// A section whose name starts with the prefix asked for: the rest of its name, its size, and
/// its bytes (none for a section that occupies no file space, such as `.nv.shared.<kernel>`).
pub(crate) struct NamedSection<'a> {
    pub rest: String,
    pub size: u64,
    pub data: &'a [u8],
}

/// The sections whose names start with `prefix`.
pub(crate) fn sections_named<'a>(b: &'a [u8], prefix: &str) -> Result<Vec<NamedSection<'a>>, String> {
    let secs = sections(b)?;
    let shstrndx = u16_at(b, 0x3E)? as usize;
    let names_sec = secs.get(shstrndx).ok_or("no section name table")?;
    let names = slice(b, names_sec.offset, names_sec.size)?;
    let mut out = Vec::new();
    for s in &secs {
        let name = c_str(names, s.name_at)?;
        if let Some(rest) = name.strip_prefix(prefix) {
            let data = if s.kind == SHT_NOBITS { &[][..] } else { slice(b, s.offset, s.size)? };
            out.push(NamedSection { rest: rest.to_string(), size: s.size, data });
        }
    }
    Ok(out)
}

/// The name of every entry of the first symbol table, by index (empty where a symbol has
/// none): what `.nv.info` records name a kernel by.
pub(crate) fn symbols_by_index(b: &[u8]) -> Result<Vec<String>, String> {
    let secs = sections(b)?;
    let Some(s) = secs.iter().find(|s| s.kind == SHT_SYMTAB) else { return Ok(Vec::new()) };
    Ok(table_entries(b, &secs, s)?.into_iter().map(|(name, ..)| name).collect())
}

/// One `.nv.info` record: its attribute and its payload (the 2 value bytes of an NVAL, BVAL or
/// HVAL record, the sized bytes of an SVAL one).
pub(crate) struct InfoRecord<'a> {
    pub attr: u8,
    pub payload: &'a [u8],
}

/// The records of a `.nv.info` section (`section` names it in errors).
pub(crate) fn info_records<'a>(section: &str, info: &'a [u8]) -> Result<Vec<InfoRecord<'a>>, String> {
    let mut out = Vec::new();
    let mut i = 0usize;
    while i + 2 <= info.len() {
        let (fmt, attr) = (info[i], info[i + 1]);
        match fmt {
            EIFMT_NVAL | EIFMT_BVAL | EIFMT_HVAL => {
                out.push(InfoRecord { attr, payload: slice(info, i as u64 + 2, 2)? });
                i += 4;
            }
            EIFMT_SVAL => {
                let size = u16_at(info, i as u64 + 2)? as usize;
                out.push(InfoRecord { attr, payload: slice(info, i as u64 + 4, size as u64)? });
                i += 4 + size;
            }
            other => return Err(format!("{section}: unknown attribute format {other} at byte {i}")),
        }
    }
    Ok(out)
}

/// Every kernel's parameters (sorted by ordinal), from the `.nv.info.<kernel>` sections.
pub fn kernel_params(b: &[u8]) -> Result<HashMap<String, Vec<Param>>, String> {
    let mut out = HashMap::new();
    for s in sections_named(b, ".nv.info.")? {
        let section = format!(".nv.info.{}", s.rest);
        out.insert(s.rest, params_of(&section, s.data)?);
    }
    Ok(out)
}

fn params_of(section: &str, info: &[u8]) -> Result<Vec<Param>, String> {
    let mut params = Vec::new();
    for r in info_records(section, info)?.iter().filter(|r| r.attr == EIATTR_KPARAM_INFO) {
        if r.payload.len() < 12 {
            return Err(format!("{section}: parameter record of {} bytes", r.payload.len()));
        }
        // u32 index, u16 ordinal, u16 offset, u32 with the size in its top 14 bits
        params.push(Param { ordinal: u16_at(r.payload, 4)?, offset: u16_at(r.payload, 6)?, size: u32_at(r.payload, 8)? >> 18 });
    }
    params.sort_by_key(|p| p.ordinal);
    Ok(params)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-built ELF64 with a symbol table of one global function `k_f32` and one local
    /// section symbol: the layout NVRTC's CUBINs use.
    fn tiny_elf() -> Vec<u8> {
        let strtab = b"\0k_f32\0.text.k_f32\0".to_vec();
        let mut symtab = vec![0u8; 24]; // the null symbol
        let mut sym = vec![0u8; 24];
        sym[..4].copy_from_slice(&1u32.to_le_bytes());
        sym[4] = (STB_GLOBAL << 4) | STT_FUNC;
        sym[5] = STO_CUDA_ENTRY;
        symtab.extend(sym);
        let mut local = vec![0u8; 24];
        local[..4].copy_from_slice(&7u32.to_le_bytes());
        local[4] = 3; // STT_SECTION, STB_LOCAL
        symtab.extend(local);
        let mut b = vec![0u8; 64];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        b[5] = 1;
        b[8] = 8;
        b[0x12..0x14].copy_from_slice(&EM_CUDA.to_le_bytes());
        b[0x30..0x34].copy_from_slice(&0x6005a04u32.to_le_bytes()); // as NVRTC 13.0 writes for sm_90
        let str_off = b.len() as u64;
        b.extend(&strtab);
        let sym_off = b.len() as u64;
        b.extend(&symtab);
        let shoff = b.len() as u64;
        b[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
        b[0x3A..0x3C].copy_from_slice(&64u16.to_le_bytes());
        b[0x3C..0x3E].copy_from_slice(&3u16.to_le_bytes());
        let sh = |kind: u32, off: u64, size: u64, link: u32, ent: u64| {
            let mut h = vec![0u8; 64];
            h[4..8].copy_from_slice(&kind.to_le_bytes());
            h[0x18..0x20].copy_from_slice(&off.to_le_bytes());
            h[0x20..0x28].copy_from_slice(&size.to_le_bytes());
            h[0x28..0x2C].copy_from_slice(&link.to_le_bytes());
            h[0x38..0x40].copy_from_slice(&ent.to_le_bytes());
            h
        };
        b.extend(sh(0, 0, 0, 0, 0));
        b.extend(sh(3, str_off, strtab.len() as u64, 0, 0));
        b.extend(sh(SHT_SYMTAB, sym_off, symtab.len() as u64, 1, 24));
        b
    }

    #[test]
    fn lists_global_functions_only() {
        let b = tiny_elf();
        assert_eq!(header(&b).unwrap().sm(), 90);
        assert_eq!(kernel_names(&b).unwrap(), vec!["k_f32".to_string()]);
        let all = symbols(&b).unwrap();
        assert_eq!(all.len(), 2);
        assert!(all[0].entry && !all[1].global_func);
    }

    #[test]
    fn malformed_files_are_errors() {
        let b = tiny_elf();
        for cut in [0, 10, 63, 80, b.len() - 1] {
            assert!(kernel_names(&b[..cut]).is_err(), "cut at {cut}");
        }
        let mut wrong = b.clone();
        wrong[0x12] = 62; // x86-64
        assert!(kernel_names(&wrong).unwrap_err().contains("not CUDA"));
        assert!(kernel_names(b"hello, world, this is not an ELF").is_err());
    }
}
