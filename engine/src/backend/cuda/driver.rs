//! Is CUDA usable on this machine? cudarc loads `libcuda` on its first call and panics when it is
//! missing (and on a missing symbol, which an older driver lacks), so this module probes the
//! driver itself first, with its own `dlopen` of `libcuda.so.1`: it calls `cuInit`,
//! `cuDriverGetVersion` and `cuDeviceGetCount` through its own handle and turns every failure
//! into an [`Error::CudaUnavailable`] that says what is missing. Nothing here panics; cudarc's
//! driver API is used only after [`probe`] succeeded.

use std::ffi::{c_char, c_int, c_uint, CStr};
use std::sync::OnceLock;

use crate::error::{Error, Result};

/// The driver library, by the name the NVIDIA driver installs (not the `libcuda.so` dev link).
#[cfg(not(windows))]
pub const DRIVER_LIB: &str = "libcuda.so.1";
#[cfg(windows)]
pub const DRIVER_LIB: &str = "nvcuda.dll";

/// The oldest driver API the backend is built for (cudarc feature `cuda-13000`): 13.0.
pub const MIN_DRIVER_VERSION: i32 = 13000;

/// What the probe found on a machine where CUDA is usable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverInfo {
    /// The CUDA version the driver supports, as `cuDriverGetVersion` reports it (13000 = 13.0).
    pub version: i32,
    /// Devices visible to this process (after CUDA_VISIBLE_DEVICES).
    pub devices: i32,
}

impl DriverInfo {
    /// "13.0" for 13000.
    pub fn version_string(&self) -> String {
        version_string(self.version)
    }
}

fn version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

const CUDA_SUCCESS: c_int = 0;
const CUDA_ERROR_NO_DEVICE: c_int = 100;

type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
type CuIntOut = unsafe extern "C" fn(*mut c_int) -> c_int;
type CuErrorString = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;

/// The driver, probed once per process. The library handle is kept for the life of the process
/// (a loaded driver is never unloaded).
pub fn probe() -> Result<DriverInfo> {
    static PROBE: OnceLock<std::result::Result<DriverInfo, String>> = OnceLock::new();
    PROBE.get_or_init(probe_uncached).clone().map_err(Error::CudaUnavailable)
}

fn probe_uncached() -> std::result::Result<DriverInfo, String> {
    static LIB: OnceLock<libloading::Library> = OnceLock::new();
    // SAFETY: loading the NVIDIA driver runs its initialisers, which have no preconditions; the
    // handle is stored in a static and never unloaded.
    let lib = match unsafe { libloading::Library::new(DRIVER_LIB) } {
        Ok(l) => LIB.get_or_init(|| l),
        Err(e) => {
            // the loader's message adds nothing to "not found"; anything else (a wrong ELF class,
            // an unresolved symbol) is worth showing
            let detail = dl_error(&e);
            let detail = if detail.contains("No such file") { String::new() } else { format!(": {detail}") };
            return Err(format!("{DRIVER_LIB} not found (no NVIDIA driver on this machine){detail}"));
        }
    };
    // SAFETY: these are the driver API's C signatures (cuda.h, stable since CUDA 2.x); the
    // symbols live as long as `lib`, which is 'static.
    let (init, version, count, err_str) = unsafe {
        let sym = |name: &str| format!("{DRIVER_LIB} has no {name}: not an NVIDIA CUDA driver library");
        (
            *lib.get::<CuInit>("cuInit").map_err(|_| sym("cuInit"))?,
            *lib.get::<CuIntOut>("cuDriverGetVersion").map_err(|_| sym("cuDriverGetVersion"))?,
            *lib.get::<CuIntOut>("cuDeviceGetCount").map_err(|_| sym("cuDeviceGetCount"))?,
            lib.get::<CuErrorString>("cuGetErrorString").ok().map(|s| *s),
        )
    };
    let describe = |code: c_int| -> String {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorString writes a pointer to a static string (or leaves it null).
        match err_str {
            Some(f) if unsafe { f(code, &mut p) } == CUDA_SUCCESS && !p.is_null() => {
                // SAFETY: p points to a NUL-terminated static string owned by the driver.
                format!("error {code}: {}", unsafe { CStr::from_ptr(p) }.to_string_lossy())
            }
            _ => format!("error {code}"),
        }
    };
    let mut v: c_int = 0;
    // SAFETY: cuDriverGetVersion may be called before cuInit; it writes one int.
    let rc = unsafe { version(&mut v) };
    if rc != CUDA_SUCCESS {
        return Err(format!("cuDriverGetVersion failed ({})", describe(rc)));
    }
    if v < MIN_DRIVER_VERSION {
        return Err(format!(
            "the NVIDIA driver supports CUDA {}, but ortrain's CUDA backend needs a driver for CUDA {} or newer (update the driver)",
            version_string(v),
            version_string(MIN_DRIVER_VERSION)
        ));
    }
    // SAFETY: cuInit(0) is the documented first call; idempotent and thread-safe (PyTorch may
    // have called it already).
    let rc = unsafe { init(0) };
    if rc == CUDA_ERROR_NO_DEVICE {
        return Err(no_device_message());
    }
    if rc != CUDA_SUCCESS {
        return Err(format!("cuInit failed ({})", describe(rc)));
    }
    let mut n: c_int = 0;
    // SAFETY: after a successful cuInit; writes one int.
    let rc = unsafe { count(&mut n) };
    if rc != CUDA_SUCCESS {
        return Err(format!("cuDeviceGetCount failed ({})", describe(rc)));
    }
    if n == 0 {
        return Err(no_device_message());
    }
    Ok(DriverInfo { version: v, devices: n })
}

/// The loader's own message (libloading's Display says only "dlopen failed").
pub(super) fn dl_error(e: &libloading::Error) -> String {
    std::error::Error::source(e).map_or_else(|| e.to_string(), |s| s.to_string())
}

fn no_device_message() -> String {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) => format!("the NVIDIA driver is installed but sees no GPU (CUDA_VISIBLE_DEVICES={v:?})"),
        Err(_) => "the NVIDIA driver is installed but sees no GPU".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_print_as_major_minor() {
        assert_eq!(version_string(13000), "13.0");
        assert_eq!(version_string(12040), "12.4");
    }

    /// On any machine: the probe answers without panicking; where there is no driver (CI, the
    /// development machines) the error names the library.
    #[test]
    fn probe_never_panics_and_names_the_library() {
        match probe() {
            Ok(info) => assert!(info.devices > 0 && info.version >= MIN_DRIVER_VERSION),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.starts_with("CUDA is not available: "), "{msg}");
                // SAFETY: as in probe_uncached: loading the driver has no preconditions.
                if unsafe { libloading::Library::new(DRIVER_LIB) }.is_err() {
                    assert!(msg.contains(DRIVER_LIB) && msg.contains("no NVIDIA driver"), "{msg}");
                }
            }
        }
    }
}
