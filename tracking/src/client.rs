//! The typed MLflow REST client: experiments, runs, log-batch (split at MLflow's per-request
//! limits), set-tag, log-parameter, metrics/get-history. Blocking (ureq); the background logger
//! ([`crate::logger`]) keeps it off the training loop's path.

use crate::error::{Error, Result};
use crate::retry::RetryPolicy;
use crate::target::Target;
use crate::types::*;
use crate::validate::validate_key;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::Duration;

/// MLflow's per-request limits of runs/log-batch.
pub const MAX_METRICS_PER_BATCH: usize = 1000;
pub const MAX_PARAMS_PER_BATCH: usize = 100;
pub const MAX_TAGS_PER_BATCH: usize = 100;
pub const MAX_ITEMS_PER_BATCH: usize = 1000;

/// A blocking MLflow REST client. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Client {
    target: Target,
    agent: ureq::Agent,
    retry: RetryPolicy,
}

impl Client {
    /// A client for a tracking URI (`http(s)://…`, `databricks`, `databricks://PROFILE`).
    pub fn new(tracking_uri: &str) -> Result<Self> {
        Ok(Self::for_target(Target::from_uri(tracking_uri)?, Duration::from_secs(30)))
    }

    /// A client for a resolved target with a per-request timeout.
    pub fn for_target(target: Target, timeout: Duration) -> Self {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(timeout))
            .timeout_connect(Some(Duration::from_secs(5).min(timeout)))
            .build()
            .into();
        Client { target, agent, retry: RetryPolicy::default() }
    }

    /// The same client with another retry policy for artifact transfers (5xx, 429, connection
    /// failures). Metric logging retries in the background logger instead.
    pub fn with_retry_policy(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    pub fn target(&self) -> &Target {
        &self.target
    }

    pub(crate) fn agent(&self) -> &ureq::Agent {
        &self.agent
    }

    pub(crate) fn retry_policy(&self) -> &RetryPolicy {
        &self.retry
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("{}/api/2.0/{}", self.target.base_url, path.trim_start_matches('/'))
    }

    /// Adds the Bearer token (Databricks). Only for requests to the tracking host itself.
    pub(crate) fn auth<B>(&self, req: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.target.token {
            Some(t) => req.header("Authorization", format!("Bearer {}", t.expose())),
            None => req,
        }
    }

    /// Turns a ureq result into the body text, mapping transport and HTTP errors.
    pub(crate) fn finish(&self, endpoint: &str, res: std::result::Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Result<String> {
        let mut resp = res.map_err(|e| Error::Connection { endpoint: endpoint.to_string(), message: e.to_string() })?;
        let status = resp.status().as_u16();
        let body = resp
            .body_mut()
            .with_config()
            .limit(256 << 20)
            .read_to_string()
            .map_err(|e| Error::Connection { endpoint: endpoint.to_string(), message: e.to_string() })?;
        if (200..300).contains(&status) {
            return Ok(body);
        }
        #[derive(Deserialize, Default)]
        struct ErrBody {
            #[serde(default)]
            error_code: String,
            #[serde(default)]
            message: String,
        }
        let eb: ErrBody = serde_json::from_str(&body)
            .unwrap_or_else(|_| ErrBody { error_code: String::new(), message: body.chars().take(300).collect() });
        Err(Error::Server { endpoint: endpoint.to_string(), status, code: eb.error_code, message: eb.message })
    }

    pub(crate) fn decode<T: DeserializeOwned>(endpoint: &str, body: &str) -> Result<T> {
        let body = if body.trim().is_empty() { "{}" } else { body };
        serde_json::from_str(body).map_err(|e| Error::Decode { endpoint: endpoint.to_string(), message: e.to_string() })
    }

    /// POST a JSON body to `mlflow/<endpoint>`.
    pub fn post<T: DeserializeOwned>(&self, endpoint: &str, body: &Value) -> Result<T> {
        let path = format!("mlflow/{endpoint}");
        let res = self.auth(self.agent.post(&self.url(&path))).send_json(body);
        let text = self.finish(&path, res)?;
        Self::decode(&path, &text)
    }

    /// GET `mlflow/<endpoint>?query`.
    pub fn get<T: DeserializeOwned>(&self, endpoint: &str, query: &[(&str, &str)]) -> Result<T> {
        let path = format!("mlflow/{endpoint}");
        let mut req = self.auth(self.agent.get(&self.url(&path)));
        for (k, v) in query {
            req = req.query(*k, *v);
        }
        let text = self.finish(&path, req.call())?;
        Self::decode(&path, &text)
    }

    pub(crate) fn put_bytes(&self, path: &str, bytes: &[u8]) -> Result<()> {
        let req = self.auth(self.agent.put(&self.url(path))).header("Content-Type", "application/octet-stream");
        self.finish(path, req.send(bytes)).map(|_| ())
    }

    // ---- experiments ----

    /// The experiment with this name, or `None`.
    pub fn get_experiment_by_name(&self, name: &str) -> Result<Option<Experiment>> {
        #[derive(Deserialize)]
        struct R {
            experiment: Experiment,
        }
        match self.get::<R>("experiments/get-by-name", &[("experiment_name", name)]) {
            Ok(r) => Ok(Some(r.experiment)),
            Err(Error::Server { code, .. }) if code == "RESOURCE_DOES_NOT_EXIST" => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Creates an experiment; returns its id.
    pub fn create_experiment(&self, name: &str, artifact_location: Option<&str>) -> Result<String> {
        #[derive(Deserialize)]
        struct R {
            experiment_id: String,
        }
        let mut body = json!({ "name": name });
        if let Some(loc) = artifact_location {
            body["artifact_location"] = json!(loc);
        }
        Ok(self.post::<R>("experiments/create", &body)?.experiment_id)
    }

    /// The id of the experiment with this name, created if missing (race-safe).
    pub fn get_or_create_experiment(&self, name: &str) -> Result<String> {
        if let Some(e) = self.get_experiment_by_name(name)? {
            return Ok(e.experiment_id);
        }
        match self.create_experiment(name, None) {
            Ok(id) => Ok(id),
            Err(Error::Server { code, .. }) if code == "RESOURCE_ALREADY_EXISTS" => self
                .get_experiment_by_name(name)?
                .map(|e| e.experiment_id)
                .ok_or_else(|| Error::Config(format!("experiment {name:?} vanished while being created"))),
            Err(e) => Err(e),
        }
    }

    // ---- runs ----

    /// Creates a run (status RUNNING) with tags; `parent_run_id` nests it under a parent.
    pub fn create_run(&self, experiment_id: &str, run_name: Option<&str>, tags: &[Tag], parent_run_id: Option<&str>) -> Result<RunInfo> {
        let mut tags: Vec<Tag> = tags.to_vec();
        for t in &tags {
            validate_key("tag", &t.key)?;
        }
        if let Some(p) = parent_run_id {
            tags.push(Tag { key: "mlflow.parentRunId".into(), value: p.into() });
        }
        let mut body = json!({ "experiment_id": experiment_id, "start_time": now_ms(), "tags": tags });
        if let Some(n) = run_name {
            body["run_name"] = json!(n);
        }
        #[derive(Deserialize)]
        struct R {
            run: Run,
        }
        Ok(self.post::<R>("runs/create", &body)?.run.info)
    }

    /// Sets a run's status; terminal states also set `end_time` (now, unless given).
    pub fn update_run(&self, run_id: &str, status: RunStatus, end_time: Option<i64>) -> Result<()> {
        let mut body = json!({ "run_id": run_id, "status": status.as_str() });
        if status != RunStatus::Running && status != RunStatus::Scheduled {
            body["end_time"] = json!(end_time.unwrap_or_else(now_ms));
        }
        self.post::<Value>("runs/update", &body).map(|_| ())
    }

    pub fn get_run(&self, run_id: &str) -> Result<Run> {
        #[derive(Deserialize)]
        struct R {
            run: Run,
        }
        Ok(self.get::<R>("runs/get", &[("run_id", run_id)])?.run)
    }

    /// Runs of the given experiments matching an MLflow filter string ("" = all), up to 1000.
    pub fn search_runs(&self, experiment_ids: &[&str], filter: &str) -> Result<Vec<Run>> {
        #[derive(Deserialize)]
        struct R {
            #[serde(default)]
            runs: Vec<Run>,
        }
        let body = json!({ "experiment_ids": experiment_ids, "filter": filter, "max_results": 1000 });
        Ok(self.post::<R>("runs/search", &body)?.runs)
    }

    pub fn set_tag(&self, run_id: &str, key: &str, value: &str) -> Result<()> {
        validate_key("tag", key)?;
        self.post::<Value>("runs/set-tag", &json!({ "run_id": run_id, "key": key, "value": value })).map(|_| ())
    }

    pub fn log_param(&self, run_id: &str, key: &str, value: &str) -> Result<()> {
        validate_key("param", key)?;
        self.post::<Value>("runs/log-parameter", &json!({ "run_id": run_id, "key": key, "value": value })).map(|_| ())
    }

    /// Logs metrics, params and tags, split into as many log-batch requests as MLflow's limits
    /// need. Returns the number of requests sent.
    pub fn log_batch(&self, run_id: &str, metrics: &[Metric], params: &[Param], tags: &[Tag]) -> Result<usize> {
        for m in metrics {
            validate_key("metric", &m.key)?;
        }
        for p in params {
            validate_key("param", &p.key)?;
        }
        for t in tags {
            validate_key("tag", &t.key)?;
        }
        let mut requests = 0;
        for chunk in plan_batches(metrics.len(), params.len(), tags.len()) {
            let body = json!({
                "run_id": run_id,
                "metrics": &metrics[chunk.metrics.clone()],
                "params": &params[chunk.params.clone()],
                "tags": &tags[chunk.tags.clone()],
            });
            self.post::<Value>("runs/log-batch", &body)?;
            requests += 1;
        }
        Ok(requests)
    }

    /// Every point of one metric of a run, in server order (all pages).
    pub fn get_metric_history(&self, run_id: &str, key: &str) -> Result<Vec<Metric>> {
        #[derive(Deserialize)]
        struct R {
            #[serde(default)]
            metrics: Vec<Metric>,
            #[serde(default)]
            next_page_token: Option<String>,
        }
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut q = vec![("run_id", run_id), ("metric_key", key), ("max_results", "25000")];
            if let Some(t) = token.as_deref() {
                q.push(("page_token", t));
            }
            let r: R = self.get("metrics/get-history", &q)?;
            out.extend(r.metrics);
            match r.next_page_token.filter(|t| !t.is_empty()) {
                Some(t) => token = Some(t),
                None => return Ok(out),
            }
        }
    }
}

/// Index ranges of one log-batch request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchChunk {
    pub metrics: std::ops::Range<usize>,
    pub params: std::ops::Range<usize>,
    pub tags: std::ops::Range<usize>,
}

/// Splits (metrics, params, tags) counts into requests within MLflow's limits
/// (≤1000 metrics, ≤100 params, ≤100 tags, ≤1000 items in all). Nothing to send → no request.
pub fn plan_batches(n_metrics: usize, n_params: usize, n_tags: usize) -> Vec<BatchChunk> {
    let (mut m, mut p, mut t) = (0, 0, 0);
    let mut out = Vec::new();
    while m < n_metrics || p < n_params || t < n_tags {
        let np = (n_params - p).min(MAX_PARAMS_PER_BATCH);
        let nt = (n_tags - t).min(MAX_TAGS_PER_BATCH);
        let nm = (n_metrics - m).min(MAX_METRICS_PER_BATCH).min(MAX_ITEMS_PER_BATCH - np - nt);
        out.push(BatchChunk { metrics: m..m + nm, params: p..p + np, tags: t..t + nt });
        m += nm;
        p += np;
        t += nt;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_respect_mlflow_limits() {
        assert!(plan_batches(0, 0, 0).is_empty());
        let b = plan_batches(2500, 0, 0);
        assert_eq!(b.len(), 3);
        assert_eq!(b[2].metrics, 2000..2500);
        let b = plan_batches(1000, 250, 30);
        for c in &b {
            assert!(c.metrics.len() <= 1000 && c.params.len() <= 100 && c.tags.len() <= 100);
            assert!(c.metrics.len() + c.params.len() + c.tags.len() <= 1000);
        }
        assert_eq!(b.iter().map(|c| c.metrics.len()).sum::<usize>(), 1000);
        assert_eq!(b.iter().map(|c| c.params.len()).sum::<usize>(), 250);
        assert_eq!(b.iter().map(|c| c.tags.len()).sum::<usize>(), 30);
    }
}
