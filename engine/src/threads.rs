//! The engine's thread pool (rayon's global pool): how many workers, and whether each is pinned
//! to one core. Pinning keeps a worker's caches and stops the OS moving the workers about; it is
//! only safe when the pool takes every core this process may run on, since two pinned pools
//! sharing fewer cores could not spread out. `ORTRAIN_PIN_THREADS`: `auto` (the default: pin when
//! the pool has as many workers as the process has cores), `on` (pin whenever there are enough
//! cores), `off`.

use std::sync::OnceLock;

use crate::error::{Error, Result};

/// Where the workers were pinned, one core per worker; empty: not pinned (or not built here).
static PINNED: OnceLock<Vec<usize>> = OnceLock::new();

/// The cores this process may run on (Linux; empty elsewhere or when it cannot be read).
pub fn allowed_cores() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: cpu_set_t is a plain bitmask; sched_getaffinity writes at most its size.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: pid 0 is this thread; the size is the set's.
        if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
            return Vec::new();
        }
        // SAFETY: c < CPU_SETSIZE, within the set.
        (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
    }
    #[cfg(not(target_os = "linux"))]
    Vec::new()
}

/// Pins the calling thread to `core`; false if the OS refused.
fn pin_to(core: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        if core >= libc::CPU_SETSIZE as usize {
            return false;
        }
        // SAFETY: as in allowed_cores; core < CPU_SETSIZE.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: core < CPU_SETSIZE.
        unsafe { libc::CPU_SET(core, &mut set) };
        // SAFETY: pid 0 is this thread; the set is initialised.
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = core;
        false
    }
}

/// The cores `n` workers are pinned to under `policy` (the value of ORTRAIN_PIN_THREADS, None:
/// unset), given the allowed cores; empty: no pinning.
fn plan(n: usize, policy: Option<&str>, allowed: &[usize]) -> Result<Vec<usize>> {
    let pin = match policy.map(str::trim) {
        None | Some("auto") | Some("") => n > 1 && n == allowed.len(),
        Some("on") | Some("1") => n > 1 && n <= allowed.len(),
        Some("off") | Some("0") => false,
        Some(other) => {
            return Err(Error::other(format!("ORTRAIN_PIN_THREADS={other:?}: expected auto, on or off")));
        }
    };
    Ok(if pin { allowed[..n].to_vec() } else { Vec::new() })
}

/// A pool builder of `n` workers, worker i pinned to `cores[i]` when `cores` is not empty.
fn builder(n: usize, cores: Vec<usize>) -> rayon::ThreadPoolBuilder {
    rayon::ThreadPoolBuilder::new().num_threads(n).start_handler(move |i| {
        if let Some(&c) = cores.get(i) {
            pin_to(c);
        }
    })
}

/// Builds rayon's global pool with `n` workers (once per process, before the first kernel
/// runs), pinned as ORTRAIN_PIN_THREADS says. Returns the pool's size, unchanged if the pool was
/// already built (or RAYON_NUM_THREADS is set: then rayon sizes it, unpinned).
pub fn init_global_pool(n: usize) -> Result<usize> {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() && n > 0 && PINNED.get().is_none() {
        let cores = plan(n, std::env::var("ORTRAIN_PIN_THREADS").ok().as_deref(), &allowed_cores())?;
        if builder(n, cores.clone()).build_global().is_ok() {
            let _ = PINNED.set(cores);
        }
    }
    Ok(rayon::current_num_threads())
}

/// The cores the global pool's workers are pinned to (one per worker), empty when they float.
pub fn pinned_cores() -> Vec<usize> {
    PINNED.get().cloned().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinning_follows_the_policy_and_the_cores() {
        let four = [0, 1, 2, 3];
        assert_eq!(plan(4, None, &four).unwrap_or_default(), four);
        assert_eq!(plan(2, None, &four).unwrap_or_default(), Vec::<usize>::new(), "auto: not when cores are left over");
        assert_eq!(plan(2, Some("on"), &four).unwrap_or_default(), [0, 1]);
        assert_eq!(plan(8, Some("on"), &four).unwrap_or_default(), Vec::<usize>::new(), "not more workers than cores");
        assert_eq!(plan(4, Some("off"), &four).unwrap_or_default(), Vec::<usize>::new());
        assert_eq!(plan(1, None, &[5]).unwrap_or_default(), Vec::<usize>::new(), "one worker floats");
        let e = plan(2, Some("yes"), &four).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("ORTRAIN_PIN_THREADS") && e.contains("auto, on or off"), "{e}");
    }

    /// Each worker of a pinned pool runs on its own core only (on the cores this test may use).
    #[test]
    fn pinned_workers_run_on_their_core() {
        let allowed = allowed_cores();
        if allowed.len() < 2 {
            eprintln!("skipped: fewer than 2 usable cores");
            return;
        }
        let cores = allowed[..2].to_vec();
        let Ok(pool) = builder(2, cores.clone()).build() else { panic!("pool") };
        let mut seen = pool.broadcast(|c| (c.index(), allowed_cores()));
        seen.sort();
        assert_eq!(seen, vec![(0, vec![cores[0]]), (1, vec![cores[1]])]);
    }
}
