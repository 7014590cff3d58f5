//! ortrain-tracking: a small typed MLflow REST client and a batched background logger.
//!
//! Owns everything ortrain knows about MLflow and nothing about tensors: tracking-URI resolution
//! (`http(s)://`, `databricks` with a Bearer token that never prints), experiments, runs,
//! log-batch split at MLflow's limits, params, tags, metric histories, artifacts (proxied
//! `mlflow-artifacts` uploads, local copies, Databricks signed-URL uploads for managed runs and
//! the DBFS REST API for other `dbfs:/` locations), and a logger thread that never blocks training,
//! retries with backoff and spills to JSONL when the server stays down ([`replay`] re-sends).

pub mod artifacts;
pub mod client;
pub mod databricks_artifacts;
pub mod dbfs;
pub mod error;
pub mod logger;
pub mod retry;
pub mod signed_url;
pub mod target;
pub mod types;
pub mod validate;

pub use artifacts::ArtifactStore;
pub use client::{plan_batches, Client};
pub use databricks_artifacts::{CredentialType, WriteCredential};
pub use error::{Error, Result};
pub use logger::{replay, BackgroundLogger, LoggerOptions, LoggerStats, ReplayStats, SpillRecord};
pub use retry::RetryPolicy;
pub use signed_url::SignedUrl;
pub use target::{Secret, Target};
pub use types::{now_ms, Experiment, FileInfo, Metric, MetricValue, Param, Run, RunInfo, RunStatus, Tag};
pub use validate::validate_key;
