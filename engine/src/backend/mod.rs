//! Backends run planned graphs. A backend supplies storage for the arena and a kernel per op
//! type; a missing kernel is a plan-time error listing every unsupported op.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

/// What a CUDA request answers in a build without the engine's `cuda` feature.
#[cfg(not(feature = "cuda"))]
fn no_cuda_backend() -> crate::Error {
    crate::Error::CudaUnavailable("this build of ortrain has no CUDA backend (built without the engine's `cuda` feature)".into())
}

/// The kernel cache's folder and, per kernel file, (file, compiled now, milliseconds).
pub type WarmedCache = (std::path::PathBuf, Vec<(String, bool, f64)>);

/// Fills the CUDA kernels' disk cache (the engine's: ORTRAIN_CACHE_DIR, XDG_CACHE_HOME or
/// ~/.cache, then ortrain/cuda) with every kernel family compiled for `arch` ("sm_90"), no GPU
/// needed: (the cache folder, per family its file, whether it was compiled now rather than found
/// there, the compile's milliseconds). `dirs`: extra folders holding NVRTC.
pub fn cuda_warm_kernels(arch: &str, dirs: &[std::path::PathBuf]) -> crate::Result<WarmedCache> {
    #[cfg(feature = "cuda")]
    {
        let dir = cuda::cache::default_dir()
            .ok_or_else(|| crate::Error::Other("no kernel cache folder: set ORTRAIN_CACHE_DIR (HOME is not set either)".into()))?;
        let nv = cuda::nvrtc::load(dirs)?;
        let warmed = cuda::warm::warm(nv, arch, &dir)?;
        Ok((dir, warmed.into_iter().map(|w| (w.file, w.compiled, w.millis)).collect()))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (arch, dirs);
        Err(no_cuda_backend())
    }
}

/// The narrow interface the executor needs from a device.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    /// Op types for which this backend has no kernel, among `op_types`.
    fn missing_kernels<'a>(&self, op_types: &[&'a str]) -> Vec<&'a str>;
}

/// Can the engine train on CUDA GPU `device` here? `Ok` says what was found (driver, GPU,
/// architecture); `Err` says why not ([`crate::Error::CudaUnavailable`] for a missing driver,
/// GPU, NVRTC or cuBLAS). Loads the kernels on that GPU the first time (compiled by NVRTC, or
/// read from the disk cache). `dirs`: extra folders holding NVRTC and cuBLAS
/// (`site-packages/nvidia/cu13/lib`). Never panics, whatever the machine.
pub fn cuda_status(device: usize, dirs: &[std::path::PathBuf]) -> crate::Result<String> {
    #[cfg(feature = "cuda")]
    {
        let info = cuda::probe()?;
        let rt = cuda::runtime::runtime(device, dirs)?;
        let name = rt.loaded.ctx.name().unwrap_or_else(|_| format!("GPU {device}"));
        Ok(format!("CUDA {} driver, {name} ({}, {} SMs)", info.version_string(), rt.loaded.arch, rt.sms))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, dirs);
        Err(no_cuda_backend())
    }
}
