//! Backends run planned graphs. A backend supplies storage for the arena and a kernel per op
//! type; a missing kernel is a plan-time error listing every unsupported op.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

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
        Err(crate::Error::CudaUnavailable("this build of ortrain has no CUDA backend (built without the engine's `cuda` feature)".into()))
    }
}
