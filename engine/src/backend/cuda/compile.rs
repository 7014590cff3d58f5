//! Kernel files compiled once per process and cached on disk: [`cubin`] returns the CUBIN of a
//! family for an architecture, from the process memo, else the disk cache (checked), else
//! NVRTC (then stored); [`in_parallel`] runs such work for many families on several threads
//! (a cold start compiles every family). Loading the CUBIN into a CUDA context is the
//! executor's part.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::cache::{self, Key};
use super::nvrtc::{self, Nvrtc};
use super::registry::{Family, HEADERS};
use super::{abi, elf};
use crate::error::{Error, Result};

/// Where a CUBIN came from.
#[derive(Clone, Debug, PartialEq)]
pub enum Origin {
    /// Already compiled in this process.
    Memo,
    /// Read from the disk cache.
    Disk,
    /// Compiled now by NVRTC, in this many milliseconds; `stored` says whether the disk cache
    /// took it (false: no cache folder, or it could not be written).
    Compiled { millis: f64, stored: bool },
}

/// A family's CUBIN for one architecture.
#[derive(Clone, Debug)]
pub struct Cubin {
    pub family: &'static str,
    pub arch: String,
    pub bytes: Arc<Vec<u8>>,
    pub origin: Origin,
    /// NVRTC's warnings, when it compiled now.
    pub log: String,
}

/// The oldest compute capability the kernels compile for: bf16 conversions (`cvt.rn.bf16.f32`)
/// need sm_80 (Ampere).
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// The architecture NVRTC targets for a device of compute capability major.minor ("sm_90").
pub fn arch_of(major: i32, minor: i32) -> String {
    format!("sm_{major}{minor}")
}

/// Compiles `family` for `arch` with NVRTC, no cache, and checks that the CUBIN defines every
/// kernel the registry lists (and no other). For CI and for [`cubin`].
pub fn compile_checked(nv: &Nvrtc, family: &Family, arch: &str) -> Result<(Vec<u8>, String, f64)> {
    let t = Instant::now();
    let out = nvrtc::compile_cubin(nv, &family.file(), family.source, HEADERS, arch)?;
    let millis = t.elapsed().as_secs_f64() * 1e3;
    check_symbols(family, &out.cubin)?;
    check_params(family, &out.cubin)?;
    Ok((out.cubin, out.log, millis))
}

/// Errors unless the CUBIN's kernels are exactly the family's registered names.
pub fn check_symbols(family: &Family, cubin: &[u8]) -> Result<()> {
    let found = elf::kernel_names(cubin).map_err(|e| Error::Cuda(format!("{}: bad CUBIN: {e}", family.file())))?;
    let want = family.kernel_names();
    let missing: Vec<&String> = want.iter().filter(|k| found.binary_search(k).is_err()).collect();
    let extra: Vec<&String> = found.iter().filter(|k| want.binary_search(k).is_err()).collect();
    if missing.is_empty() && extra.is_empty() {
        return Ok(());
    }
    Err(Error::Cuda(format!(
        "{}: the CUBIN does not match the registry (engine/src/backend/cuda/registry.rs): missing {missing:?}, not registered {extra:?}",
        family.file()
    )))
}

/// Errors unless every kernel's parameters, as NVRTC laid them out, are those of its signature
/// in the registry (same count, offsets and sizes): the host's launch ABI (abi.rs).
pub fn check_params(family: &Family, cubin: &[u8]) -> Result<()> {
    let found = elf::kernel_params(cubin).map_err(|e| Error::Cuda(format!("{}: bad CUBIN: {e}", family.file())))?;
    let mut bad = Vec::new();
    for (name, args) in family.kernels() {
        let want = abi::layout(args);
        let got: Vec<(usize, usize)> =
            found.get(&name).map(|ps| ps.iter().map(|p| (p.offset as usize, p.size as usize)).collect()).unwrap_or_default();
        if got != want {
            bad.push(format!("{name}: the CUBIN has (offset, size) {got:?}, the registry's signature {args:?} gives {want:?}"));
        }
    }
    if bad.is_empty() {
        return Ok(());
    }
    Err(Error::Cuda(format!("{}: kernel parameters do not match the launch ABI:\n{}", family.file(), bad.join("\n"))))
}

/// The CUBIN of `family` for `arch`: memo, disk cache (`cache_dir`, None = no disk cache), or
/// NVRTC.
pub fn cubin(nv: &Nvrtc, family: &'static Family, arch: &str, cache_dir: Option<&Path>) -> Result<Cubin> {
    type Memo = HashMap<(&'static str, String), Arc<Vec<u8>>>;
    static MEMO: Mutex<Option<Memo>> = Mutex::new(None);
    let memo_key = (family.name, arch.to_string());
    if let Some(b) = MEMO.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(HashMap::new).get(&memo_key) {
        return Ok(Cubin { family: family.name, arch: arch.into(), bytes: b.clone(), origin: Origin::Memo, log: String::new() });
    }
    let mut c = load_or_compile(nv, family, arch, cache_dir)?;
    let bytes = MEMO.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(HashMap::new).entry(memo_key).or_insert(c.bytes).clone();
    c.bytes = bytes;
    Ok(c)
}

/// Most kernel files compiled at once: NVRTC compiles one program on one core, taking up to a
/// few GiB for the largest attention files.
const MAX_COMPILE_THREADS: usize = 8;

/// The threads [`in_parallel`] compiles on: the machine's cores, at most [`MAX_COMPILE_THREADS`].
pub fn compile_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, MAX_COMPILE_THREADS)
}

/// `work(family)` for every family, on up to [`MAX_COMPILE_THREADS`] threads (never more than
/// the machine's cores), each thread taking the next family when it finishes one; results in
/// the families' order. The attention families go first: their templates are the long
/// compiles (sm_90, NVRTC 13.0, one core: attention_mma.cu 33 s, attention_flash_dropout.cu and
/// attention_flash_padded_dropout.cu about 19 s each, attention_flash_padded.cu 10 s; most
/// files under 2 s), so they do not start last and leave the other threads idle.
pub fn in_parallel<T: Send>(families: &'static [Family], work: impl Fn(&'static Family) -> T + Sync) -> Vec<T> {
    let mut order: Vec<usize> = (0..families.len()).collect();
    order.sort_by_key(|&i| (!families[i].source.contains("#include \"attention"), std::cmp::Reverse(families[i].source.len())));
    let threads = compile_threads().min(families.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done: Mutex<Vec<Option<T>>> = Mutex::new((0..families.len()).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(&i) = order.get(k) else { break };
                let out = work(&families[i]);
                done.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(out);
            });
        }
    });
    // every index was taken by a thread that stored its result (a panicking `work` propagates
    // out of the scope above)
    done.into_inner().unwrap_or_else(|p| p.into_inner()).into_iter().flatten().collect()
}

/// The disk cache's key of `family`'s CUBIN for `arch` compiled by this NVRTC (`version`: its
/// version string).
fn key<'a>(family: &'a Family, arch: &'a str, version: &'a str) -> Key<'a> {
    Key { family: family.name, source: family.source, headers: HEADERS, arch, nvrtc_version: version, options: nvrtc::BASE_OPTIONS }
}

/// Stores a CUBIN of [`compile_checked`] in the disk cache at `dir`, where [`load_or_compile`]
/// finds it: engine/tests/cuda_kernels.rs, which compiles every family, leaves them for the
/// emulated GPU tests that CI runs next (a cold cache cost them the same compiles again).
pub fn store(nv: &Nvrtc, family: &Family, arch: &str, dir: &Path, cubin: &[u8]) -> std::io::Result<()> {
    cache::write(dir, &key(family, arch, &nv.version_string()), cubin)
}

/// The disk cache, else NVRTC (storing the result), without the process memo.
pub fn load_or_compile(nv: &Nvrtc, family: &'static Family, arch: &str, cache_dir: Option<&Path>) -> Result<Cubin> {
    let version = nv.version_string();
    let key = key(family, arch, &version);
    let expected = family.kernel_names();
    let (bytes, origin, log) = match cache_dir.map(|d| cache::read(d, &key, &expected)) {
        Some(Ok(b)) => (b, Origin::Disk, String::new()),
        _ => {
            let (b, log, millis) = compile_checked(nv, family, arch)?;
            let stored = cache_dir.is_some_and(|d| cache::write(d, &key, &b).is_ok());
            (b, Origin::Compiled { millis, stored }, log)
        }
    };
    Ok(Cubin { family: family.name, arch: arch.into(), bytes: Arc::new(bytes), origin, log })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::registry::FAMILIES;

    /// Every family's work is done once and its result comes back at the family's place,
    /// whatever thread took it and in whatever order they finished.
    #[test]
    fn in_parallel_returns_every_familys_result_in_order() {
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let names = in_parallel(FAMILIES, |f| {
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            // the attention families (taken first) finish last
            std::thread::sleep(std::time::Duration::from_millis(if f.name.starts_with("attention") { 20 } else { 1 }));
            f.name
        });
        assert_eq!(names, FAMILIES.iter().map(|f| f.name).collect::<Vec<_>>());
        assert_eq!(calls.into_inner(), FAMILIES.len());
        assert!(compile_threads() >= 1 && compile_threads() <= MAX_COMPILE_THREADS);
    }
}
