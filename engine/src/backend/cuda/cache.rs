//! The on-disk CUBIN cache. A kernel file is compiled by NVRTC once per machine: the CUBIN is
//! stored under a key that hashes everything that changes the output (the kernel source and
//! its headers, the architecture, the NVRTC version and the compile options), so an edited
//! kernel, another GPU or another NVRTC misses the cache instead of loading stale code.
//!
//! Folder: `$ORTRAIN_CACHE_DIR/cuda` when ORTRAIN_CACHE_DIR is set, else
//! `$XDG_CACHE_HOME/ortrain/cuda`, else `~/.cache/ortrain/cuda`. Entries are written to a
//! temporary file and renamed into place (concurrent processes never read half a file), and
//! are checked on read (an ELF for CUDA holding every expected kernel) before use: a corrupt
//! entry is recompiled. The cache is an optimisation: a folder that cannot be written costs a
//! compile per process, never an error.

use std::path::{Path, PathBuf};

use super::elf;

/// Bumped whenever the entry format or the key's contents change.
const FORMAT: &str = "ortrain-cubin-v1";

/// The cache folder (see the module docs), or None when no home folder is known.
pub fn default_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("ORTRAIN_CACHE_DIR").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d).join("cuda"));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d).join("ortrain").join("cuda"));
    }
    std::env::var_os("HOME").filter(|d| !d.is_empty()).map(|h| PathBuf::from(h).join(".cache").join("ortrain").join("cuda"))
}

/// 128-bit FNV-1a: stable across Rust versions and platforms (unlike `DefaultHasher`), which a
/// key stored on disk needs. Not cryptographic: a cache key, checked again on read.
#[derive(Clone, Copy)]
pub struct Fnv128(u128);

impl Default for Fnv128 {
    fn default() -> Self {
        Fnv128(0x6c62272e07bb014262b821756295c58d)
    }
}

impl Fnv128 {
    const PRIME: u128 = 0x0000000001000000000000000000013B;
    fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.0 ^= x as u128;
            self.0 = self.0.wrapping_mul(Self::PRIME);
        }
    }
    /// Adds one field, length-prefixed so that ("ab", "c") and ("a", "bc") differ.
    pub fn field(&mut self, b: &[u8]) -> &mut Self {
        self.bytes(&(b.len() as u64).to_le_bytes());
        self.bytes(b);
        self
    }
    pub fn hex(&self) -> String {
        format!("{:032x}", self.0)
    }
}

/// What identifies one compiled kernel file.
pub struct Key<'a> {
    /// The family's name ("softmax"), used in the file name for people reading the folder.
    pub family: &'a str,
    pub source: &'a str,
    pub headers: &'a [(&'a str, &'a str)],
    pub arch: &'a str,
    /// "13.0"
    pub nvrtc_version: &'a str,
    pub options: &'a [&'a str],
}

impl Key<'_> {
    pub fn file_name(&self) -> String {
        let mut h = Fnv128::default();
        h.field(FORMAT.as_bytes()).field(self.family.as_bytes()).field(self.source.as_bytes());
        for (n, t) in self.headers {
            h.field(n.as_bytes()).field(t.as_bytes());
        }
        h.field(self.arch.as_bytes()).field(self.nvrtc_version.as_bytes());
        for o in self.options {
            h.field(o.as_bytes());
        }
        format!("{}-{}-{}.cubin", self.family, self.arch, h.hex())
    }
}

/// Why a lookup missed.
#[derive(Debug, PartialEq, Eq)]
pub enum Miss {
    Absent,
    /// The entry exists but failed the check (the reason is kept for diagnostics).
    Invalid(String),
}

/// Reads an entry and checks that it is a CUDA ELF defining every name in `expected`.
pub fn read(dir: &Path, key: &Key, expected: &[String]) -> Result<Vec<u8>, Miss> {
    let path = dir.join(key.file_name());
    let bytes = std::fs::read(&path).map_err(|_| Miss::Absent)?;
    let names = elf::kernel_names(&bytes).map_err(Miss::Invalid)?;
    if let Some(m) = expected.iter().find(|e| names.binary_search(e).is_err()) {
        return Err(Miss::Invalid(format!("kernel {m} missing")));
    }
    Ok(bytes)
}

/// Stores an entry (temporary file, then rename). Errors are returned for the caller to
/// report or ignore; nothing is left half-written.
pub fn write(dir: &Path, key: &Key, cubin: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let name = key.file_name();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    let tmp = dir.join(format!(".{name}.{}.{nanos}.tmp", std::process::id()));
    let res = std::fs::write(&tmp, cubin).and_then(|_| std::fs::rename(&tmp, dir.join(&name)));
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key<'a>(source: &'a str, arch: &'a str, ver: &'a str, opts: &'a [&'a str]) -> Key<'a> {
        Key { family: "fam", source, headers: &[("prelude.cuh", "P")], arch, nvrtc_version: ver, options: opts }
    }

    #[test]
    fn key_changes_with_every_input() {
        let base = key("src", "sm_90", "13.0", &["-a"]).file_name();
        assert!(base.starts_with("fam-sm_90-") && base.ends_with(".cubin"));
        assert_eq!(base, key("src", "sm_90", "13.0", &["-a"]).file_name(), "stable");
        for other in [
            key("src2", "sm_90", "13.0", &["-a"]),
            key("src", "sm_80", "13.0", &["-a"]),
            key("src", "sm_90", "13.1", &["-a"]),
            key("src", "sm_90", "13.0", &["-b"]),
        ] {
            assert_ne!(base, other.file_name());
        }
        let mut h = Key { headers: &[("prelude.cuh", "Q")], ..key("src", "sm_90", "13.0", &["-a"]) };
        assert_ne!(base, h.file_name());
        h.headers = &[];
        assert_ne!(base, h.file_name());
    }

    #[test]
    fn fnv_matches_the_reference_vector() {
        // FNV-1a 128 of the empty input is the offset basis; of "a" a published test vector.
        assert_eq!(Fnv128::default().hex(), "6c62272e07bb014262b821756295c58d");
        let mut h = Fnv128::default();
        h.bytes(b"a");
        assert_eq!(h.hex(), "d228cb696f1a8caf78912b704e4a8964");
    }

    #[test]
    fn round_trip_and_corrupt_entries() {
        let dir = std::env::temp_dir().join(format!("ortrain-cache-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let k = key("src", "sm_90", "13.0", &[]);
        assert_eq!(read(&dir, &k, &[]), Err(Miss::Absent));
        write(&dir, &k, b"not an elf").unwrap();
        assert!(matches!(read(&dir, &k, &[]), Err(Miss::Invalid(_))));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
