//! Artifacts under a DBFS path that is *not* the managed `databricks/mlflow-tracking` root (an
//! experiment created with `artifact_location = "dbfs:/mnt/…"`), written the way MLflow's
//! `DbfsRestArtifactRepository` writes them: the raw file bytes in one
//! `POST <workspace>/dbfs/<path>` with the Bearer token and no redirects followed, streamed from
//! disk; listed with `GET /api/2.0/dbfs/list?path=<path>` (a missing directory lists as empty).
//! (On a cluster MLflow may write through the `/dbfs` FUSE mount instead; the REST path works
//! everywhere.)

use crate::artifacts::percent_encode;
use crate::client::Client;
use crate::error::{Error, Result};
use crate::types::FileInfo;
use serde::Deserialize;
use std::fs::File;
use std::path::Path;

/// `/<root>/<rel>` without doubled or trailing slashes.
fn dbfs_path(root: &str, rel: &str) -> String {
    let joined = format!("{}/{}", root.trim_matches('/'), rel.trim_matches('/'));
    format!("/{}", joined.trim_matches('/'))
}

impl Client {
    /// Uploads `local_file` to DBFS `<root>/<rel>`.
    pub(crate) fn upload_to_dbfs(&self, root: &str, rel: &str, local_file: &Path) -> Result<()> {
        let path = dbfs_path(root, rel);
        let encoded: Vec<String> = path.trim_start_matches('/').split('/').map(percent_encode).collect();
        let url = format!("{}/dbfs/{}", self.target().base_url, encoded.join("/"));
        let endpoint = format!("dbfs{path}");
        self.retry_policy().run(|| {
            let file = File::open(local_file).map_err(|e| Error::io(local_file, e))?;
            let req =
                self.auth(self.agent().post(&url)).config().max_redirects(0).max_redirects_will_error(false).timeout_global(None).build();
            self.finish(&endpoint, req.send(file)).map(|_| ())
        })
    }

    /// The files directly under DBFS `<root>/<rel>`, with paths relative to `root` (MLflow's rule:
    /// a `rel` naming a file lists as empty).
    pub(crate) fn list_dbfs(&self, root: &str, rel: &str) -> Result<Vec<FileInfo>> {
        #[derive(Deserialize)]
        struct Entry {
            path: String,
            #[serde(default)]
            is_dir: bool,
            #[serde(default)]
            file_size: Option<i64>,
        }
        #[derive(Deserialize)]
        struct R {
            #[serde(default)]
            files: Vec<Entry>,
        }
        let path = dbfs_path(root, rel);
        let endpoint = "dbfs/list";
        let res = self.retry_policy().run(|| {
            let req = self.auth(self.agent().get(&self.url(endpoint))).query("path", &path);
            self.finish(endpoint, req.call())
        });
        let text = match res {
            Ok(t) => t,
            Err(Error::Server { code, .. }) if code == "RESOURCE_DOES_NOT_EXIST" => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let r: R = Client::decode(endpoint, &text)?;
        let prefix = format!("{}/", dbfs_path(root, ""));
        let rel = rel.trim_matches('/');
        let mut out = Vec::new();
        for e in r.files {
            let p = e.path.strip_prefix(&prefix).unwrap_or(&e.path).to_string();
            if p == rel {
                return Ok(Vec::new());
            }
            out.push(FileInfo { path: p, is_dir: e.is_dir, file_size: if e.is_dir { None } else { e.file_size } });
        }
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joins_dbfs_paths() {
        assert_eq!(dbfs_path("/mnt/a/", "x/y.json"), "/mnt/a/x/y.json");
        assert_eq!(dbfs_path("/mnt/a", ""), "/mnt/a");
    }
}
