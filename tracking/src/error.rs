//! Errors of the tracking client. Every error is a value; none carries a credential.

use std::path::PathBuf;

/// What can go wrong talking to MLflow. Messages name the key, endpoint or file involved and
/// never contain the access token.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A metric, param or tag key MLflow would reject.
    #[error("invalid {kind} key {key:?}: {reason}")]
    InvalidKey { kind: &'static str, key: String, reason: String },
    /// The server could not be reached (refused, reset, timed out, DNS).
    #[error("cannot reach MLflow at {endpoint}: {message}")]
    Connection { endpoint: String, message: String },
    /// The server answered with an HTTP error.
    #[error("MLflow {endpoint} returned HTTP {status} {code}: {message}")]
    Server { endpoint: String, status: u16, code: String, message: String },
    /// Cloud storage behind a signed URL (S3, Azure, GCS) answered with an HTTP error. `url` has
    /// its query string (the signature) replaced by `<redacted>`; `message` is scrubbed of it too.
    #[error("artifact storage ({kind}) {url} returned HTTP {status} {code}: {message}")]
    Storage { kind: String, url: String, status: u16, code: String, message: String },
    /// The server answered with a body we could not decode.
    #[error("cannot decode the answer of MLflow {endpoint}: {message}")]
    Decode { endpoint: String, message: String },
    /// A tracking URI or Databricks configuration problem.
    #[error("tracking configuration: {0}")]
    Config(String),
    /// A local file (artifact, spill file) could not be read or written.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// The background logger thread is gone.
    #[error("the background MLflow logger has stopped")]
    LoggerStopped,
}

impl Error {
    /// Whether a retry may succeed: connection failures, 5xx and 429 (and 408 from storage).
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Connection { .. } => true,
            Error::Server { status, .. } => *status >= 500 || *status == 429,
            Error::Storage { status, .. } => *status >= 500 || *status == 429 || *status == 408,
            _ => false,
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}

pub type Result<T> = std::result::Result<T, Error>;
