//! ortrain-py: the thin pyo3 binding of the ortrain engine. Conversions only; all user-facing
//! behaviour lives in the Python package (`pyext/python/ortrain`).

#[cfg(feature = "cuda")]
mod cuda;
mod ops;
mod optim;
mod session;
mod tracking;

use pyo3::prelude::*;

/// (usable, reason): whether the engine can train on CUDA GPU `device` here, and what was found
/// or why not. Loads the kernels on that GPU the first time. `lib_dirs`: folders holding NVRTC
/// and cuBLAS (`site-packages/nvidia/cu13/lib`). Never raises: a missing driver or a build
/// without the CUDA backend is an answer, not an error.
#[pyfunction]
#[pyo3(signature = (lib_dirs=Vec::new(), device=0))]
fn cuda_status(py: Python<'_>, lib_dirs: Vec<String>, device: usize) -> (bool, String) {
    let dirs: Vec<std::path::PathBuf> = lib_dirs.into_iter().map(Into::into).collect();
    match py.detach(move || ortrain_engine::backend::cuda_status(device, &dirs)) {
        Ok(found) => (true, found),
        Err(ortrain_engine::Error::CudaUnavailable(why)) => (false, why),
        Err(e) => (false, e.to_string()),
    }
}

/// Per kernel file: (file, compiled now, milliseconds).
type WarmedFiles = Vec<(String, bool, f64)>;

/// (cache folder, [(kernel file, compiled now, milliseconds)]): every CUDA kernel family
/// compiled by NVRTC for `arch` ("sm_90") into the engine's disk cache, no GPU needed.
/// `lib_dirs`: folders holding NVRTC. Raises with the engine's message (a bad architecture, no
/// NVRTC, a cache that cannot be written).
#[pyfunction]
#[pyo3(signature = (arch, lib_dirs=Vec::new()))]
fn cuda_warm_kernels(py: Python<'_>, arch: String, lib_dirs: Vec<String>) -> PyResult<(String, WarmedFiles)> {
    let dirs: Vec<std::path::PathBuf> = lib_dirs.into_iter().map(Into::into).collect();
    let (dir, warmed) = py.detach(move || ortrain_engine::backend::cuda_warm_kernels(&arch, &dirs)).map_err(session::to_py)?;
    Ok((dir.display().to_string(), warmed))
}

#[pymodule]
fn _ortrain(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ENGINE_VERSION", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(cuda_status, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_warm_kernels, m)?)?;
    session::register(m)?;
    #[cfg(feature = "cuda")]
    cuda::register(m)?;
    optim::register(m)?;
    ops::register(m)?;
    tracking::register(m)?;
    Ok(())
}
