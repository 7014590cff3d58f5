//! Artifacts on Databricks against a loopback stand-in of the workspace and its cloud storage
//! (there is no workspace here; tests/test_databricks_artifacts_py.py checks that the stand-in
//! sees the same request shapes from MLflow's own client). Checks: the bytes arrive intact at the
//! signed URL with the credential's headers, per storage type (S3/GCS PUT, Azure blocks, ADLS
//! create/append/flush); the Bearer token goes to the workspace and never to storage; an expired
//! signed URL is refreshed once and then fails with an error that holds neither the signature nor
//! the token; an unknown credential type is named; 503 is retried; plain `dbfs:/` roots go
//! through the DBFS API; listing works for both.

mod standin;

use ortrain_tracking::*;
use standin::{StandIn, SIGNATURE, TOKEN};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn client(s: &StandIn) -> Client {
    let target = Target { base_url: s.url(), token: Some(Secret::new(TOKEN)), databricks: true };
    Client::for_target(target, Duration::from_secs(20))
        .with_retry_policy(RetryPolicy { max_retries: 3, initial_backoff: Duration::from_millis(10) })
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ortrain-dbx-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Deterministic bytes that differ at every offset (so a misplaced chunk is caught).
fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn storage_requests(s: &StandIn) -> Vec<standin::Request> {
    s.requests().into_iter().filter(|r| r.path.starts_with("/storage/")).collect()
}

fn assert_token_only_to_workspace(s: &StandIn) {
    for r in s.requests() {
        if r.path.starts_with("/storage/") {
            assert!(r.header("authorization").is_none(), "token sent to storage: {} {}", r.method, r.path);
        } else {
            assert_eq!(r.header("authorization"), Some(format!("Bearer {TOKEN}").as_str()), "{} {}", r.method, r.path);
        }
    }
}

#[test]
fn aws_presigned_put_streams_the_file_with_the_credential_headers() {
    let s = StandIn::start();
    let c = client(&s);
    let dir = temp_dir("aws");
    let bytes = pattern(3 << 20);
    let f = write(&dir, "summary one.json", &bytes);
    c.log_artifact("run-aws", &f, Some("compare")).unwrap();

    let reqs = s.requests();
    let paths: Vec<(&str, &str)> = reqs.iter().map(|r| (r.method.as_str(), r.path.as_str())).collect();
    assert_eq!(
        paths,
        [
            ("GET", "/api/2.0/mlflow/runs/get"),
            ("POST", "/api/2.0/mlflow/artifacts/credentials-for-write"),
            ("PUT", "/storage/run-aws/compare/summary one.json"),
        ]
    );
    assert_eq!(reqs[0].param("run_id"), Some("run-aws"));
    let body: serde_json::Value = serde_json::from_slice(&reqs[1].body).unwrap();
    assert_eq!(body, serde_json::json!({"run_id": "run-aws", "path": ["compare/summary one.json"]}));
    let put = &reqs[2];
    assert_eq!(put.param("X-Amz-Signature"), Some(SIGNATURE));
    assert_eq!(put.header("x-amz-server-side-encryption"), Some("AES256"), "credential headers are sent as given");
    assert_eq!(put.header("content-length"), Some(bytes.len().to_string().as_str()), "S3 needs a Content-Length");
    assert!(put.header("transfer-encoding").is_none());
    assert!(put.header("content-type").is_none(), "a Content-Type the URL was not signed with breaks GCS V2 signatures");
    assert_eq!(s.object("/storage/run-aws/compare/summary one.json").unwrap(), bytes, "bytes intact");
    assert_token_only_to_workspace(&s);

    let files = c.list_artifacts("run-aws", "compare").unwrap();
    assert_eq!(files.len(), 1);
    assert_eq!((files[0].path.as_str(), files[0].file_size), ("compare/summary one.json", Some(bytes.len() as i64)));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn gcp_signed_put_and_empty_files() {
    let s = StandIn::start();
    let c = client(&s);
    let dir = temp_dir("gcp");
    let f = write(&dir, "empty.txt", b"");
    c.log_artifact("run-gcp", &f, None).unwrap();
    let put = storage_requests(&s).pop().unwrap();
    assert_eq!((put.method.as_str(), put.path.as_str()), ("PUT", "/storage/run-gcp/empty.txt"));
    assert_eq!(put.header("content-length"), Some("0"));
    assert_eq!(s.object("/storage/run-gcp/empty.txt").unwrap(), b"");
    assert_token_only_to_workspace(&s);
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn azure_sas_uploads_blocks_then_the_block_list() {
    let s = StandIn::start();
    let c = client(&s);
    let dir = temp_dir("azure");
    let bytes = pattern((10 << 20) * 2 + 12345);
    let f = write(&dir, "plot.png", &bytes);
    c.log_artifact("run-azure", &f, Some("compare")).unwrap();
    let puts = storage_requests(&s);
    assert_eq!(puts.len(), 4, "3 blocks + the block list");
    let mut ids = Vec::new();
    for b in &puts[..3] {
        assert_eq!((b.method.as_str(), b.param("comp")), ("PUT", Some("block")));
        assert_eq!(b.header("x-ms-blob-type"), Some("BlockBlob"));
        assert_eq!(b.header("x-ms-encryption-scope"), Some("scope1"), "Put Block keeps headers Azure accepts on it");
        assert!(b.header("x-amz-server-side-encryption").is_none(), "and drops the others");
        assert_eq!(b.param("X-Amz-Signature"), Some(SIGNATURE), "the signature survives the added parameters");
        ids.push(b.param("blockid").unwrap().to_string());
    }
    assert_eq!(puts[0].body.len(), 10 << 20);
    let list = String::from_utf8(puts[3].body.clone()).unwrap();
    assert_eq!(puts[3].param("comp"), Some("blocklist"));
    for id in &ids {
        assert!(list.contains(&format!("<Uncommitted>{id}</Uncommitted>")), "{list}");
    }
    assert_eq!(s.object("/storage/run-azure/compare/plot.png").unwrap(), bytes, "bytes intact");
    assert_token_only_to_workspace(&s);
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn adls_gen2_creates_appends_and_flushes() {
    let s = StandIn::start();
    let c = client(&s);
    let dir = temp_dir("adls");
    // one chunk: create, then append with flush=true
    let small = write(&dir, "small.json", b"{\"speedup\": 2.0}");
    c.log_artifact("run-adls", &small, None).unwrap();
    let r = storage_requests(&s);
    type Shape<'a> = (String, Option<&'a str>, Option<&'a str>, Option<&'a str>);
    let shape: Vec<Shape> = r.iter().map(|q| (q.method.clone(), q.param("resource"), q.param("action"), q.param("flush"))).collect();
    assert_eq!(shape, [("PUT".into(), Some("file"), None, None), ("PATCH".into(), None, Some("append"), Some("true"))]);
    assert_eq!(r[0].header("content-length"), Some("0"));
    assert_eq!(s.object("/storage/run-adls/small.json").unwrap(), b"{\"speedup\": 2.0}");
    // two chunks: create, append at 0, append at 10 MiB, flush at the size
    s.clear();
    let bytes = pattern((10 << 20) + 77);
    let big = write(&dir, "big.bin", &bytes);
    c.log_artifact("run-adls", &big, Some("d")).unwrap();
    let r = storage_requests(&s);
    let shape: Vec<(String, Option<&str>, Option<&str>)> =
        r.iter().map(|q| (q.method.clone(), q.param("action"), q.param("position"))).collect();
    let size = bytes.len().to_string();
    assert_eq!(
        shape,
        [
            ("PUT".into(), None, None),
            ("PATCH".into(), Some("append"), Some("0")),
            ("PATCH".into(), Some("append"), Some("10485760")),
            ("PATCH".into(), Some("flush"), Some(size.as_str())),
        ]
    );
    assert_eq!(s.object("/storage/run-adls/d/big.bin").unwrap(), bytes, "bytes intact");
    assert_token_only_to_workspace(&s);
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn expired_signed_url_is_refreshed_once_then_fails_without_leaking() {
    let s = StandIn::start();
    let c = client(&s);
    let dir = temp_dir("expired");
    let f = write(&dir, "a.json", b"{}");
    let e = c.log_artifact("run-expired", &f, None).unwrap_err();
    let msg = e.to_string();
    eprintln!("expired: {msg}");
    assert!(matches!(e, Error::Storage { status: 403, .. }), "{msg}");
    assert!(msg.contains("AccessDenied") && msg.contains("expired"), "{msg}");
    assert!(msg.contains("/storage/run-expired/a.json?<redacted>"), "names the URL without its query: {msg}");
    for secret in [SIGNATURE, TOKEN, "X-Amz-Signature", "X-Amz-Expires"] {
        assert!(!msg.contains(secret) && !format!("{e:?}").contains(secret), "{secret} leaked: {msg}");
    }
    let creds = s.requests().iter().filter(|r| r.path.ends_with("credentials-for-write")).count();
    assert_eq!(creds, 2, "one fresh credential after the 403");
    assert_eq!(storage_requests(&s).len(), 2, "403 is not retried with the same URL");
    assert_token_only_to_workspace(&s);
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn unknown_credential_type_is_named_and_nothing_is_sent() {
    let s = StandIn::start();
    let c = client(&s);
    let dir = temp_dir("weird");
    let f = write(&dir, "a.json", b"{}");
    let msg = c.log_artifact("run-weird", &f, None).unwrap_err().to_string();
    assert!(msg.contains("\"R2_PRESIGNED_URL\"") && msg.contains("a.json") && msg.contains("run-weird"), "{msg}");
    assert!(!msg.contains(SIGNATURE), "{msg}");
    assert!(storage_requests(&s).is_empty());
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn storage_503_is_retried() {
    let s = StandIn::start();
    let c = client(&s);
    let dir = temp_dir("flaky");
    let f = write(&dir, "a.json", b"{\"x\": 1}");
    c.log_artifact("run-flaky", &f, None).unwrap();
    assert_eq!(storage_requests(&s).len(), 2);
    assert_eq!(s.object("/storage/run-flaky/a.json").unwrap(), b"{\"x\": 1}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn plain_dbfs_roots_go_through_the_dbfs_api() {
    let s = StandIn::start();
    let c = client(&s);
    let dir = temp_dir("dbfs");
    let bytes = pattern(100_000);
    let f = write(&dir, "summary one.json", &bytes);
    c.log_artifact("run-dbfs", &f, Some("compare")).unwrap();
    let post = s.requests().into_iter().find(|r| r.method == "POST").unwrap();
    assert_eq!(post.path, "/dbfs/mnt/team/artifacts/run-dbfs/compare/summary one.json");
    assert_eq!(post.header("content-length"), Some("100000"));
    assert_eq!(s.object("/dbfs/mnt/team/artifacts/run-dbfs/compare/summary one.json").unwrap(), bytes);
    assert_token_only_to_workspace(&s);

    let root = c.list_artifacts("run-dbfs", "").unwrap();
    assert_eq!(root.len(), 1);
    assert_eq!((root[0].path.as_str(), root[0].is_dir), ("compare", true));
    let files = c.list_artifacts("run-dbfs", "compare").unwrap();
    assert_eq!((files[0].path.as_str(), files[0].file_size), ("compare/summary one.json", Some(100_000)));
    assert!(c.list_artifacts("run-dbfs", "nothing-here").unwrap().is_empty());
    let list = s.requests().into_iter().rfind(|r| r.path == "/api/2.0/dbfs/list").unwrap();
    assert_eq!(list.param("path"), Some("/mnt/team/artifacts/run-dbfs/nothing-here"));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn dbfs_artifacts_need_the_databricks_tracking_uri() {
    let s = StandIn::start();
    let c = Client::for_target(Target { base_url: s.url(), token: Some(Secret::new(TOKEN)), databricks: false }, Duration::from_secs(5));
    let dir = temp_dir("nodbx");
    let f = write(&dir, "a.json", b"{}");
    let msg = c.log_artifact("run-aws", &f, None).unwrap_err().to_string();
    assert!(msg.contains("tracking URI 'databricks'") && msg.contains("dbfs:/databricks/mlflow-tracking/42/run-aws"), "{msg}");
    std::fs::remove_dir_all(dir).ok();
}
