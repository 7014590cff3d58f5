//! The CUDA backend (cargo feature `cuda`), built on cudarc with every CUDA library loaded at
//! run time, so the same build imports and runs on machines without CUDA.
//!
//! Status: compiled, not run. What exists is the foundation, checked without a GPU: the driver
//! probe ([`driver`]), NVRTC loading and compilation to CUBIN ([`nvrtc`]), the on-disk CUBIN
//! cache ([`cache`], [`compile`]), the kernel registry ([`registry`], the kernel sources in
//! kernels/*.cu at the repository root), a CUBIN symbol reader ([`elf`]) and the module loader
//! ([`loader`], which needs a GPU). CI compiles every
//! kernel file for sm_90 and checks every kernel name. No kernel has run on a GPU yet, and there
//! is no CUDA executor: doc/GPU-RUNS.md records what is compiled but not run and what to run
//! first on a GPU.
//!
//! Rules for what comes next (shared with PyTorch in one process): use the device's primary
//! context (`cuDevicePrimaryCtxRetain`, what cudarc's `CudaContext::new` does) and PyTorch's
//! current stream, never a context or default stream of our own; cuBLAS/cuBLASLt for matmuls
//! with TF32 off unless asked for.

pub mod abi;
pub mod blas;
pub mod cache;
pub mod compile;
pub mod driver;
pub mod elf;
pub mod launch;
pub mod loader;
pub mod nvrtc;
pub mod philox;
pub mod ops;
pub mod registry;
pub mod runtime;

#[cfg(test)]
mod tests;

pub use driver::{probe, DriverInfo};
