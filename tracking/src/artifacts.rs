//! Run artifacts: uploaded through the `mlflow-artifacts` API when the server proxies artifacts
//! (`mlflow server --serve-artifacts`, the default), or copied when the run's artifact URI is a
//! local path / `file://` URI (a server on this machine with a local `--default-artifact-root`).

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
        Err(Error::Config(format!(
            "artifact URI {uri:?} is not supported by ortrain's client (only mlflow-artifacts: and local paths); \
             start the server with --serve-artifacts"
        )))
    }
}

/// Percent-encodes one URL path segment.
fn encode_segment(s: &str) -> String {
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
        let info = self.get_run(run_id)?.info;
        match ArtifactStore::from_uri(&info.artifact_uri)? {
            ArtifactStore::Proxied(root) => {
                let bytes = std::fs::read(local_file).map_err(|e| Error::io(local_file, e))?;
                let full = join_rel(&[&root, &rel])?;
                let path: Vec<String> = full.split('/').map(encode_segment).collect();
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
        }
    }

    /// Lists the artifacts of a run directly under `path` ("" = the root).
    pub fn list_artifacts(&self, run_id: &str, path: &str) -> Result<Vec<FileInfo>> {
        #[derive(Deserialize)]
        struct R {
            #[serde(default)]
            files: Vec<FileInfo>,
        }
        let mut q = vec![("run_id", run_id)];
        if !path.is_empty() {
            q.push(("path", path));
        }
        Ok(self.get::<R>("artifacts/list", &q)?.files)
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
        assert_eq!(encode_segment("a b.png"), "a%20b.png");
        assert!(join_rel(&["x/../y"]).is_err());
    }
}
