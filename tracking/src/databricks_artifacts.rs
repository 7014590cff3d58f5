//! Artifacts of Databricks-managed runs (`dbfs:/databricks/mlflow-tracking/<experiment>/<run>/…`),
//! stored the way MLflow's `DatabricksArtifactRepository` stores them: the workspace hands out a
//! write credential (`POST /api/2.0/mlflow/artifacts/credentials-for-write`, body
//! `{"run_id", "path": [<path relative to the run's artifact root>]}`, answer `credential_infos`
//! with `signed_uri`, `type`, `headers`), and the bytes go straight to cloud storage at the signed
//! URI with exactly the returned headers, never with the workspace token:
//!
//! - `AWS_PRESIGNED_URL`, `GCP_SIGNED_URL`: one PUT of the whole file, streamed from disk. S3 takes
//!   at most 5 GiB in one PUT (MLflow switches to its multipart-upload endpoints above 500 MB;
//!   ortrain does not, and refuses larger files with an error naming the limit).
//! - `AZURE_SAS_URI`: Put Block per 10 MiB chunk (`comp=block&blockid=…`, `x-ms-blob-type:
//!   BlockBlob`), then Put Block List (`comp=blocklist`, XML of the block ids).
//! - `AZURE_ADLS_GEN2_SAS_URI`: create (`PUT ?resource=file`), append per chunk
//!   (`PATCH ?action=append&position=<offset>`, with `flush=true` when there is one chunk), then
//!   flush (`PATCH ?action=flush&position=<size>`) when there were several.
//!
//! Any other type is an error naming it. Every request is retried on 5xx/429/408 and connection
//! failures ([`crate::RetryPolicy`]); a 401/403 from storage (an expired signature) fetches a fresh
//! credential once and starts the file over. Memory stays bounded: whole-file PUTs stream, chunked
//! uploads hold one chunk.

use crate::client::Client;
use crate::error::{Error, Result};
use crate::signed_url::SignedUrl;
use serde::Deserialize;
use serde_json::{json, Value};
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::Path;

/// Bytes per Azure block / ADLS append (MLflow's default `MLFLOW_MULTIPART_UPLOAD_CHUNK_SIZE`).
pub const CHUNK_BYTES: u64 = 10 << 20;
/// The largest object S3 accepts in one PUT.
pub const MAX_SINGLE_PUT_BYTES: u64 = 5 << 30;
/// Azure allows at most this many blocks per blob.
const MAX_AZURE_BLOCKS: u64 = 50_000;

/// `ArtifactCredentialType` of MLflow's `databricks_artifacts.proto`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CredentialType {
    AzureSasUri,
    AwsPresignedUrl,
    GcpSignedUrl,
    AzureAdlsGen2SasUri,
    /// A type this client does not know, as the workspace spelled it.
    Other(String),
}

impl CredentialType {
    /// From the JSON enum name, or the proto number (1–4) some encoders send.
    fn parse(v: &Value) -> Self {
        let name = match v {
            Value::String(s) => s.clone(),
            Value::Number(n) => match n.as_i64() {
                Some(1) => "AZURE_SAS_URI".into(),
                Some(2) => "AWS_PRESIGNED_URL".into(),
                Some(3) => "GCP_SIGNED_URL".into(),
                Some(4) => "AZURE_ADLS_GEN2_SAS_URI".into(),
                _ => n.to_string(),
            },
            Value::Null => String::new(),
            other => other.to_string(),
        };
        match name.as_str() {
            "AZURE_SAS_URI" => CredentialType::AzureSasUri,
            "AWS_PRESIGNED_URL" => CredentialType::AwsPresignedUrl,
            "GCP_SIGNED_URL" => CredentialType::GcpSignedUrl,
            "AZURE_ADLS_GEN2_SAS_URI" => CredentialType::AzureAdlsGen2SasUri,
            _ => CredentialType::Other(name),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            CredentialType::AzureSasUri => "AZURE_SAS_URI",
            CredentialType::AwsPresignedUrl => "AWS_PRESIGNED_URL",
            CredentialType::GcpSignedUrl => "GCP_SIGNED_URL",
            CredentialType::AzureAdlsGen2SasUri => "AZURE_ADLS_GEN2_SAS_URI",
            CredentialType::Other(s) => s,
        }
    }
}

/// Where and how to write one artifact file. Debug shows neither the signature nor header values
/// (they may hold storage keys, e.g. `x-ms-encryption-key`).
#[derive(Clone)]
pub struct WriteCredential {
    pub signed_url: SignedUrl,
    pub kind: CredentialType,
    pub headers: Vec<(String, String)>,
}

impl fmt::Debug for WriteCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.headers.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("WriteCredential").field("signed_url", &self.signed_url).field("kind", &self.kind).field("headers", &names).finish()
    }
}

#[derive(Deserialize)]
struct RawHeader {
    name: String,
    #[serde(default)]
    value: String,
}

#[derive(Deserialize)]
struct RawCredential {
    #[serde(default)]
    signed_uri: String,
    #[serde(default, rename = "type")]
    kind: Value,
    #[serde(default)]
    headers: Vec<RawHeader>,
}

impl Client {
    /// Write credentials for `paths` (relative to the run's artifact root), one per path, in order
    /// (all pages).
    pub fn credentials_for_write(&self, run_id: &str, paths: &[&str]) -> Result<Vec<WriteCredential>> {
        #[derive(Deserialize)]
        struct R {
            #[serde(default)]
            credential_infos: Vec<RawCredential>,
            #[serde(default)]
            next_page_token: Option<String>,
        }
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut body = json!({ "run_id": run_id, "path": paths });
            if let Some(t) = &token {
                body["page_token"] = json!(t);
            }
            let r: R = self.retry_policy().run(|| self.post("artifacts/credentials-for-write", &body))?;
            let n = r.credential_infos.len();
            for c in r.credential_infos {
                out.push(WriteCredential {
                    signed_url: SignedUrl::new(&c.signed_uri)?,
                    kind: CredentialType::parse(&c.kind),
                    headers: c.headers.into_iter().map(|h| (h.name, h.value)).collect(),
                });
            }
            match r.next_page_token.filter(|t| !t.is_empty() && n > 0) {
                Some(t) => token = Some(t),
                None => return Ok(out),
            }
        }
    }

    fn write_credential(&self, run_id: &str, path: &str) -> Result<WriteCredential> {
        self.credentials_for_write(run_id, &[path])?.into_iter().next().ok_or_else(|| Error::Decode {
            endpoint: "mlflow/artifacts/credentials-for-write".into(),
            message: format!("no credential for artifact {path:?} of run {run_id}"),
        })
    }

    /// Stores `local_file` as artifact `rel_path` of a Databricks-managed run.
    pub(crate) fn upload_to_managed_run(&self, run_id: &str, rel_path: &str, local_file: &Path) -> Result<()> {
        let size = std::fs::metadata(local_file).map_err(|e| Error::io(local_file, e))?.len();
        let cred = self.write_credential(run_id, rel_path)?;
        check_supported(&cred, run_id, rel_path, size)?;
        match self.upload_with(&cred, local_file, size) {
            Err(Error::Storage { status: 401 | 403, .. }) => {
                let fresh = self.write_credential(run_id, rel_path)?;
                check_supported(&fresh, run_id, rel_path, size)?;
                self.upload_with(&fresh, local_file, size)
            }
            other => other,
        }
    }

    fn upload_with(&self, cred: &WriteCredential, local_file: &Path, size: u64) -> Result<()> {
        match cred.kind {
            CredentialType::AwsPresignedUrl | CredentialType::GcpSignedUrl => self.put_whole_file(cred, local_file),
            CredentialType::AzureSasUri => self.azure_blocks(cred, local_file, size),
            CredentialType::AzureAdlsGen2SasUri => self.adls_gen2(cred, local_file, size),
            CredentialType::Other(_) => Err(Error::Config(format!("unsupported artifact credential type {:?}", cred.kind.as_str()))),
        }
    }

    fn put_whole_file(&self, cred: &WriteCredential, local_file: &Path) -> Result<()> {
        self.retry_policy().run(|| {
            let file = File::open(local_file).map_err(|e| Error::io(local_file, e))?;
            let req = with_headers(self.agent().put(cred.signed_url.expose()), &cred.headers, |_| true);
            cred.signed_url.finish(cred.kind.as_str(), req.send(file))
        })
    }

    fn azure_blocks(&self, cred: &WriteCredential, local_file: &Path, size: u64) -> Result<()> {
        let url = &cred.signed_url;
        let kind = cred.kind.as_str();
        let mut ids = Vec::new();
        for_each_chunk(local_file, size, |index, _offset, chunk| {
            // 32 bytes → 44 base64 characters, the length of MLflow's ids (base64 of a uuid4 hex); Azure
            // requires one length for all block ids of a blob.
            let id = base64(format!("ortrain-block-{index:018}").as_bytes());
            let target = url.with_params(&[("comp", "block"), ("blockid", &id)]);
            self.retry_policy().run(|| {
                let req = self.agent().put(&target).header("x-ms-blob-type", "BlockBlob");
                url.finish(kind, with_headers(req, &cred.headers, azure::put_block).send(chunk))
            })?;
            ids.push(id);
            Ok(())
        })?;
        let mut xml = String::from("<?xml version=\"1.0\" encoding=\"utf-8\"?>\n<BlockList>\n");
        for id in &ids {
            xml.push_str(&format!("<Uncommitted>{id}</Uncommitted>\n"));
        }
        xml.push_str("</BlockList>");
        let target = url.with_params(&[("comp", "blocklist")]);
        self.retry_policy()
            .run(|| url.finish(kind, with_headers(self.agent().put(&target), &cred.headers, azure::put_block_list).send(xml.as_bytes())))
    }

    fn adls_gen2(&self, cred: &WriteCredential, local_file: &Path, size: u64) -> Result<()> {
        let url = &cred.signed_url;
        let kind = cred.kind.as_str();
        let create = url.with_params(&[("resource", "file")]);
        self.retry_policy()
            .run(|| url.finish(kind, with_headers(self.agent().put(&create), &cred.headers, azure::adls_create).send(&[][..])))?;
        let single = size.div_ceil(CHUNK_BYTES) == 1;
        for_each_chunk(local_file, size, |_index, offset, chunk| {
            let position = offset.to_string();
            let mut params = vec![("action", "append"), ("position", position.as_str())];
            if single {
                params.push(("flush", "true"));
            }
            let target = url.with_params(&params);
            self.retry_policy()
                .run(|| url.finish(kind, with_headers(self.agent().patch(&target), &cred.headers, azure::adls_append).send(chunk)))
        })?;
        if !single {
            let target = url.with_params(&[("action", "flush"), ("position", &size.to_string())]);
            self.retry_policy()
                .run(|| url.finish(kind, with_headers(self.agent().patch(&target), &cred.headers, azure::adls_create).send(&[][..])))?;
        }
        Ok(())
    }
}

/// Refuses credential types this client cannot use, and files too large for the type, before
/// any byte is sent.
fn check_supported(cred: &WriteCredential, run_id: &str, path: &str, size: u64) -> Result<()> {
    match &cred.kind {
        CredentialType::Other(t) => Err(Error::Config(format!(
            "Databricks returned a write credential of type {t:?} for artifact {path:?} of run {run_id}; ortrain can upload with \
             AWS_PRESIGNED_URL, GCP_SIGNED_URL, AZURE_SAS_URI and AZURE_ADLS_GEN2_SAS_URI (log this artifact with mlflow instead)"
        ))),
        CredentialType::AwsPresignedUrl if size > MAX_SINGLE_PUT_BYTES => Err(Error::Config(format!(
            "artifact {path:?} is {size} bytes; ortrain uploads to S3 in one PUT, which is limited to {MAX_SINGLE_PUT_BYTES} bytes \
             (5 GiB); log it with mlflow, which uses a multipart upload"
        ))),
        CredentialType::AzureSasUri if size.div_ceil(CHUNK_BYTES) > MAX_AZURE_BLOCKS => Err(Error::Config(format!(
            "artifact {path:?} is {size} bytes, more than Azure's {MAX_AZURE_BLOCKS} blocks of {CHUNK_BYTES} bytes"
        ))),
        _ => Ok(()),
    }
}

/// Calls `f(index, offset, bytes)` for each `CHUNK_BYTES` piece of the file (none when empty).
fn for_each_chunk(local_file: &Path, size: u64, mut f: impl FnMut(u64, u64, &[u8]) -> Result<()>) -> Result<()> {
    let mut file = File::open(local_file).map_err(|e| Error::io(local_file, e))?;
    let mut buf = vec![0u8; CHUNK_BYTES.min(size) as usize];
    let mut offset = 0u64;
    let mut index = 0u64;
    while offset < size {
        let n = CHUNK_BYTES.min(size - offset) as usize;
        file.read_exact(&mut buf[..n]).map_err(|e| Error::io(local_file, e))?;
        f(index, offset, &buf[..n])?;
        offset += n as u64;
        index += 1;
    }
    Ok(())
}

/// Adds the credential's headers that `keep` allows (Azure rejects some on some operations), and
/// lifts the client's whole-request time limit: a large body may take longer than an API call
/// (connect and per-read limits stay).
fn with_headers<B>(req: ureq::RequestBuilder<B>, headers: &[(String, String)], keep: fn(&str) -> bool) -> ureq::RequestBuilder<B> {
    let mut req = req.config().timeout_global(None).timeout_recv_response(Some(std::time::Duration::from_secs(300))).build();
    for (name, value) in headers {
        let lower = name.to_ascii_lowercase();
        // framing headers are ours to compute from the body actually sent
        if !["content-length", "transfer-encoding", "host"].contains(&lower.as_str()) && keep(&lower) {
            req = req.header(name.as_str(), value.as_str());
        }
    }
    req
}

/// Which credential headers each Azure operation accepts (from Azure's REST reference for Put
/// Block, Put Block List, and ADLS Gen2 Path Create / Update). Names arrive lower-cased.
mod azure {
    const COMMON: &[&str] = &[
        "authorization",
        "x-ms-date",
        "x-ms-version",
        "x-ms-client-request-id",
        "x-ms-lease-id",
        "x-ms-encryption-key",
        "x-ms-encryption-key-sha256",
        "x-ms-encryption-algorithm",
    ];

    fn conditional(h: &str) -> bool {
        h.starts_with("if-")
    }

    pub fn put_block(h: &str) -> bool {
        COMMON.contains(&h) || ["content-md5", "x-ms-content-crc64", "x-ms-encryption-scope"].contains(&h)
    }

    pub fn put_block_list(h: &str) -> bool {
        put_block(h)
            || conditional(h)
            || h.starts_with("x-ms-meta-")
            || h.starts_with("x-ms-blob-")
            || ["x-ms-tags", "x-ms-access-tier"].contains(&h)
    }

    pub fn adls_create(h: &str) -> bool {
        COMMON.contains(&h)
            || conditional(h)
            || h.starts_with("x-ms-content-")
            || h.starts_with("x-ms-source-if-")
            || h.starts_with("x-ms-expiry-")
            || [
                "cache-control",
                "content-encoding",
                "content-language",
                "content-disposition",
                "x-ms-cache-control",
                "x-ms-properties",
                "x-ms-permissions",
                "x-ms-umask",
                "x-ms-owner",
                "x-ms-group",
                "x-ms-acl",
                "x-ms-proposed-lease-id",
                "x-ms-rename-source",
                "x-ms-encryption-context",
            ]
            .contains(&h)
    }

    pub fn adls_append(h: &str) -> bool {
        COMMON.contains(&h)
            || conditional(h)
            || h.starts_with("x-ms-content-")
            || [
                "content-md5",
                "x-ms-cache-control",
                "x-ms-properties",
                "x-ms-owner",
                "x-ms-group",
                "x-ms-permissions",
                "x-ms-acl",
                "x-ms-encryption-context",
            ]
            .contains(&h)
    }
}

/// Standard base64 with padding (Azure block ids).
fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16 | (*c.get(1).unwrap_or(&0) as u32) << 8 | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_credential_types_and_encodes_block_ids() {
        assert_eq!(CredentialType::parse(&json!("AWS_PRESIGNED_URL")), CredentialType::AwsPresignedUrl);
        assert_eq!(CredentialType::parse(&json!(4)), CredentialType::AzureAdlsGen2SasUri);
        assert_eq!(CredentialType::parse(&json!("R2_PRESIGNED")), CredentialType::Other("R2_PRESIGNED".into()));
        assert_eq!(base64(b"ortrain-block-00000001"), "b3J0cmFpbi1ibG9jay0wMDAwMDAwMQ==");
        assert_eq!(base64(b"ab"), "YWI=");
        assert_eq!(base64(b"abc"), "YWJj");
        assert!(azure::put_block("x-ms-encryption-scope") && !azure::put_block("x-ms-blob-content-type"));
        assert!(azure::put_block_list("x-ms-blob-content-type") && azure::put_block_list("x-ms-meta-a"));
        assert!(azure::adls_create("x-ms-umask") && !azure::adls_append("x-ms-umask"));
    }

    #[test]
    fn debug_hides_signature_and_header_values() {
        let c = WriteCredential {
            signed_url: SignedUrl::new("https://s3/b/k?X-Amz-Signature=deadbeefdeadbeef").unwrap(),
            kind: CredentialType::AwsPresignedUrl,
            headers: vec![("x-ms-encryption-key".into(), "KEYVALUE".into())],
        };
        let d = format!("{c:?}");
        assert!(!d.contains("deadbeef") && !d.contains("KEYVALUE") && d.contains("x-ms-encryption-key"), "{d}");
    }
}
