//! The CUDA backend (cargo feature `cuda`), built on cudarc with every CUDA library loaded at
//! run time, so the same build imports and runs on machines without CUDA.
//!
//! What it has: the driver probe ([`driver`]), NVRTC loading and compilation to CUBIN
//! ([`nvrtc`]), the on-disk CUBIN cache ([`cache`], [`compile`]), the kernel registry
//! ([`registry`], the kernel sources in kernels/*.cu at the repository root), a CUBIN symbol
//! reader ([`elf`]) and what each kernel takes from an SM ([`resources`]: registers, spills), the module loader ([`loader`]), checked launches ([`launch`]), cuBLAS
//! ([`blas`]; mixed-precision f32 gemms as 16-bit ones, [`half_gemm`]), the per-process GPU runtime ([`runtime`]), the kernel table of the executor
//! ([`ops`]; the executor itself is `crate::exec::cuda`), CUDA graphs of recorded step phases
//! ([`graph`]) and the fused optimizer update for the Python optimizer bridge ([`optim`]). CI compiles every kernel file for sm_90
//! and checks every kernel name and parameter layout; the GPU tests (`tests`, unit tests of the
//! crate) ran on an H100: doc/GPU-RUNS.md records what ran and what has not.
//!
//! Rules (shared with PyTorch in one process): use the device's primary
//! context (`cuDevicePrimaryCtxRetain`, what cudarc's `CudaContext::new` does) and PyTorch's
//! current stream, never a context or default stream of our own; cuBLAS/cuBLASLt for matmuls
//! with TF32 off unless asked for.

pub mod abi;
pub mod blas;
pub mod blas_lt;
pub mod cache;
pub mod claim;
pub mod compile;
pub mod driver;
pub mod elf;
pub mod graph;
pub mod half_gemm;
pub mod launch;
pub mod loader;
pub mod nvrtc;
pub mod ops;
pub mod optim;
pub mod philox;
pub mod registry;
pub mod resources;
pub mod runtime;
pub mod warm;

#[cfg(test)]
mod tests;

pub use driver::{probe, DriverInfo};
