"""Cross-check of ortrain's Databricks artifact uploads against MLflow's own client.

There is no Databricks workspace here. A loopback stand-in (written here in Python; the Rust
tests in tracking/tests/databricks_artifacts.rs use one of the same design) answers the workspace
endpoints (`mlflow/runs/get`, `mlflow/artifacts/credentials-for-write`, `POST /dbfs/<path>`) and
plays the cloud storage behind the signed URLs it hands out (S3/GCS plain PUT, Azure Put Block +
Put Block List, ADLS Gen2 create/append/flush). Each test runs MLflow's client
(`MlflowClient("databricks").log_artifact`, with DATABRICKS_HOST/DATABRICKS_TOKEN pointing at the
stand-in) and then ortrain's Rust client through its Python binding on the same run, records what
each sent, and compares the shapes: workspace endpoint paths, the credentials-for-write JSON
body, the storage requests' methods, paths, added query parameters and headers, and the bytes
stored; then the list queries (`mlflow/artifacts/list`, `dbfs/list`) and their answers. Only
single-chunk files are compared (MLflow sends Azure/ADLS chunks from a thread pool, in no fixed
order; the multi-chunk sequences are checked in the Rust tests). Nothing here is verified against
a real workspace.
"""
from __future__ import annotations

import json
import posixpath
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("mlflow")

TOKEN = "dapi-PYTEST-TOKEN-0123456789"
SIGNATURE = "FAKESIG0123456789abcdef"
# Headers every HTTP library adds on its own, and MLflow's client-version tag: not part of the
# protocol being compared.
TRANSPORT = {"host", "user-agent", "accept", "accept-encoding", "connection", "x-mlflow-client-version"}
CRED_TYPES = {"run-aws": "AWS_PRESIGNED_URL", "run-gcp": "GCP_SIGNED_URL", "run-azure": "AZURE_SAS_URI",
              "run-adls": "AZURE_ADLS_GEN2_SAS_URI", "run-expired": "AWS_PRESIGNED_URL"}


class StandIn:
    """The workspace + storage stand-in; `requests` records (method, path, query, headers, body)."""

    def __init__(self):
        self.requests: list[dict] = []
        self.objects: dict[str, bytes] = {}
        self.blocks: dict[tuple[str, str], bytes] = {}
        self.lock = threading.Lock()
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _serve(self):
                url = urllib.parse.urlsplit(self.path)
                body = b""
                if "chunked" in self.headers.get("Transfer-Encoding", ""):
                    while True:
                        n = int(self.rfile.readline().strip(), 16)
                        chunk = self.rfile.read(n + 2)[:n]
                        if n == 0:
                            break
                        body += chunk
                else:
                    body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                req = {"method": self.command, "path": urllib.parse.unquote(url.path),
                       "query": dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True)),
                       "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body}
                with standin.lock:
                    standin.requests.append(req)
                    status, ctype, out = standin.handle(req, self.server.server_address[1])
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_PUT = do_PATCH = _serve

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def handle(self, req, port):
        def js(status, obj):
            return status, "application/json", json.dumps(obj).encode()

        path, q = req["path"], req["query"]
        if path.startswith(("/api/", "/dbfs/")) and req["headers"].get("authorization") != f"Bearer {TOKEN}":
            return js(401, {"error_code": "UNAUTHENTICATED", "message": "bad token"})
        if path == "/api/2.0/mlflow/runs/get":
            run = q.get("run_id", "")
            uri = ("dbfs:/mnt/team/artifacts/run-dbfs" if run == "run-dbfs"
                   else f"dbfs:/databricks/mlflow-tracking/42/{run}/artifacts")
            return js(200, {"run": {"info": {"run_id": run, "run_uuid": run, "experiment_id": "42",
                                             "status": "RUNNING", "artifact_uri": uri}, "data": {}}})
        if path == "/api/2.0/mlflow/artifacts/credentials-for-write":
            body = json.loads(req["body"] or b"{}")
            run = body.get("run_id", "")
            infos = [{"run_id": run, "path": p, "type": CRED_TYPES.get(run, "AWS_PRESIGNED_URL"),
                      "signed_uri": f"http://127.0.0.1:{port}/storage/{run}/{urllib.parse.quote(p)}"
                                    f"?X-Amz-Expires=600&X-Amz-Signature={SIGNATURE}",
                      "headers": [{"name": "x-amz-server-side-encryption", "value": "AES256"},
                                  {"name": "x-ms-encryption-scope", "value": "scope1"}]}
                     for p in body.get("path", [])]
            return js(200, {"credential_infos": infos})
        if path == "/api/2.0/mlflow/logged-models/search":  # MlflowClient.list_artifacts also asks this
            return js(200, {"models": []})
        if path == "/api/2.0/mlflow/artifacts/list":
            prefix, d = f"/storage/{q.get('run_id', '')}/", q.get("path", "")
            files = [{"path": k[len(prefix):], "is_dir": False, "file_size": len(v)}
                     for k, v in self.objects.items()
                     if k.startswith(prefix) and posixpath.dirname(k[len(prefix):]) == d]
            return js(200, {"files": files})
        if path == "/api/2.0/dbfs/list":
            d = q.get("path", "")
            files = [{"path": k[len("/dbfs"):], "is_dir": False, "file_size": len(v)}
                     for k, v in self.objects.items() if posixpath.dirname(k) == f"/dbfs{d}"]
            if not files:
                return js(404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": d})
            return js(200, {"files": files})
        if path.startswith("/dbfs/") and req["method"] == "POST":
            self.objects[path] = req["body"]
            return js(200, {})
        if path.startswith("/storage/"):
            return self.storage(req)
        return js(404, {"error_code": "ENDPOINT_NOT_FOUND", "message": f"{req['method']} {path}"})

    def storage(self, req):
        path, q, m = req["path"], req["query"], req["method"]

        def xml(status, code, msg):
            return status, "application/xml", (f"<Error><Code>{code}</Code><Message>{msg}</Message>"
                                               f"<SignatureProvided>{SIGNATURE}</SignatureProvided></Error>").encode()

        if q.get("X-Amz-Signature") != SIGNATURE:
            return xml(403, "SignatureDoesNotMatch", "missing signature")
        if path.startswith("/storage/run-expired/"):
            return xml(403, "AccessDenied", "Request has expired")
        if m == "PUT" and q.get("comp") == "block":
            self.blocks[(path, q["blockid"])] = req["body"]
        elif m == "PUT" and q.get("comp") == "blocklist":
            ids = [s.split("</Uncommitted>")[0] for s in req["body"].decode().split("<Uncommitted>")[1:]]
            self.objects[path] = b"".join(self.blocks[(path, i)] for i in ids)
        elif m == "PUT" and q.get("resource") == "file":
            self.objects[path] = b""
        elif m == "PATCH" and q.get("action") == "append":
            assert int(q["position"]) == len(self.objects[path])
            self.objects[path] += req["body"]
        elif m == "PATCH" and q.get("action") == "flush":
            pass
        elif m == "PUT" and not {"comp", "resource", "action"} & q.keys():
            self.objects[path] = req["body"]
        else:
            return xml(400, "UnsupportedOperation", "unknown request")
        return 201, "application/xml", b""

    def take(self):
        with self.lock:
            out, self.requests = self.requests, []
            return out


def shape(requests):
    """What must match between the two clients: workspace endpoints (method, path) in first-use
    order, the credentials-for-write bodies, and each upload's (storage or `POST /dbfs/…`) method,
    path, query keys added to the signed URL, protocol headers and body length."""
    workspace, creds, storage = [], [], []
    for r in requests:
        if r["path"].startswith(("/storage/", "/dbfs/")):
            added = sorted(set(r["query"]) - {"X-Amz-Expires", "X-Amz-Signature"})
            fixed = {k: r["query"][k] for k in added if k not in ("blockid",)}
            headers = {k: v for k, v in r["headers"].items() if k not in TRANSPORT}
            storage.append((r["method"], r["path"], added, fixed, headers, len(r["body"])))
        elif not r["path"].startswith("/.well-known/"):  # the Databricks SDK's own config discovery
            if (r["method"], r["path"]) not in workspace:
                workspace.append((r["method"], r["path"]))
            if r["path"].endswith("credentials-for-write"):
                creds.append(json.loads(r["body"]))
    return {"workspace": workspace, "credentials_for_write": creds, "storage": storage}


@pytest.fixture
def standin(monkeypatch, tmp_path):
    s = StandIn()
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.databrickscfg of the machine's user
    for k in ("DATABRICKS_CONFIG_PROFILE", "DATABRICKS_CONFIG_FILE", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DATABRICKS_HOST", s.url)
    monkeypatch.setenv("DATABRICKS_TOKEN", TOKEN)
    # MLflow ≥ 2.20 first tries the Databricks SDK's Files API for run artifacts and falls back to
    # DatabricksArtifactRepository (credentials-for-write + signed URLs), the protocol ortrain
    # speaks; pin MLflow to that path so the two are compared like for like.
    monkeypatch.setenv("MLFLOW_DISABLE_DATABRICKS_SDK_FOR_RUN_ARTIFACTS", "true")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    yield s
    s.server.shutdown()


def both_clients(standin, run_id, local, artifact_path):
    """Runs MLflow's client, then ortrain's, on the same run; returns their recorded requests and
    the objects each stored."""
    from mlflow import MlflowClient

    from ortrain import _ortrain

    MlflowClient(tracking_uri="databricks").log_artifact(run_id, str(local), artifact_path)
    theirs, their_objects = standin.take(), dict(standin.objects)
    standin.objects.clear()
    _ortrain.MlflowClient("databricks").log_artifact(run_id, str(local), artifact_path)
    return theirs, their_objects, standin.take(), dict(standin.objects)


@pytest.mark.parametrize("run_id", ["run-aws", "run-gcp", "run-azure", "run-adls", "run-dbfs"])
def test_request_shapes_match_mlflow(standin, tmp_path, run_id):
    local = tmp_path / "summary one.json"
    local.write_bytes(json.dumps({"speedup": 2.0, "pad": "x" * 5000}).encode())
    theirs, their_objects, ours, our_objects = both_clients(standin, run_id, local, "compare")
    assert their_objects == our_objects and list(our_objects.values()) == [local.read_bytes()]
    t, o = shape(theirs), shape(ours)
    assert o["credentials_for_write"] == t["credentials_for_write"]
    assert o["storage"] == t["storage"], json.dumps({"mlflow": t["storage"], "ortrain": o["storage"]}, indent=1)
    assert o["workspace"] == t["workspace"]
    for r in theirs + ours:
        if r["path"].startswith("/.well-known/"):
            continue  # MLflow's Databricks SDK probing the host, unauthenticated
        on_workspace = not r["path"].startswith("/storage/")
        assert (r["headers"].get("authorization") == f"Bearer {TOKEN}") == on_workspace, r["path"]


@pytest.mark.parametrize("run_id", ["run-aws", "run-dbfs"])
def test_listing_matches_mlflow(standin, tmp_path, run_id):
    """Listing a managed run goes to `mlflow/artifacts/list`, a plain DBFS root to `dbfs/list`;
    the same queries and the same answer from both clients."""
    from mlflow import MlflowClient

    from ortrain import _ortrain

    local = tmp_path / "summary.json"
    local.write_text("{}")
    _ortrain.MlflowClient("databricks").log_artifact(run_id, str(local), "compare")
    standin.take()
    theirs = [(f.path, f.is_dir, f.file_size) for f in MlflowClient(tracking_uri="databricks").list_artifacts(run_id, "compare")]
    their_queries = [(r["path"], r["query"]) for r in standin.take() if "list" in r["path"]]
    ours = _ortrain.MlflowClient("databricks").list_artifacts(run_id, "compare")
    our_queries = [(r["path"], r["query"]) for r in standin.take() if "list" in r["path"]]
    assert ours == theirs == [("compare/summary.json", False, 2)]
    assert our_queries == their_queries and len(our_queries) == 1, (our_queries, their_queries)


def test_expired_signed_url(standin, tmp_path):
    """MLflow's error for a refused S3 URL quotes the URL with its signature (requests' HTTPError
    text) and the response body; ortrain's names the URL with the query redacted. MLflow does not
    refresh an AWS/GCP credential on 403 (only Azure); ortrain asks once more, then fails."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from ortrain import _ortrain

    local = tmp_path / "a.json"
    local.write_text("{}")
    with pytest.raises(MlflowException) as theirs:
        MlflowClient(tracking_uri="databricks").log_artifact("run-expired", str(local))
    assert "403" in str(theirs.value) and SIGNATURE in str(theirs.value), "MLflow's message quotes the signed URL"
    mlflow_requests = shape(standin.take())
    with pytest.raises(RuntimeError) as ours:
        _ortrain.MlflowClient("databricks").log_artifact("run-expired", str(local))
    msg = str(ours.value)
    assert "HTTP 403 AccessDenied" in msg and "/storage/run-expired/a.json?<redacted>" in msg, msg
    assert SIGNATURE not in msg and TOKEN not in msg, msg
    our_requests = shape(standin.take())
    assert len(mlflow_requests["storage"]) == 1 and len(our_requests["storage"]) == 2
    assert our_requests["storage"][0] == mlflow_requests["storage"][0]
