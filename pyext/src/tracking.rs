//! pyo3 bindings of ortrain-tracking (conversions only): `MlflowClient`, `MetricLogger` and
//! `replay_spill`. Network calls release the GIL. Errors map to ValueError (bad keys, config),
//! ConnectionError (server unreachable) and RuntimeError (server errors), with the crate's
//! messages, which never contain a token.

use ortrain_tracking as tr;
use pyo3::exceptions::{PyConnectionError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

fn to_py(e: tr::Error) -> PyErr {
    match &e {
        tr::Error::InvalidKey { .. } | tr::Error::Config(_) => PyValueError::new_err(e.to_string()),
        tr::Error::Connection { .. } => PyConnectionError::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

fn status(s: &str) -> PyResult<tr::RunStatus> {
    tr::RunStatus::parse(s)
        .ok_or_else(|| PyValueError::new_err(format!("run status {s:?} is not one of RUNNING, FINISHED, FAILED, KILLED")))
}

fn kv<T>(m: Option<HashMap<String, String>>, f: impl Fn(String, String) -> T) -> Vec<T> {
    let mut v: Vec<(String, String)> = m.unwrap_or_default().into_iter().collect();
    v.sort();
    v.into_iter().map(|(k, val)| f(k, val)).collect()
}

fn run_dict<'py>(py: Python<'py>, run: &tr::Run) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("run_id", &run.info.run_id)?;
    d.set_item("experiment_id", &run.info.experiment_id)?;
    d.set_item("run_name", &run.info.run_name)?;
    d.set_item("status", run.info.status.as_str())?;
    d.set_item("start_time", run.info.start_time)?;
    d.set_item("end_time", run.info.end_time)?;
    d.set_item("artifact_uri", &run.info.artifact_uri)?;
    let m: HashMap<&str, f64> = run.data.metrics.iter().map(|m| (m.key.as_str(), m.value.0)).collect();
    let p: HashMap<&str, &str> = run.data.params.iter().map(|p| (p.key.as_str(), p.value.as_str())).collect();
    let t: HashMap<&str, &str> = run.data.tags.iter().map(|t| (t.key.as_str(), t.value.as_str())).collect();
    d.set_item("metrics", m)?;
    d.set_item("params", p)?;
    d.set_item("tags", t)?;
    Ok(d)
}

/// A blocking MLflow REST client for one tracking URI (`http(s)://…` or `databricks`).
#[pyclass(name = "MlflowClient", module = "ortrain._ortrain", frozen)]
pub struct PyClient {
    inner: tr::Client,
}

#[pymethods]
impl PyClient {
    #[new]
    #[pyo3(signature = (tracking_uri, timeout_s = 30.0))]
    fn new(tracking_uri: &str, timeout_s: f64) -> PyResult<Self> {
        let target = tr::Target::from_uri(tracking_uri).map_err(to_py)?;
        let timeout = Duration::from_secs_f64(timeout_s.clamp(0.1, 3600.0));
        Ok(PyClient { inner: tr::Client::for_target(target, timeout) })
    }

    #[getter]
    fn base_url(&self) -> String {
        self.inner.target().base_url.clone()
    }

    #[getter]
    fn is_databricks(&self) -> bool {
        self.inner.target().databricks
    }

    fn __repr__(&self) -> String {
        format!("MlflowClient({:?})", self.inner.target().base_url)
    }

    fn get_experiment_id(&self, py: Python<'_>, name: &str) -> PyResult<Option<String>> {
        py.detach(|| self.inner.get_experiment_by_name(name)).map(|e| e.map(|e| e.experiment_id)).map_err(to_py)
    }

    fn get_or_create_experiment(&self, py: Python<'_>, name: &str) -> PyResult<String> {
        py.detach(|| self.inner.get_or_create_experiment(name)).map_err(to_py)
    }

    #[pyo3(signature = (experiment_id, run_name = None, tags = None, parent_run_id = None))]
    fn create_run(
        &self,
        py: Python<'_>,
        experiment_id: &str,
        run_name: Option<&str>,
        tags: Option<HashMap<String, String>>,
        parent_run_id: Option<&str>,
    ) -> PyResult<String> {
        let tags = kv(tags, |key, value| tr::Tag { key, value });
        py.detach(|| self.inner.create_run(experiment_id, run_name, &tags, parent_run_id)).map(|i| i.run_id).map_err(to_py)
    }

    #[pyo3(signature = (run_id, status, end_time_ms = None))]
    fn update_run(&self, py: Python<'_>, run_id: &str, status: &str, end_time_ms: Option<i64>) -> PyResult<()> {
        let s = self::status(status)?;
        py.detach(|| self.inner.update_run(run_id, s, end_time_ms)).map_err(to_py)
    }

    fn get_run<'py>(&self, py: Python<'py>, run_id: &str) -> PyResult<Bound<'py, PyDict>> {
        let run = py.detach(|| self.inner.get_run(run_id)).map_err(to_py)?;
        run_dict(py, &run)
    }

    #[pyo3(signature = (experiment_ids, filter = ""))]
    fn search_runs<'py>(&self, py: Python<'py>, experiment_ids: Vec<String>, filter: &str) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let ids: Vec<&str> = experiment_ids.iter().map(|s| s.as_str()).collect();
        let runs = py.detach(|| self.inner.search_runs(&ids, filter)).map_err(to_py)?;
        runs.iter().map(|r| run_dict(py, r)).collect()
    }

    fn set_tag(&self, py: Python<'_>, run_id: &str, key: &str, value: &str) -> PyResult<()> {
        py.detach(|| self.inner.set_tag(run_id, key, value)).map_err(to_py)
    }

    fn log_param(&self, py: Python<'_>, run_id: &str, key: &str, value: &str) -> PyResult<()> {
        py.detach(|| self.inner.log_param(run_id, key, value)).map_err(to_py)
    }

    /// metrics: [(key, value, step, timestamp_ms)]; returns the number of requests sent.
    #[pyo3(signature = (run_id, metrics = None, params = None, tags = None))]
    fn log_batch(
        &self,
        py: Python<'_>,
        run_id: &str,
        metrics: Option<Vec<(String, f64, i64, i64)>>,
        params: Option<HashMap<String, String>>,
        tags: Option<HashMap<String, String>>,
    ) -> PyResult<usize> {
        let metrics: Vec<tr::Metric> = metrics
            .unwrap_or_default()
            .into_iter()
            .map(|(key, v, step, timestamp)| tr::Metric { key, value: tr::MetricValue(v), timestamp, step })
            .collect();
        let params = kv(params, |key, value| tr::Param { key, value });
        let tags = kv(tags, |key, value| tr::Tag { key, value });
        py.detach(|| self.inner.log_batch(run_id, &metrics, &params, &tags)).map_err(to_py)
    }

    /// [(step, value, timestamp_ms)] of one metric, sorted by step then timestamp.
    fn get_metric_history(&self, py: Python<'_>, run_id: &str, key: &str) -> PyResult<Vec<(i64, f64, i64)>> {
        let h = py.detach(|| self.inner.get_metric_history(run_id, key)).map_err(to_py)?;
        let mut v: Vec<(i64, f64, i64)> = h.into_iter().map(|m| (m.step, m.value.0, m.timestamp)).collect();
        v.sort_by_key(|m| (m.0, m.2));
        Ok(v)
    }

    #[pyo3(signature = (run_id, local_path, artifact_path = None))]
    fn log_artifact(&self, py: Python<'_>, run_id: &str, local_path: PathBuf, artifact_path: Option<&str>) -> PyResult<()> {
        py.detach(|| self.inner.log_artifact(run_id, &local_path, artifact_path)).map_err(to_py)
    }

    /// [(path, is_dir, size)] directly under `path`.
    #[pyo3(signature = (run_id, path = ""))]
    fn list_artifacts(&self, py: Python<'_>, run_id: &str, path: &str) -> PyResult<Vec<(String, bool, Option<i64>)>> {
        let files = py.detach(|| self.inner.list_artifacts(run_id, path)).map_err(to_py)?;
        Ok(files.into_iter().map(|f| (f.path, f.is_dir, f.file_size)).collect())
    }

    /// Re-sends a spill file; returns {"records", "metrics", "params", "tags"}.
    fn replay(&self, py: Python<'_>, spill_file: PathBuf) -> PyResult<HashMap<&'static str, u64>> {
        let s = py.detach(|| tr::replay(&self.inner, &spill_file)).map_err(to_py)?;
        Ok(HashMap::from([
            ("records", s.records),
            ("metrics", s.metrics),
            ("params", s.params),
            ("tags", s.tags),
            ("runs_ended", s.runs_ended),
        ]))
    }
}

/// The background logger of one run: `log_metric` only queues; a thread batches and sends.
#[pyclass(name = "MetricLogger", module = "ortrain._ortrain")]
pub struct PyLogger {
    inner: tr::BackgroundLogger,
}

fn stats_dict<'py>(py: Python<'py>, s: &tr::LoggerStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("metrics_sent", s.metrics_sent)?;
    d.set_item("metrics_spilled", s.metrics_spilled)?;
    d.set_item("requests", s.requests)?;
    d.set_item("retries", s.retries)?;
    d.set_item("spill_path", s.spill_path.as_ref().map(|p| p.display().to_string()))?;
    d.set_item("last_error", s.last_error.clone())?;
    Ok(d)
}

#[pymethods]
impl PyLogger {
    #[new]
    #[pyo3(signature = (client, run_id, flush_interval_ms = 1000, max_retries = 4, initial_backoff_ms = 200, spill_path = None))]
    fn new(
        client: &PyClient,
        run_id: &str,
        flush_interval_ms: u64,
        max_retries: u32,
        initial_backoff_ms: u64,
        spill_path: Option<PathBuf>,
    ) -> PyResult<Self> {
        let opts = tr::LoggerOptions {
            flush_interval: Duration::from_millis(flush_interval_ms.max(1)),
            max_retries,
            initial_backoff: Duration::from_millis(initial_backoff_ms),
            spill_path,
        };
        let inner = tr::BackgroundLogger::start(client.inner.clone(), run_id, opts).map_err(to_py)?;
        Ok(PyLogger { inner })
    }

    #[getter]
    fn run_id(&self) -> String {
        self.inner.run_id().to_string()
    }

    /// Queues a metric point; never waits on the network.
    #[pyo3(signature = (key, value, step, timestamp_ms = None))]
    fn log_metric(&self, key: &str, value: f64, step: i64, timestamp_ms: Option<i64>) -> PyResult<()> {
        self.inner.log_metric(key, value, step, timestamp_ms).map_err(to_py)
    }

    fn log_param(&self, key: &str, value: &str) -> PyResult<()> {
        self.inner.log_param(key, value).map_err(to_py)
    }

    fn set_tag(&self, key: &str, value: &str) -> PyResult<()> {
        self.inner.set_tag(key, value).map_err(to_py)
    }

    fn flush<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.inner.flush()).map_err(to_py)?;
        stats_dict(py, &s)
    }

    /// Flushes and ends the run with FINISHED | FAILED | KILLED (retried, spilled on failure).
    fn end_run<'py>(&self, py: Python<'py>, status: &str) -> PyResult<Bound<'py, PyDict>> {
        let st = self::status(status)?;
        let s = py.detach(|| self.inner.end_run(st)).map_err(to_py)?;
        stats_dict(py, &s)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.inner.stats())
    }

    /// Flushes and stops the thread (idempotent); returns the final counters.
    fn close<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let inner = &mut self.inner;
        let s = py.detach(|| inner.close()).map_err(to_py)?;
        stats_dict(py, &s)
    }
}

/// Validates a metric/param/tag key (kind: "metric" | "param" | "tag"); raises ValueError.
#[pyfunction]
fn validate_key(kind: &str, key: &str) -> PyResult<()> {
    let kind: &'static str = match kind {
        "param" => "param",
        "tag" => "tag",
        _ => "metric",
    };
    tr::validate_key(kind, key).map_err(to_py)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyClient>()?;
    m.add_class::<PyLogger>()?;
    m.add_function(wrap_pyfunction!(validate_key, m)?)?;
    Ok(())
}
