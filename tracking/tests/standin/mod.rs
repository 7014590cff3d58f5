//! A loopback stand-in for a Databricks workspace and its cloud storage, for the artifact tests:
//! `mlflow/runs/get`, `mlflow/artifacts/credentials-for-write`, `mlflow/artifacts/list`,
//! `dbfs/list`, `POST /dbfs/<path>`, and a storage endpoint under `/storage/` that behaves like S3 /
//! GCS (plain PUT), Azure Blob (Put Block + Put Block List) and ADLS Gen2 (create, append, flush)
//! behind signed URLs whose query carries a fake signature. Every request is recorded.
//!
//! The run id picks the behaviour: `run-aws`, `run-gcp`, `run-azure`, `run-adls` (credential of
//! that type), `run-expired` (storage answers 403 like an expired S3 URL), `run-flaky` (the first
//! PUT gets 503), `run-weird` (an unknown credential type), `run-dbfs` (artifact root on plain DBFS).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

pub const TOKEN: &str = "dapi-TEST-TOKEN-0123456789";
pub const SIGNATURE: &str = "FAKESIG0123456789abcdef";

#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub query: Vec<(String, String)>,
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|s| s.as_str())
    }
    pub fn param(&self, name: &str) -> Option<&str> {
        self.query.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

#[derive(Default)]
pub struct State {
    pub requests: Vec<Request>,
    /// Stored objects by storage path (`/storage/<run>/<artifact path>` or `/dbfs/<path>`).
    pub objects: BTreeMap<String, Vec<u8>>,
    /// Azure uncommitted blocks by (object, block id).
    blocks: BTreeMap<(String, String), Vec<u8>>,
    flaky_done: bool,
}

pub struct StandIn {
    pub port: u16,
    pub state: Arc<Mutex<State>>,
}

impl StandIn {
    pub fn start() -> StandIn {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(Mutex::new(State::default()));
        let st = state.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let st = st.clone();
                std::thread::spawn(move || serve(stream, port, st));
            }
        });
        StandIn { port, state }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn requests(&self) -> Vec<Request> {
        self.state.lock().unwrap().requests.clone()
    }

    pub fn object(&self, path: &str) -> Option<Vec<u8>> {
        self.state.lock().unwrap().objects.get(path).cloned()
    }

    pub fn clear(&self) {
        self.state.lock().unwrap().requests.clear();
    }
}

fn serve(stream: TcpStream, port: u16, state: Arc<Mutex<State>>) {
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut writer = stream;
    loop {
        let Some(req) = read_request(&mut reader) else { return };
        let (status, ctype, body) = handle(&req, port, &state);
        state.lock().unwrap().requests.push(req);
        let head =
            format!("HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: keep-alive\r\n\r\n", body.len());
        if writer.write_all(head.as_bytes()).and_then(|_| writer.write_all(&body)).is_err() {
            return;
        }
    }
}

fn read_request(r: &mut BufReader<TcpStream>) -> Option<Request> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let target = parts.next()?.to_string();
    let mut headers = BTreeMap::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h).ok()?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (k, v) = h.split_once(':')?;
        headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
    }
    let mut body = Vec::new();
    if headers.get("transfer-encoding").map(|v| v.contains("chunked")).unwrap_or(false) {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).ok()?;
            let n = usize::from_str_radix(size.trim(), 16).ok()?;
            let mut chunk = vec![0; n + 2];
            r.read_exact(&mut chunk).ok()?;
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    } else if let Some(n) = headers.get("content-length").and_then(|v| v.parse::<usize>().ok()) {
        body = vec![0; n];
        r.read_exact(&mut body).ok()?;
    }
    let (path, q) = target.split_once('?').unwrap_or((&target, ""));
    let query = q
        .split('&')
        .filter(|s| !s.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (decode(k), decode(v))
        })
        .collect();
    Some(Request { method, path: decode(path), query, headers, body })
}

pub fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn json(status: u16, v: serde_json::Value) -> (u16, &'static str, Vec<u8>) {
    (status, "application/json", v.to_string().into_bytes())
}

fn artifact_uri(run: &str) -> String {
    if run == "run-dbfs" {
        "dbfs:/mnt/team/artifacts/run-dbfs".into()
    } else {
        format!("dbfs:/databricks/mlflow-tracking/42/{run}/artifacts")
    }
}

fn credential_type(run: &str) -> &'static str {
    match run {
        "run-gcp" => "GCP_SIGNED_URL",
        "run-azure" => "AZURE_SAS_URI",
        "run-adls" => "AZURE_ADLS_GEN2_SAS_URI",
        "run-weird" => "R2_PRESIGNED_URL",
        _ => "AWS_PRESIGNED_URL",
    }
}

fn handle(req: &Request, port: u16, state: &Arc<Mutex<State>>) -> (u16, &'static str, Vec<u8>) {
    let workspace = req.path.starts_with("/api/") || req.path.starts_with("/dbfs/");
    if workspace && req.header("authorization") != Some(&format!("Bearer {TOKEN}")) {
        return json(401, serde_json::json!({"error_code": "UNAUTHENTICATED", "message": "bad token"}));
    }
    let mut st = state.lock().unwrap();
    match (req.method.as_str(), req.path.as_str()) {
        ("GET", "/api/2.0/mlflow/runs/get") => {
            let run = req.param("run_id").unwrap_or("");
            json(
                200,
                serde_json::json!({"run": {"info": {"run_id": run, "experiment_id": "42", "status": "RUNNING",
                    "artifact_uri": artifact_uri(run)}, "data": {}}}),
            )
        }
        ("POST", "/api/2.0/mlflow/artifacts/credentials-for-write") => {
            let body: serde_json::Value = serde_json::from_slice(&req.body).unwrap_or_default();
            let run = body["run_id"].as_str().unwrap_or("").to_string();
            let infos: Vec<serde_json::Value> = body["path"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .map(|p| {
                    let p = p.as_str().unwrap_or("");
                    let enc: Vec<String> = p.split('/').map(|s| s.replace(' ', "%20")).collect();
                    serde_json::json!({
                        "run_id": run, "path": p, "type": credential_type(&run),
                        "signed_uri": format!("http://127.0.0.1:{port}/storage/{run}/{}?X-Amz-Expires=600&X-Amz-Signature={SIGNATURE}", enc.join("/")),
                        "headers": [{"name": "x-amz-server-side-encryption", "value": "AES256"},
                                    {"name": "x-ms-encryption-scope", "value": "scope1"}],
                    })
                })
                .collect();
            json(200, serde_json::json!({ "credential_infos": infos }))
        }
        ("GET", "/api/2.0/mlflow/artifacts/list") => {
            let run = req.param("run_id").unwrap_or("");
            let dir = req.param("path").unwrap_or("");
            let prefix = format!("/storage/{run}/");
            let files: Vec<serde_json::Value> = st
                .objects
                .iter()
                .filter_map(|(k, v)| k.strip_prefix(&prefix).map(|p| (p.to_string(), v.len())))
                .filter(|(p, _)| p.rsplit_once('/').map(|(d, _)| d).unwrap_or("") == dir)
                .map(|(p, n)| serde_json::json!({"path": p, "is_dir": false, "file_size": n}))
                .collect();
            json(200, serde_json::json!({ "files": files }))
        }
        ("GET", "/api/2.0/dbfs/list") => {
            let dir = req.param("path").unwrap_or("").to_string();
            let prefix = format!("/dbfs{dir}/");
            let files: Vec<serde_json::Value> = st
                .objects
                .iter()
                .filter_map(|(k, v)| k.strip_prefix(&prefix).map(|rest| (rest.to_string(), v.len())))
                .map(|(rest, n)| match rest.split_once('/') {
                    Some((d, _)) => serde_json::json!({"path": format!("{dir}/{d}"), "is_dir": true, "file_size": 0}),
                    None => serde_json::json!({"path": format!("{dir}/{rest}"), "is_dir": false, "file_size": n}),
                })
                .collect();
            if files.is_empty() {
                return json(404, serde_json::json!({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "No file or directory exists"}));
            }
            json(200, serde_json::json!({ "files": files }))
        }
        ("POST", p) if p.starts_with("/dbfs/") => {
            st.objects.insert(p.to_string(), req.body.clone());
            json(200, serde_json::json!({}))
        }
        (m, p) if p.starts_with("/storage/") => storage(&mut st, m, p, req),
        _ => json(404, serde_json::json!({"error_code": "ENDPOINT_NOT_FOUND", "message": format!("{} {}", req.method, req.path)})),
    }
}

fn storage(st: &mut State, method: &str, path: &str, req: &Request) -> (u16, &'static str, Vec<u8>) {
    let xml = |status: u16, code: &str, msg: &str| {
        let b = format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code><Message>{msg}</Message>\
             <SignatureProvided>{SIGNATURE}</SignatureProvided></Error>"
        );
        (status, "application/xml", b.into_bytes())
    };
    if req.param("X-Amz-Signature") != Some(SIGNATURE) {
        return xml(403, "SignatureDoesNotMatch", "missing signature");
    }
    let run = path.trim_start_matches("/storage/").split('/').next().unwrap_or("");
    match run {
        "run-expired" => return xml(403, "AccessDenied", "Request has expired"),
        "run-flaky" if !st.flaky_done => {
            st.flaky_done = true;
            return xml(503, "SlowDown", "Please reduce your request rate.");
        }
        _ => {}
    }
    let ok = (201, "application/xml", Vec::new());
    match (method, req.param("comp"), req.param("resource"), req.param("action")) {
        ("PUT", Some("block"), _, _) => {
            let id = req.param("blockid").unwrap_or("").to_string();
            st.blocks.insert((path.to_string(), id), req.body.clone());
            ok
        }
        ("PUT", Some("blocklist"), _, _) => {
            let text = String::from_utf8_lossy(&req.body).to_string();
            let mut data = Vec::new();
            for piece in text.split("<Uncommitted>").skip(1) {
                let id = piece.split("</Uncommitted>").next().unwrap_or("");
                match st.blocks.get(&(path.to_string(), id.to_string())) {
                    Some(b) => data.extend_from_slice(b),
                    None => return xml(400, "InvalidBlockList", "unknown block"),
                }
            }
            st.objects.insert(path.to_string(), data);
            ok
        }
        ("PUT", None, Some("file"), _) => {
            st.objects.insert(path.to_string(), Vec::new());
            ok
        }
        ("PATCH", None, None, Some("append")) => {
            let pos: usize = req.param("position").and_then(|p| p.parse().ok()).unwrap_or(usize::MAX);
            let Some(obj) = st.objects.get_mut(path) else { return xml(404, "PathNotFound", "create first") };
            if pos != obj.len() {
                return xml(400, "InvalidFlushPosition", "bad position");
            }
            obj.extend_from_slice(&req.body);
            (202, "application/json", Vec::new())
        }
        ("PATCH", None, None, Some("flush")) => ok,
        ("PUT", None, None, None) => {
            st.objects.insert(path.to_string(), req.body.clone());
            (200, "application/xml", Vec::new())
        }
        _ => xml(400, "UnsupportedOperation", "stand-in does not know this request"),
    }
}
