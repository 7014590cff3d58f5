//! ortrain-py: the thin pyo3 binding of the ortrain engine. Conversions only; all user-facing
//! behaviour lives in the Python package (`pyext/python/ortrain`).

use pyo3::prelude::*;

mod tracking;

#[pymodule]
fn _ortrain(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ENGINE_VERSION", env!("CARGO_PKG_VERSION"))?;
    tracking::register(m)?;
    Ok(())
}
