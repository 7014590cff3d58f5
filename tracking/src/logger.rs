//! The background logger: the training loop hands metrics to a channel and returns at once; a
//! thread batches them, flushes every `flush_interval` (and on flush/close), retries connection
//! errors and 5xx with exponential backoff, and when retries are exhausted appends the batch to a
//! JSONL spill file, which [`replay`] re-sends later. Nothing is dropped.

use crate::client::Client;
use crate::error::{Error, Result};
use crate::types::{now_ms, Metric, MetricValue, Param, RunStatus, Tag};
use crate::validate::validate_key;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How the background logger batches, retries and spills.
#[derive(Debug, Clone)]
pub struct LoggerOptions {
    /// Send what is pending at least this often.
    pub flush_interval: Duration,
    /// Retries after the first failed attempt of a request.
    pub max_retries: u32,
    /// First backoff; doubled after each retry.
    pub initial_backoff: Duration,
    /// Where unsendable batches go (JSONL). Default: `./ortrain-mlflow-spill-<run_id>.jsonl`.
    pub spill_path: Option<PathBuf>,
}

impl Default for LoggerOptions {
    fn default() -> Self {
        LoggerOptions {
            flush_interval: Duration::from_millis(1000),
            max_retries: 4,
            initial_backoff: Duration::from_millis(200),
            spill_path: None,
        }
    }
}

/// One line of a spill file: a log-batch that could not be delivered.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SpillRecord {
    pub run_id: String,
    #[serde(default)]
    pub metrics: Vec<Metric>,
    #[serde(default)]
    pub params: Vec<Param>,
    #[serde(default)]
    pub tags: Vec<Tag>,
    /// A terminal status to set after the batch (the run's end could not be recorded either).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<RunStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_time: Option<i64>,
}

/// Counters of what the logger did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoggerStats {
    /// Metrics the server accepted.
    pub metrics_sent: u64,
    /// Metrics written to the spill file.
    pub metrics_spilled: u64,
    /// log-batch requests that succeeded.
    pub requests: u64,
    /// Retries of failed requests.
    pub retries: u64,
    /// The spill file, once something was spilled.
    pub spill_path: Option<PathBuf>,
    /// The last delivery error (never contains the token).
    pub last_error: Option<String>,
}

enum Msg {
    Metric(Metric),
    Param(Param),
    Tag(Tag),
    Flush(Sender<LoggerStats>),
    End(RunStatus, i64, Sender<LoggerStats>),
}

/// A per-run background logger. Dropping it closes it (flushing what is pending).
pub struct BackgroundLogger {
    run_id: String,
    tx: Option<Sender<Msg>>,
    handle: Option<JoinHandle<()>>,
    stats: Arc<Mutex<LoggerStats>>,
}

impl std::fmt::Debug for BackgroundLogger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackgroundLogger").field("run_id", &self.run_id).finish_non_exhaustive()
    }
}

impl BackgroundLogger {
    /// Starts the logger thread for one run.
    pub fn start(client: Client, run_id: &str, options: LoggerOptions) -> Result<Self> {
        let (tx, rx) = mpsc::channel();
        let stats = Arc::new(Mutex::new(LoggerStats::default()));
        let spill_path = options.spill_path.clone().unwrap_or_else(|| PathBuf::from(format!("ortrain-mlflow-spill-{run_id}.jsonl")));
        let worker = Worker { client, run_id: run_id.to_string(), options, spill_path, stats: stats.clone() };
        let handle = std::thread::Builder::new()
            .name("ortrain-mlflow".into())
            .spawn(move || worker.run(rx))
            .map_err(|e| Error::Config(format!("cannot start the MLflow logger thread: {e}")))?;
        Ok(BackgroundLogger { run_id: run_id.to_string(), tx: Some(tx), handle: Some(handle), stats })
    }

    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    fn send(&self, msg: Msg) -> Result<()> {
        self.tx.as_ref().ok_or(Error::LoggerStopped)?.send(msg).map_err(|_| Error::LoggerStopped)
    }

    /// Queues one metric point; never waits on the network. `timestamp_ms` defaults to now.
    pub fn log_metric(&self, key: &str, value: f64, step: i64, timestamp_ms: Option<i64>) -> Result<()> {
        validate_key("metric", key)?;
        let timestamp = timestamp_ms.unwrap_or_else(now_ms);
        self.send(Msg::Metric(Metric { key: key.to_string(), value: MetricValue(value), timestamp, step }))
    }

    pub fn log_param(&self, key: &str, value: &str) -> Result<()> {
        validate_key("param", key)?;
        self.send(Msg::Param(Param { key: key.to_string(), value: value.to_string() }))
    }

    pub fn set_tag(&self, key: &str, value: &str) -> Result<()> {
        validate_key("tag", key)?;
        self.send(Msg::Tag(Tag { key: key.to_string(), value: value.to_string() }))
    }

    /// Sends everything queued so far (with retries / spilling) and returns the counters.
    pub fn flush(&self) -> Result<LoggerStats> {
        let (ack_tx, ack_rx) = mpsc::channel();
        self.send(Msg::Flush(ack_tx))?;
        ack_rx.recv().map_err(|_| Error::LoggerStopped)
    }

    /// Flushes, then ends the run with a terminal status (retried; spilled if the server stays
    /// down, so that replay also closes the run). Returns the counters.
    pub fn end_run(&self, status: RunStatus) -> Result<LoggerStats> {
        let (ack_tx, ack_rx) = mpsc::channel();
        self.send(Msg::End(status, now_ms(), ack_tx))?;
        ack_rx.recv().map_err(|_| Error::LoggerStopped)
    }

    /// The counters so far, without flushing.
    pub fn stats(&self) -> LoggerStats {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Flushes, stops the thread and returns the final counters. Idempotent.
    pub fn close(&mut self) -> Result<LoggerStats> {
        if let Some(tx) = self.tx.take() {
            drop(tx); // the worker drains the channel, flushes and exits
        }
        if let Some(h) = self.handle.take() {
            h.join().map_err(|_| Error::LoggerStopped)?;
        }
        Ok(self.stats())
    }
}

impl Drop for BackgroundLogger {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

struct Worker {
    client: Client,
    run_id: String,
    options: LoggerOptions,
    spill_path: PathBuf,
    stats: Arc<Mutex<LoggerStats>>,
}

#[derive(Default)]
struct Pending {
    metrics: Vec<Metric>,
    params: Vec<Param>,
    tags: Vec<Tag>,
}

impl Worker {
    fn run(self, rx: Receiver<Msg>) {
        let mut pending = Pending::default();
        let mut next_flush = Instant::now() + self.options.flush_interval;
        loop {
            let timeout = next_flush.saturating_duration_since(Instant::now());
            match rx.recv_timeout(timeout) {
                Ok(Msg::Metric(m)) => {
                    pending.metrics.push(m);
                    if pending.metrics.len() >= crate::client::MAX_METRICS_PER_BATCH {
                        self.deliver(&mut pending, None);
                    }
                }
                Ok(Msg::Param(p)) => pending.params.push(p),
                Ok(Msg::Tag(t)) => pending.tags.push(t),
                Ok(Msg::Flush(ack)) => {
                    self.deliver(&mut pending, None);
                    let _ = ack.send(self.snapshot());
                }
                Ok(Msg::End(status, end_time, ack)) => {
                    self.deliver(&mut pending, Some((status, end_time)));
                    let _ = ack.send(self.snapshot());
                }
                Err(RecvTimeoutError::Timeout) => {
                    self.deliver(&mut pending, None);
                    next_flush = Instant::now() + self.options.flush_interval;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    self.deliver(&mut pending, None);
                    return;
                }
            }
        }
    }

    fn snapshot(&self) -> LoggerStats {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    fn with_stats(&self, f: impl FnOnce(&mut LoggerStats)) {
        if let Ok(mut s) = self.stats.lock() {
            f(&mut s);
        }
    }

    /// Sends what is pending (then the run's end, if given); on final failure spills the rest.
    /// Never loses data.
    fn deliver(&self, pending: &mut Pending, end: Option<(RunStatus, i64)>) {
        let batch = std::mem::take(pending);
        let has_batch = !(batch.metrics.is_empty() && batch.params.is_empty() && batch.tags.is_empty());
        if has_batch {
            let sent = self.with_retries(|| self.client.log_batch(&self.run_id, &batch.metrics, &batch.params, &batch.tags));
            match sent {
                Ok(n) => self.with_stats(|s| {
                    s.metrics_sent += batch.metrics.len() as u64;
                    s.requests += n as u64;
                }),
                Err(e) => return self.spill(batch, end, e),
            }
        }
        if let Some((status, end_time)) = end {
            if let Err(e) = self.with_retries(|| self.client.update_run(&self.run_id, status, Some(end_time)).map(|_| 0)) {
                self.spill(Pending::default(), end, e);
            }
        }
    }

    fn with_retries(&self, f: impl Fn() -> Result<usize>) -> Result<usize> {
        let mut backoff = self.options.initial_backoff;
        let mut attempt = 0;
        loop {
            match f() {
                Err(e) if e.is_retryable() && attempt < self.options.max_retries => {
                    attempt += 1;
                    self.with_stats(|s| s.retries += 1);
                    std::thread::sleep(backoff);
                    backoff *= 2;
                }
                other => return other,
            }
        }
    }

    fn spill(&self, batch: Pending, end: Option<(RunStatus, i64)>, e: Error) {
        let record = SpillRecord {
            run_id: self.run_id.clone(),
            metrics: batch.metrics,
            params: batch.params,
            tags: batch.tags,
            status: end.map(|(s, _)| s),
            end_time: end.map(|(_, t)| t),
        };
        let n = record.metrics.len() as u64;
        let spilled = append_spill(&self.spill_path, &record);
        self.with_stats(|s| {
            s.last_error = Some(match &spilled {
                Ok(()) => e.to_string(),
                Err(se) => format!("{e}; and spilling failed too: {se}"),
            });
            if spilled.is_ok() {
                s.metrics_spilled += n;
                s.spill_path = Some(self.spill_path.clone());
            }
        });
    }
}

fn append_spill(path: &Path, record: &SpillRecord) -> Result<()> {
    let line = serde_json::to_string(record).map_err(|e| Error::Config(format!("cannot encode spill record: {e}")))?;
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).map_err(|e| Error::io(path, e))?;
    writeln!(f, "{line}").map_err(|e| Error::io(path, e))
}

/// What [`replay`] sent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayStats {
    pub records: u64,
    pub metrics: u64,
    pub params: u64,
    pub tags: u64,
    /// Runs whose terminal status was set by the replay.
    pub runs_ended: u64,
}

/// Re-sends every batch of a spill file (each line one [`SpillRecord`]). Stops at the first
/// failure, naming the line; a completed replay can rename the file away.
pub fn replay(client: &Client, spill_file: &Path) -> Result<ReplayStats> {
    let f = std::fs::File::open(spill_file).map_err(|e| Error::io(spill_file, e))?;
    let mut stats = ReplayStats::default();
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line.map_err(|e| Error::io(spill_file, e))?;
        if line.trim().is_empty() {
            continue;
        }
        let rec: SpillRecord = serde_json::from_str(&line)
            .map_err(|e| Error::Decode { endpoint: format!("{} line {}", spill_file.display(), i + 1), message: e.to_string() })?;
        client.log_batch(&rec.run_id, &rec.metrics, &rec.params, &rec.tags)?;
        if let Some(status) = rec.status {
            client.update_run(&rec.run_id, status, rec.end_time)?;
            stats.runs_ended += 1;
        }
        stats.records += 1;
        stats.metrics += rec.metrics.len() as u64;
        stats.params += rec.params.len() as u64;
        stats.tags += rec.tags.len() as u64;
    }
    Ok(stats)
}
