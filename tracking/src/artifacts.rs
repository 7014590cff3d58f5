//! Run artifacts, by the run's artifact URI: uploaded through the `mlflow-artifacts` API when the
//! server proxies artifacts (`mlflow server --serve-artifacts`, the default); copied when it is a
//! local path / `file://` URI (a server on this machine with a local `--default-artifact-root`);
//! on Databricks, sent to cloud storage with signed URLs for managed runs
//! (`dbfs:/databricks/mlflow-tracking/…`, [`crate::databricks_artifacts`]) or through the DBFS
//! REST API for any other `dbfs:/` location ([`crate::dbfs`]).

use crate::client::Client;
use crate::error::{Error, Result};
use crate::types::FileInfo;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Where a run's artifacts live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArtifactStore {
    /// Proxied by the tracking server; the path below `mlflow-artifacts/artifacts/`.
    Proxied(String),
    /// A directory on this machine.
    Local(PathBuf),
    /// The artifact root of a Databricks-managed run:
    /// `dbfs:/databricks/mlflow-tracking/<experiment_id>/<run_id>/artifacts`.
    DatabricksRun { experiment_id: String, run_id: String },
    /// Any other DBFS directory, as an absolute DBFS path (`/mnt/team/artifacts`).
    Dbfs(String),
}

impl ArtifactStore {
    /// Classifies a run's `artifact_uri`.
    pub fn from_uri(uri: &str) -> Result<Self> {
        if let Some(rest) = uri.strip_prefix("mlflow-artifacts:") {
            // mlflow-artifacts:/1/<run>/artifacts or mlflow-artifacts://host:port/1/<run>/artifacts
            let path = match rest.strip_prefix("//") {
                Some(h) => h.split_once('/').map(|(_, p)| p).unwrap_or(""),
                None => rest,
            };
            return Ok(ArtifactStore::Proxied(path.trim_matches('/').to_string()));
        }
        if let Some(p) = uri.strip_prefix("file://") {
            return Ok(ArtifactStore::Local(PathBuf::from(p)));
        }
        if uri.starts_with('/') {
            return Ok(ArtifactStore::Local(PathBuf::from(uri)));
        }
        if let Some(rest) = uri.strip_prefix("dbfs:") {
            return Self::from_dbfs(uri, rest);
        }
        Err(Error::Config(format!(
            "artifact URI {uri:?} is not supported by ortrain's client (only mlflow-artifacts:, dbfs: and local paths); \
             start the server with --serve-artifacts"
        )))
    }

    fn from_dbfs(uri: &str, rest: &str) -> Result<Self> {
        if let Some(authority) = rest.strip_prefix("//") {
            let profile = authority.split('/').next().unwrap_or("");
            return Err(Error::Config(format!(
                "artifact URI {uri:?} names the Databricks workspace {profile:?}; ortrain writes artifacts only to the workspace \
                 of its tracking URI (use an artifact location of the form dbfs:/<path>)"
            )));
        }
        let path = rest.trim_matches('/');
        let parts: Vec<&str> = path.split('/').collect();
        if parts.len() >= 2 && parts[0] == "databricks" && parts[1] == "mlflow-tracking" {
            return match parts.get(2..4) {
                Some([exp, run]) if *run != "logged_models" && !run.starts_with("tr-") && !exp.is_empty() && !run.is_empty() => {
                    Ok(ArtifactStore::DatabricksRun { experiment_id: exp.to_string(), run_id: run.to_string() })
                }
                _ => Err(Error::Config(format!(
                    "artifact URI {uri:?} is not a run's artifact root (expected dbfs:/databricks/mlflow-tracking/<experiment_id>/<run_id>/artifacts)"
                ))),
            };
        }
        if path.is_empty() {
            return Err(Error::Config(format!("artifact URI {uri:?} names no DBFS directory")));
        }
        Ok(ArtifactStore::Dbfs(format!("/{path}")))
    }
}

/// Percent-encodes one URL path segment or query component (RFC 3986 unreserved characters kept).
pub(crate) fn percent_encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn join_rel(parts: &[&str]) -> Result<String> {
    let mut segs = Vec::new();
    for p in parts {
        for s in p.split('/').filter(|s| !s.is_empty() && *s != ".") {
            if s == ".." {
                return Err(Error::Config(format!("artifact path {p:?} must not contain '..'")));
            }
            segs.push(s.to_string());
        }
    }
    Ok(segs.join("/"))
}

impl Client {
    /// Stores `local_file` as artifact `<artifact_dir>/<file name>` of the run.
    pub fn log_artifact(&self, run_id: &str, local_file: &Path, artifact_dir: Option<&str>) -> Result<()> {
        let name = local_file
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| Error::Config(format!("{} has no file name", local_file.display())))?;
        let rel = join_rel(&[artifact_dir.unwrap_or(""), name])?;
        let info = self.retry_policy().run(|| self.get_run(run_id))?.info;
        match ArtifactStore::from_uri(&info.artifact_uri)? {
            ArtifactStore::Proxied(root) => {
                let bytes = std::fs::read(local_file).map_err(|e| Error::io(local_file, e))?;
                let full = join_rel(&[&root, &rel])?;
                let path: Vec<String> = full.split('/').map(percent_encode).collect();
                self.put_bytes(&format!("mlflow-artifacts/artifacts/{}", path.join("/")), &bytes)
            }
            ArtifactStore::Local(root) => {
                let dest = root.join(&rel);
                if let Some(parent) = dest.parent() {
                    std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
                }
                std::fs::copy(local_file, &dest).map_err(|e| Error::io(&dest, e))?;
                Ok(())
            }
            ArtifactStore::DatabricksRun { run_id: uri_run, .. } => {
                self.require_databricks(&info.artifact_uri)?;
                self.upload_to_managed_run(&uri_run, &rel, local_file)
            }
            ArtifactStore::Dbfs(root) => {
                self.require_databricks(&info.artifact_uri)?;
                self.upload_to_dbfs(&root, &rel, local_file)
            }
        }
    }

    fn require_databricks(&self, artifact_uri: &str) -> Result<()> {
        if self.target().databricks {
            return Ok(());
        }
        Err(Error::Config(format!(
            "artifact URI {artifact_uri:?} is on Databricks DBFS; use tracking URI 'databricks' (with DATABRICKS_HOST and \
             DATABRICKS_TOKEN) to write it, not {}",
            self.target().base_url
        )))
    }

    /// Lists the artifacts of a run directly under `path` ("" = the root), all pages. On
    /// Databricks, a run whose artifacts live in a plain `dbfs:/` directory is listed through the
    /// DBFS API, as MLflow does; everything else through `mlflow/artifacts/list`.
    pub fn list_artifacts(&self, run_id: &str, path: &str) -> Result<Vec<FileInfo>> {
        #[derive(Deserialize)]
        struct R {
            #[serde(default)]
            files: Vec<FileInfo>,
            #[serde(default)]
            next_page_token: Option<String>,
        }
        let path = path.trim_matches('/');
        if self.target().databricks {
            if let Ok(ArtifactStore::Dbfs(root)) = ArtifactStore::from_uri(&self.get_run(run_id)?.info.artifact_uri) {
                return self.list_dbfs(&root, path);
            }
        }
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut q = vec![("run_id", run_id)];
            if !path.is_empty() {
                q.push(("path", path));
            }
            if let Some(t) = token.as_deref() {
                q.push(("page_token", t));
            }
            let r = self.get::<R>("artifacts/list", &q)?;
            let n = r.files.len();
            out.extend(r.files);
            match r.next_page_token.filter(|t| !t.is_empty() && n > 0) {
                Some(t) => token = Some(t),
                None => return Ok(out),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_artifact_uris() {
        assert_eq!(ArtifactStore::from_uri("mlflow-artifacts:/1/abc/artifacts").unwrap(), ArtifactStore::Proxied("1/abc/artifacts".into()));
        assert_eq!(
            ArtifactStore::from_uri("mlflow-artifacts://h:5000/1/abc/artifacts").unwrap(),
            ArtifactStore::Proxied("1/abc/artifacts".into())
        );
        assert_eq!(ArtifactStore::from_uri("file:///tmp/a").unwrap(), ArtifactStore::Local("/tmp/a".into()));
        assert!(ArtifactStore::from_uri("s3://bucket/x").unwrap_err().to_string().contains("s3://bucket/x"));
        assert_eq!(
            ArtifactStore::from_uri("dbfs:/databricks/mlflow-tracking/123/abc/artifacts").unwrap(),
            ArtifactStore::DatabricksRun { experiment_id: "123".into(), run_id: "abc".into() }
        );
        assert_eq!(ArtifactStore::from_uri("dbfs:/mnt/team/runs/").unwrap(), ArtifactStore::Dbfs("/mnt/team/runs".into()));
        let e = ArtifactStore::from_uri("dbfs:/databricks/mlflow-tracking/123/logged_models/m-1/artifacts").unwrap_err();
        assert!(e.to_string().contains("not a run's artifact root"), "{e}");
        let e = ArtifactStore::from_uri("dbfs://other@databricks/x").unwrap_err();
        assert!(e.to_string().contains("\"other@databricks\""), "{e}");
        assert_eq!(percent_encode("a b.png"), "a%20b.png");
        assert!(join_rel(&["x/../y"]).is_err());
    }
}
