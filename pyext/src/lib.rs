//! ortrain-py: the thin pyo3 binding of the ortrain engine. Conversions only; all user-facing
//! behaviour lives in the Python package (`pyext/python/ortrain`).

mod ops;
mod optim;
mod session;
mod tracking;

use pyo3::prelude::*;

/// (usable, reason): whether the engine can train on CUDA here, and what was found or why not.
/// Never raises: a missing driver or a build without the CUDA backend is an answer, not an error.
#[pyfunction]
fn cuda_status() -> (bool, String) {
    match ortrain_engine::backend::cuda_status() {
        Ok(found) => (true, found),
        Err(ortrain_engine::Error::CudaUnavailable(why)) => (false, why),
        Err(e) => (false, e.to_string()),
    }
}

#[pymodule]
fn _ortrain(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ENGINE_VERSION", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(cuda_status, m)?)?;
    session::register(m)?;
    optim::register(m)?;
    ops::register(m)?;
    tracking::register(m)?;
    Ok(())
}
