//! ortrain-py: the thin pyo3 binding of the ortrain engine. Conversions only; all user-facing
//! behaviour lives in the Python package (`pyext/python/ortrain`).

mod ops;
mod optim;
mod session;
mod tracking;

use pyo3::prelude::*;

#[pymodule]
fn _ortrain(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ENGINE_VERSION", env!("CARGO_PKG_VERSION"))?;
    session::register(m)?;
    optim::register(m)?;
    ops::register(m)?;
    tracking::register(m)?;
    Ok(())
}
