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

/// Can the engine train on CUDA here? `Ok` carries what was found; `Err` says why not
/// ([`crate::Error::CudaUnavailable`]). Never panics, whatever the machine. Today the answer
/// is always `Err`: on a machine with a usable driver it says that the CUDA executor does not
/// exist yet (the kernels are compiled, not run: doc/GPU-RUNS.md).
pub fn cuda_status() -> crate::Result<String> {
    #[cfg(feature = "cuda")]
    {
        let info = cuda::probe()?;
        Err(crate::Error::CudaUnavailable(format!(
            "the NVIDIA driver is usable (CUDA {}, {} device(s)), but ortrain has no CUDA executor yet (its kernels are compiled, not run)",
            info.version_string(),
            info.devices
        )))
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(crate::Error::CudaUnavailable("this build of ortrain has no CUDA backend (built without the engine's `cuda` feature)".into()))
    }
}
