//! Warming the kernel cache ahead of the first step: every kernel family compiled by NVRTC for
//! an architecture named by the caller and stored in the disk cache, with no GPU and no driver
//! (NVRTC compiles for any architecture). A fresh machine's first CUDA step otherwise waits for
//! every family's compile (cold: about 40 s on an H200 host, longer on fewer cores); a cluster's
//! init script runs this on each node (`python -m ortrain.cuda warm`) so that the step reads
//! the CUBINs from disk. A warm-up holds a lock on the cache for its architecture while it
//! compiles, and a process that loads the kernels meanwhile ([`wait_for_warm_up`]) waits for it
//! instead of compiling the same files beside it.

use std::fs::{File, TryLockError};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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

/// The file a warm-up of `arch` locks in `cache_dir` (an advisory lock: the system drops it when
/// the process ends, however it ends).
fn lock_path(cache_dir: &Path, arch: &str) -> PathBuf {
    cache_dir.join(format!(".warming-{arch}.lock"))
}

/// For a process about to load `arch`'s kernels from `cache_dir`: while a warm-up of that
/// architecture holds its lock, waits for it (at most `max_wait`), so that the CUBINs it is
/// compiling are read from the cache afterwards rather than compiled a second time on the same
/// cores. How long it waited; zero where no warm-up was running.
pub fn wait_for_warm_up(cache_dir: &Path, arch: &str, max_wait: Duration) -> Duration {
    let start = Instant::now();
    let Ok(file) = File::open(lock_path(cache_dir, arch)) else { return Duration::ZERO };
    loop {
        match file.try_lock_shared() {
            Err(TryLockError::WouldBlock) if start.elapsed() < max_wait => std::thread::sleep(Duration::from_millis(100)),
            _ => return start.elapsed(),
        }
    }
}

/// Every family's CUBIN for `arch` in the disk cache at `cache_dir`: read where it is there
/// already, else compiled (on up to [`compile::compile_threads`] threads) and stored, under the
/// warm-up lock (a second warm-up of the same architecture waits, then finds every file there).
/// A family that does not compile, or whose CUBIN the cache cannot take, is an error naming it.
pub fn warm(nv: &Nvrtc, arch: &str, cache_dir: &Path) -> Result<Vec<Warmed>> {
    let arch = parse_arch(arch)?;
    let cannot = |what: &str, e: std::io::Error| Error::Cuda(format!("{what} {}: {e}", cache_dir.display()));
    std::fs::create_dir_all(cache_dir).map_err(|e| cannot("the kernel cache folder cannot be made:", e))?;
    let lock = File::create(lock_path(cache_dir, &arch)).map_err(|e| cannot("the warm-up lock cannot be made in", e))?;
    lock.lock().map_err(|e| cannot("the warm-up lock cannot be taken in", e))?;
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
    drop(lock);
    if failed.is_empty() {
        Ok(warmed)
    } else {
        Err(Error::Cuda(format!("warming the kernel cache for {arch}:\n{}", failed.join("\n"))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loader waits while a warm-up holds the lock and goes on when it is released, or when
    /// its patience runs out; with no warm-up it does not wait.
    #[test]
    fn loading_waits_for_a_warm_up_in_progress() {
        let dir = std::env::temp_dir().join(format!("ortrain-warm-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(wait_for_warm_up(&dir, "sm_90", Duration::from_secs(5)), Duration::ZERO);
        let held = File::create(lock_path(&dir, "sm_90")).unwrap();
        held.lock().unwrap();
        let waited = wait_for_warm_up(&dir, "sm_90", Duration::from_millis(300));
        assert!(waited >= Duration::from_millis(300) && waited < Duration::from_secs(3), "{waited:?}");
        assert!(wait_for_warm_up(&dir, "sm_80", Duration::from_secs(5)) < Duration::from_millis(50), "another arch's lock");
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(400));
            drop(held);
        });
        let waited = wait_for_warm_up(&dir, "sm_90", Duration::from_secs(20));
        release.join().unwrap();
        assert!(waited >= Duration::from_millis(300) && waited < Duration::from_secs(10), "{waited:?}");
        assert!(wait_for_warm_up(&dir, "sm_90", Duration::from_secs(5)) < Duration::from_millis(50), "released: no wait");
        let _ = std::fs::remove_dir_all(&dir);
    }

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
