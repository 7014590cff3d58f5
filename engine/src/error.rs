//! The engine's error type. Every message names the thing at fault: the op type and node, the
//! file and field, the input and its expected shape.

use std::fmt;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid ONNX model: {field}: {msg}")]
    Onnx { field: String, msg: String },
    #[error("unsupported op {op_type} (node '{node}'): {msg}")]
    Unsupported { op_type: String, node: String, msg: String },
    #[error("unsupported op type(s) {op_types}: {nodes} (see doc/SUPPORTED-OPS.md)")]
    UnknownOps { op_types: String, nodes: String },
    #[error("no gradient rule for op {op_type} (node '{node}'), which lies on the path from the parameters to the loss")]
    NoGradient { op_type: String, node: String },
    #[error("{op_type} node '{node}': {msg}")]
    Node { op_type: String, node: String, msg: String },
    #[error("input '{name}': {msg}")]
    Input { name: String, msg: String },
    #[error("no CPU kernel for: {0}")]
    MissingKernels(MissingList),
    /// No usable CUDA here (no driver, no device, driver too old, NVRTC missing, or a build
    /// without the `cuda` feature); the text says which and what to do.
    #[error("CUDA is not available: {0}")]
    CudaUnavailable(String),
    /// NVRTC rejected a kernel file; `log` is NVRTC's program log (the compiler's messages).
    #[error("NVRTC could not compile {file} for {arch}: {msg}{}", log_suffix(log))]
    KernelCompile { file: String, arch: String, msg: String, log: String },
    /// A CUDA driver, NVRTC or kernel-cache operation failed.
    #[error("CUDA: {0}")]
    Cuda(String),
    #[error("{0}")]
    Other(String),
}

/// A list of `op_type (node)` items, printed comma-separated.
#[derive(Debug)]
pub struct MissingList(pub Vec<String>);

impl fmt::Display for MissingList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join(", "))
    }
}

fn log_suffix(log: &str) -> String {
    if log.trim().is_empty() {
        String::new()
    } else {
        format!("\n--- NVRTC log ---\n{}", log.trim_end())
    }
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn onnx(field: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Onnx { field: field.into(), msg: msg.into() }
    }
    pub fn other(msg: impl Into<String>) -> Self {
        Error::Other(msg.into())
    }
}
