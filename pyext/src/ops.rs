//! The op table for tools and tests: every registered op with what the engine has for it, and
//! the CPU's bf16 matmul instruction set.

use ortrain_engine::backend::cpu;
use ortrain_engine::ops;
use pyo3::prelude::*;

use crate::session::to_py;

/// [(op_type, has_gradient, has_cpu_kernel, is_internal, has_cuda_kernel)] for every registered
/// op, sorted.
#[pyfunction]
fn op_table() -> Vec<(String, bool, bool, bool, bool)> {
    let mut table: Vec<_> = ops::all_op_types()
        .into_iter()
        .map(|(op, internal)| {
            let grad = ops::lookup(op).is_some_and(|d| d.gradient().is_some());
            (op.to_string(), grad, cpu::kernel(op).is_some(), internal, cuda_kernel(op))
        })
        .collect();
    // ops the importer rewrites into registered ones (onnx/variadic.rs, onnx/pad.rs): what those have
    let pad: &[(&str, &[&str])] = &[("Pad", ortrain_engine::onnx::pad::PARTS)];
    for (op, parts) in ortrain_engine::onnx::variadic::REWRITTEN.iter().chain(pad) {
        let all = |f: &dyn Fn(&str) -> bool| parts.iter().all(|p| f(p));
        let grad = all(&|p| ops::lookup(p).is_some_and(|d| d.gradient().is_some()));
        table.push((op.to_string(), grad, all(&|p| cpu::kernel(p).is_some()), false, all(&cuda_kernel)));
    }
    table.sort();
    table
}

/// Whether the CUDA backend has a dispatcher for `op` (false in a build without it).
fn cuda_kernel(op: &str) -> bool {
    #[cfg(feature = "cuda")]
    {
        ortrain_engine::backend::cuda::ops::kernel(op).is_some()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = op;
        false
    }
}

/// Sizes the engine's thread pool (once per process, before the first kernel runs): the caller
/// passes torch's thread count so that the two pools do not oversubscribe the cores; workers
/// are pinned as ORTRAIN_PIN_THREADS says (engine `threads`). Returns the pool's size
/// (unchanged if it was already built, or if RAYON_NUM_THREADS is set).
#[pyfunction]
fn init_threads(n: usize) -> PyResult<usize> {
    ortrain_engine::threads::init_global_pool(n).map_err(to_py)
}

/// The cores the engine's workers are pinned to, one per worker (empty: they float).
#[pyfunction]
fn pinned_cores() -> Vec<usize> {
    ortrain_engine::threads::pinned_cores()
}

/// The instruction set bf16 matmuls use on this CPU ("amx", "avx512_bf16"), or None: then
/// `matmul_precision="bf16"` runs fp32.
#[pyfunction]
fn cpu_bf16() -> Option<&'static str> {
    cpu::bf16::detect().map(|isa| isa.name())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(op_table, m)?)?;
    m.add_function(wrap_pyfunction!(init_threads, m)?)?;
    m.add_function(wrap_pyfunction!(pinned_cores, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_bf16, m)?)
}
