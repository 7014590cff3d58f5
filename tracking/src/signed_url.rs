//! A signed storage URL (S3 presigned, GCS signed, Azure SAS) handed out by Databricks. Its query
//! string *is* a credential, so it never prints: Debug and Display show `<redacted>` in its place,
//! and every error about a request to it is scrubbed of the query string and of each of its
//! parameter values. Requests to it never carry the workspace token.

use crate::error::{Error, Result};
use std::fmt;

/// A URL whose query string is a credential.
#[derive(Clone, PartialEq, Eq)]
pub struct SignedUrl(String);

impl SignedUrl {
    /// Accepts `http(s)://…` only.
    pub fn new(url: &str) -> Result<Self> {
        let u = SignedUrl(url.to_string());
        if !(url.starts_with("https://") || url.starts_with("http://")) {
            return Err(Error::Config(format!("Databricks returned a signed artifact URL that is not http(s): {}", u.redacted())));
        }
        Ok(u)
    }

    /// The URL with its query string replaced by `<redacted>`: safe to print.
    pub fn redacted(&self) -> String {
        match self.0.split_once('?') {
            Some((base, _)) => format!("{base}?<redacted>"),
            None => self.0.clone(),
        }
    }

    /// The full URL, for the request line only.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }

    /// The full URL with `params` appended to its query string (values percent-encoded), as
    /// Azure's Put Block / ADLS append need (`comp=block&blockid=…`).
    pub(crate) fn with_params(&self, params: &[(&str, &str)]) -> String {
        let mut out = self.0.clone();
        for (k, v) in params {
            out.push(if out.contains('?') { '&' } else { '?' });
            out.push_str(&crate::artifacts::percent_encode(k));
            out.push('=');
            out.push_str(&crate::artifacts::percent_encode(v));
        }
        out
    }

    /// `text` with the query string and every query parameter value (raw and percent-decoded)
    /// replaced by `<redacted>`.
    pub fn scrub(&self, text: &str) -> String {
        let Some((_, query)) = self.0.split_once('?') else {
            return text.to_string();
        };
        let mut out = text.replace(query, "<redacted>");
        let mut secrets: Vec<String> = Vec::new();
        for pair in query.split('&') {
            let value = pair.split_once('=').map(|(_, v)| v).unwrap_or(pair);
            // short values (`sv=2023`, `sr=b`) are not secrets and would shred the message
            if value.len() >= 8 {
                secrets.push(value.to_string());
                secrets.push(percent_decode(value));
            }
        }
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        for s in secrets {
            if !s.is_empty() {
                out = out.replace(&s, "<redacted>");
            }
        }
        out
    }

    /// Sends a prepared request and maps the outcome: 2xx → Ok; HTTP errors → [`Error::Storage`]
    /// with the storage service's error code and message (XML `<Code>`/`<Message>` or ADLS JSON),
    /// never the raw body (S3 echoes the signature in `SignatureDoesNotMatch` bodies); transport
    /// errors → [`Error::Connection`]. Everything scrubbed.
    pub(crate) fn finish(&self, kind: &str, res: std::result::Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Result<()> {
        let endpoint = self.redacted();
        let mut resp = res.map_err(|e| Error::Connection { endpoint: endpoint.clone(), message: self.scrub(&e.to_string()) })?;
        let status = resp.status().as_u16();
        let body = resp.body_mut().with_config().limit(1 << 20).read_to_string().unwrap_or_default();
        if (200..300).contains(&status) {
            return Ok(());
        }
        let (code, message) = storage_error(&body);
        let mut message = self.scrub(&message);
        if status == 401 || status == 403 {
            message.push_str(" (the signed URL was refused: it may have expired)");
        }
        Err(Error::Storage { kind: kind.to_string(), url: endpoint, status, code: self.scrub(&code), message })
    }
}

impl fmt::Debug for SignedUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SignedUrl({})", self.redacted())
    }
}

impl fmt::Display for SignedUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// (code, message) of a storage error body: S3/GCS/Azure Blob XML or ADLS Gen2 JSON.
fn storage_error(body: &str) -> (String, String) {
    let tag = |name: &str| -> Option<String> {
        let open = format!("<{name}>");
        let start = body.find(&open)? + open.len();
        let end = body[start..].find(&format!("</{name}>"))? + start;
        Some(body[start..end].trim().to_string())
    };
    if let (Some(c), m) = (tag("Code"), tag("Message")) {
        return (c, m.unwrap_or_default());
    }
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(body) {
        let e = &v["error"];
        let s = |x: &serde_json::Value| x.as_str().unwrap_or("").to_string();
        if e.is_object() {
            return (s(&e["code"]), s(&e["message"]));
        }
    }
    (String::new(), body.chars().take(200).collect())
}


fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_prints_the_query() {
        let u = SignedUrl::new("https://acct.blob.core.windows.net/c/a.json?sv=2023-01-03&sig=AbC%2BdEf%3D1234&se=2026").unwrap();
        assert_eq!(u.redacted(), "https://acct.blob.core.windows.net/c/a.json?<redacted>");
        assert!(!format!("{u:?} {u}").contains("sig="));
        let s = u.scrub("failed: sig=AbC%2BdEf%3D1234 / decoded AbC+dEf=1234 / sv=2023-01-03&sig=AbC%2BdEf%3D1234&se=2026");
        assert!(!s.contains("AbC"), "{s}");
        assert_eq!(
            u.with_params(&[("comp", "block"), ("blockid", "b2s=")]),
            "https://acct.blob.core.windows.net/c/a.json?sv=2023-01-03&sig=AbC%2BdEf%3D1234&se=2026&comp=block&blockid=b2s%3D"
        );
        assert!(SignedUrl::new("file:///etc/passwd?x").unwrap_err().to_string().contains("<redacted>"));
    }

    #[test]
    fn storage_errors_keep_code_and_message_only() {
        let s3 = "<?xml version=\"1.0\"?><Error><Code>SignatureDoesNotMatch</Code><Message>nope</Message>\
                  <SignatureProvided>secret</SignatureProvided></Error>";
        assert_eq!(storage_error(s3), ("SignatureDoesNotMatch".into(), "nope".into()));
        let adls = r#"{"error":{"code":"AuthenticationFailed","message":"Signature expired"}}"#;
        assert_eq!(storage_error(adls), ("AuthenticationFailed".into(), "Signature expired".into()));
    }
}
