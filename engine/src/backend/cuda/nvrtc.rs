//! NVRTC: finding the library and compiling a kernel file to a CUBIN for one GPU architecture.
//!
//! cudarc opens NVRTC by name (`libnvrtc.so.13` among others) and panics when it finds none.
//! The library often is not on the loader's path: PyTorch's CUDA wheels (and the pinned
//! `nvidia-cuda-nvrtc` wheel CI uses) put it in `site-packages/nvidia/cu13/lib/`. So [`load`]
//! opens it itself, by absolute path when needed, together with `libnvrtc-builtins.so.13.*`
//! from the same folder (NVRTC opens that one by name and fails without it). A library opened
//! by path is then found by cudarc's by-name `dlopen`, because the dynamic loader matches a
//! requested name against the SONAME of libraries already loaded. The NVRTC version cudarc
//! reaches is checked against the one probed here.
//!
//! Where NVRTC is looked for, in order: the file (or folder) in `ORTRAIN_NVRTC_LIB`; the
//! loader's own search (`LD_LIBRARY_PATH`, the system, a copy already loaded); the folders the
//! caller passes (the Python package passes `site-packages/nvidia/cu13/lib`); `$CUDA_HOME/lib64`,
//! `$CUDA_PATH/lib64`, `/usr/local/cuda/lib64`.

use std::ffi::{c_char, c_int, CString};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use cudarc::nvrtc::sys;

use super::driver::dl_error;
use crate::error::{Error, Result};

/// The NVRTC major version the backend is built for (cudarc feature `cuda-13000`).
pub const NVRTC_MAJOR: i32 = 13;

#[cfg(not(windows))]
pub const NVRTC_LIB: &str = "libnvrtc.so.13";
#[cfg(windows)]
pub const NVRTC_LIB: &str = "nvrtc64_130_0.dll";

/// A loaded NVRTC: where it came from and its version.
#[derive(Debug)]
pub struct Nvrtc {
    /// The file it was opened from, or `None` when the loader found it by name.
    pub path: Option<PathBuf>,
    pub version: (i32, i32),
    _libs: Vec<libloading::Library>,
}

impl Nvrtc {
    /// "13.0".
    pub fn version_string(&self) -> String {
        format!("{}.{}", self.version.0, self.version.1)
    }
}

type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;

pub(super) fn env_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(v) = std::env::var_os(var) {
            dirs.push(PathBuf::from(v).join("lib64"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    dirs
}

/// `libnvrtc-builtins.so.13.*` next to `lib` (the `.alt` variant is skipped).
fn builtins_next_to(lib: &Path) -> Option<PathBuf> {
    let dir = lib.parent()?;
    let prefix = format!("libnvrtc-builtins.so.{NVRTC_MAJOR}.");
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&prefix) && !n.contains(".alt.")))
        .collect();
    found.sort();
    found.pop()
}

/// Opens NVRTC from `path` (a file), with its builtins library first.
fn open_path(path: &Path) -> std::result::Result<Vec<libloading::Library>, String> {
    let mut libs = Vec::new();
    if let Some(b) = builtins_next_to(path) {
        let s = b.to_str().ok_or_else(|| format!("{} is not a UTF-8 path", b.display()))?;
        // SAFETY: NVRTC's builtins library has no initialisers with preconditions.
        libs.push(unsafe { libloading::Library::new(s) }.map_err(|e| dl_error(&e))?);
    }
    let s = path.to_str().ok_or_else(|| format!("{} is not a UTF-8 path", path.display()))?;
    // SAFETY: as above, for NVRTC itself.
    libs.push(unsafe { libloading::Library::new(s) }.map_err(|e| dl_error(&e))?);
    Ok(libs)
}

fn version_of(lib: &libloading::Library) -> std::result::Result<(i32, i32), String> {
    // SAFETY: nvrtcVersion(int*, int*) is NVRTC's C signature; it writes two ints.
    unsafe {
        let f = *lib.get::<VersionFn>("nvrtcVersion").map_err(|e| format!("no nvrtcVersion: {e}"))?;
        let (mut a, mut b) = (0, 0);
        if f(&mut a, &mut b) != 0 {
            return Err("nvrtcVersion failed".into());
        }
        Ok((a, b))
    }
}

/// Finds and opens NVRTC once per process (see the module docs for where it looks); `dirs` are
/// extra folders to search. A failure is not remembered: a later call with other folders may
/// succeed.
pub fn load(dirs: &[PathBuf]) -> Result<&'static Nvrtc> {
    static LOADED: Mutex<Option<&'static Nvrtc>> = Mutex::new(None);
    let mut slot = LOADED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(n) = *slot {
        return Ok(n);
    }
    let mut tried = Vec::new();
    let mut candidates: Vec<Option<PathBuf>> = Vec::new();
    if let Some(v) = std::env::var_os("ORTRAIN_NVRTC_LIB") {
        let p = PathBuf::from(v);
        candidates.push(Some(if p.is_dir() { p.join(NVRTC_LIB) } else { p }));
    } else {
        candidates.push(None);
        candidates.extend(dirs.iter().chain(env_dirs().iter()).map(|d| Some(d.join(NVRTC_LIB))));
    }
    for c in candidates {
        let opened = match &c {
            None => {
                // SAFETY: as in open_path.
                unsafe { libloading::Library::new(NVRTC_LIB) }.map(|l| vec![l]).map_err(|e| dl_error(&e))
            }
            Some(p) if !p.is_file() => Err("no such file".to_string()),
            Some(p) => open_path(p),
        };
        let where_ = c.as_ref().map_or_else(|| format!("{NVRTC_LIB} by name"), |p| p.display().to_string());
        let libs = match opened {
            Ok(l) => l,
            Err(e) => {
                tried.push(format!("{where_} ({e})"));
                continue;
            }
        };
        let version = version_of(libs.last().expect("nvrtc itself")).map_err(|e| Error::Cuda(format!("{where_}: {e}")))?;
        if version.0 != NVRTC_MAJOR {
            tried.push(format!("{where_} (NVRTC {}.{}, need {NVRTC_MAJOR}.x)", version.0, version.1));
            continue;
        }
        check_cudarc_sees(version)?;
        let n: &'static Nvrtc = Box::leak(Box::new(Nvrtc { path: c, version, _libs: libs }));
        *slot = Some(n);
        return Ok(n);
    }
    Err(Error::CudaUnavailable(format!(
        "NVRTC {NVRTC_MAJOR}.x (the CUDA runtime compiler, {NVRTC_LIB}) not found; install the nvidia-cuda-nvrtc wheel \
         (PyTorch's CUDA 13 wheels bring it) or set ORTRAIN_NVRTC_LIB; tried: {}",
        tried.join("; ")
    )))
}

/// cudarc opens NVRTC by name on its first call (and panics if it finds none): make that
/// call here, behind `catch_unwind` as a last resort, and check it reached the same version.
fn check_cudarc_sees(want: (i32, i32)) -> Result<()> {
    let got = std::panic::catch_unwind(|| {
        let (mut a, mut b) = (0, 0);
        // SAFETY: nvrtcVersion writes two ints; the library is loaded (see `load`).
        let rc = unsafe { sys::nvrtcVersion(&mut a, &mut b) };
        (rc, a, b)
    })
    .map_err(|_| Error::Cuda(format!("cudarc could not open NVRTC by name although {NVRTC_LIB} is loaded")))?;
    if got.0 != sys::nvrtcResult::NVRTC_SUCCESS || (got.1, got.2) != want {
        return Err(Error::Cuda(format!(
            "cudarc reached NVRTC {}.{}, not the {}.{} found by ortrain: another libnvrtc comes first on the library path",
            got.1, got.2, want.0, want.1
        )));
    }
    Ok(())
}

/// A CUBIN and NVRTC's log (warnings; empty when clean).
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub log: String,
}

/// Destroys an NVRTC program when dropped.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: self.0 was created by nvrtcCreateProgram and is destroyed exactly once.
        unsafe {
            sys::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::Cuda(format!("{what} contains a NUL byte")))
}

fn log_of(prog: &Program) -> String {
    let mut size = 0usize;
    // SAFETY: prog is a live program; the log size query writes one usize.
    if unsafe { sys::nvrtcGetProgramLogSize(prog.0, &mut size) } != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
        return String::new();
    }
    let mut buf = vec![0u8; size];
    // SAFETY: buf holds `size` bytes, the size NVRTC reported for the log (NUL included).
    if unsafe { sys::nvrtcGetProgramLog(prog.0, buf.as_mut_ptr() as *mut c_char) } != sys::nvrtcResult::NVRTC_SUCCESS {
        return String::new();
    }
    String::from_utf8_lossy(&buf).trim_end_matches('\0').trim_end().to_string()
}

/// The options every kernel file is compiled with, besides the architecture.
pub const BASE_OPTIONS: &[&str] = &["--std=c++17", "--fmad=true"];

/// Compiles `source` (named `file` in messages) to a CUBIN for `arch` ("sm_90"). `headers` are
/// (include name, text) pairs served from memory: no CUDA include folder is needed.
pub fn compile_cubin(nv: &Nvrtc, file: &str, source: &str, headers: &[(&str, &str)], arch: &str) -> Result<Compiled> {
    compile_cubin_with(nv, file, source, headers, arch, &[])
}

/// [`compile_cubin`] with `extra` options after [`BASE_OPTIONS`] (tests: `--ptxas-options=-v`
/// puts ptxas's resource report in the log).
pub fn compile_cubin_with(_nv: &Nvrtc, file: &str, source: &str, headers: &[(&str, &str)], arch: &str, extra: &[&str]) -> Result<Compiled> {
    let fail = |msg: String, log: String| Error::KernelCompile { file: file.into(), arch: arch.into(), msg, log };
    let src = cstring(file, source)?;
    let name = cstring("file name", file)?;
    let hdr_text: Vec<CString> = headers.iter().map(|(n, t)| cstring(n, t)).collect::<Result<_>>()?;
    let hdr_name: Vec<CString> = headers.iter().map(|(n, _)| cstring("header name", n)).collect::<Result<_>>()?;
    let hdr_text_p: Vec<*const c_char> = hdr_text.iter().map(|c| c.as_ptr()).collect();
    let hdr_name_p: Vec<*const c_char> = hdr_name.iter().map(|c| c.as_ptr()).collect();
    let mut raw: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is a NUL-terminated string alive until the program is destroyed
    // (all are dropped after `prog` below); the header arrays have `headers.len()` entries.
    let rc = unsafe {
        sys::nvrtcCreateProgram(&mut raw, src.as_ptr(), name.as_ptr(), headers.len() as c_int, hdr_text_p.as_ptr(), hdr_name_p.as_ptr())
    };
    if rc != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(fail(format!("nvrtcCreateProgram: {rc:?}"), String::new()));
    }
    let prog = Program(raw);
    let mut opts: Vec<CString> = vec![cstring("option", &format!("--gpu-architecture={arch}"))?];
    for o in BASE_OPTIONS.iter().chain(extra) {
        opts.push(cstring("option", o)?);
    }
    let opt_p: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
    // SAFETY: prog is live; opt_p holds opts.len() NUL-terminated strings alive for the call.
    let rc = unsafe { sys::nvrtcCompileProgram(prog.0, opt_p.len() as c_int, opt_p.as_ptr()) };
    let log = log_of(&prog);
    if rc != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(fail(format!("{rc:?}"), log));
    }
    let mut size = 0usize;
    // SAFETY: prog compiled successfully; the size query writes one usize.
    let rc = unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) };
    if rc != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
        return Err(fail(format!("no CUBIN ({rc:?}, {size} bytes): is {arch} a real architecture (sm_XX, not compute_XX)?"), log));
    }
    let mut cubin = vec![0u8; size];
    // SAFETY: cubin holds exactly the `size` bytes NVRTC reported.
    let rc = unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut c_char) };
    if rc != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(fail(format!("nvrtcGetCUBIN: {rc:?}"), log));
    }
    drop(prog);
    drop((src, name, hdr_text, hdr_name));
    Ok(Compiled { cubin, log })
}
