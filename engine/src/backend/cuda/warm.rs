//! Warming the kernel cache ahead of the first step: every kernel family compiled by NVRTC for
//! an architecture named by the caller and stored in the disk cache, with no GPU and no driver
//! (NVRTC compiles for any architecture). A fresh machine's first CUDA step otherwise waits for
//! every family's compile (cold: about 40 s on an H200 host, longer on fewer cores); a cluster's
//! init script runs this on each node (`python -m ortrain.cuda warm`) so that the step reads
//! the CUBINs from disk.

use std::path::Path;

use super::compile::{self, Origin, MIN_COMPUTE_CAPABILITY};
use super::nvrtc::Nvrtc;
use super::registry::FAMILIES;
use crate::error::{Error, Result};

/// What warming did for one kernel family.
#[derive(Clone, Debug, PartialEq)]
pub struct Warmed {
    /// "kernels/softmax.cu"
    pub file: String,
    /// Compiled now (and stored), or found in the cache already.
    pub compiled: bool,
    pub millis: f64,
}

/// The architecture `arch` names ("sm_90"), checked: `sm_` and the compute capability's major
/// and minor digits, no older than the kernels support.
pub fn parse_arch(arch: &str) -> Result<String> {
    let bad = |why: String| Error::Other(format!("arch {arch:?}: {why}"));
    let digits = arch.strip_prefix("sm_").filter(|d| d.len() >= 2 && d.bytes().all(|b| b.is_ascii_digit()));
    let Some(digits) = digits else {
        return Err(bad("an architecture is sm_ and the compute capability's digits, e.g. sm_80, sm_86, sm_90".into()));
    };
    let (major, minor) = digits.split_at(digits.len() - 1);
    let capability = (major.parse::<i32>().unwrap_or(0), minor.parse::<i32>().unwrap_or(0));
    if capability < MIN_COMPUTE_CAPABILITY {
        let (a, b) = MIN_COMPUTE_CAPABILITY;
        return Err(bad(format!("ortrain's CUDA kernels need compute capability {a}.{b} (sm_{a}{b}, Ampere) or newer")));
    }
    Ok(compile::arch_of(capability.0, capability.1))
}

/// Every family's CUBIN for `arch` in the disk cache at `cache_dir`: read where it is there
/// already, else compiled (on up to [`compile::compile_threads`] threads) and stored. A family
/// that does not compile, or whose CUBIN the cache cannot take, is an error naming it.
pub fn warm(nv: &Nvrtc, arch: &str, cache_dir: &Path) -> Result<Vec<Warmed>> {
    let arch = parse_arch(arch)?;
    std::fs::create_dir_all(cache_dir)
        .map_err(|e| Error::Cuda(format!("the kernel cache folder {} cannot be made: {e}", cache_dir.display())))?;
    let done = compile::in_parallel(FAMILIES, |f| compile::load_or_compile(nv, f, &arch, Some(cache_dir)));
    let mut warmed = Vec::new();
    let mut failed = Vec::new();
    for (f, c) in FAMILIES.iter().zip(done) {
        match c.map(|c| c.origin) {
            Ok(Origin::Compiled { millis, stored: true }) => warmed.push(Warmed { file: f.file(), compiled: true, millis }),
            Ok(Origin::Compiled { stored: false, .. }) => {
                failed.push(format!("{}: compiled, but the cache at {} did not take it (is it writable?)", f.file(), cache_dir.display()))
            }
            Ok(Origin::Disk | Origin::Memo) => warmed.push(Warmed { file: f.file(), compiled: false, millis: 0.0 }),
            Err(e) => failed.push(e.to_string()),
        }
    }
    if failed.is_empty() {
        Ok(warmed)
    } else {
        Err(Error::Cuda(format!("warming the kernel cache for {arch}:\n{}", failed.join("\n"))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures_are_sm_and_a_supported_compute_capability() {
        assert_eq!(parse_arch("sm_90").unwrap(), "sm_90");
        assert_eq!(parse_arch("sm_86").unwrap(), "sm_86");
        assert_eq!(parse_arch("sm_100").unwrap(), "sm_100");
        for (bad, says) in [
            ("sm_75", "need compute capability 8.0 (sm_80, Ampere) or newer"),
            ("sm_9", "e.g. sm_80"),
            ("compute_90", "e.g. sm_80"),
            ("sm_90a", "e.g. sm_80"),
            ("", "e.g. sm_80"),
        ] {
            let e = parse_arch(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("arch {bad:?}")) && e.contains(says), "{bad}: {e}");
        }
    }
}
