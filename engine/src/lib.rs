//! ortrain-engine: the compiler and runtime of ortrain. Imports an ONNX model into an IR with
//! symbolic dimensions, builds the gradient graph from per-op rules, plans execution order and
//! memory for concrete shapes, and runs forward, backward and optimizer steps on a backend.
//! No Python here: the pyo3 binding lives in the `ortrain-py` crate.

pub mod autodiff;
pub mod backend;
pub mod error;
pub mod exec;
pub mod ir;
pub mod onnx;
pub mod ops;
pub mod optim;
pub mod passes;
pub mod plan;
pub mod session;
pub mod simd;
pub mod tensor;
pub mod threads;

pub use error::{Error, Result};
pub use tensor::{DType, Tensor};
