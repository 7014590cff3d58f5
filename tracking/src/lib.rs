//! ortrain-tracking: a small typed MLflow REST client and a batched background logger.
//!
//! Owns everything ortrain knows about MLflow and nothing about tensors: tracking-URI resolution
//! (`http(s)://`, `databricks` with a Bearer token that never prints), experiments, runs,
//! log-batch split at MLflow's limits, params, tags, metric histories, artifacts (proxied
//! `mlflow-artifacts` uploads or local copies), and a logger thread that never blocks training,
//! retries with backoff and spills to JSONL when the server stays down ([`replay`] re-sends).

pub mod artifacts;
pub mod client;
pub mod error;
pub mod logger;
pub mod target;
pub mod types;
pub mod validate;

pub use artifacts::ArtifactStore;
pub use client::{plan_batches, Client};
pub use error::{Error, Result};
pub use logger::{replay, BackgroundLogger, LoggerOptions, LoggerStats, ReplayStats, SpillRecord};
pub use target::{Secret, Target};
pub use types::{now_ms, Experiment, FileInfo, Metric, MetricValue, Param, Run, RunInfo, RunStatus, Tag};
pub use validate::validate_key;
