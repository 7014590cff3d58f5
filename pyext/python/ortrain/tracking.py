"""Where ortrain's metrics go, and the Python face of the Rust tracking client.

Tracking URI resolution (first match wins): the explicit argument (`--tracking-uri`), then
$ORTRAIN_TRACKING_URI, then $MLFLOW_TRACKING_URI, then `databricks` on a Databricks cluster,
else the embedded default: one local
`mlflow server` per kernel (sqlite store ./mlflow.db, artifacts ./mlartifacts in the working
directory, a free loopback port), started on first use, announced once, stopped at exit.
`http(s)://...` names a server; `databricks` / `databricks://PROFILE` a Databricks workspace.
Only the REST client (Rust) talks to MLflow: the mlflow Python package is never imported here.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

__all__ = ["resolve_tracking_uri", "client", "EmbeddedServer", "embedded_server", "ui_url"]

_ENV_KEYS = ("ORTRAIN_TRACKING_URI", "MLFLOW_TRACKING_URI")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mlflow_command() -> list:
    """The `mlflow` CLI of this interpreter's environment (the kernel's)."""
    beside = Path(sys.executable).with_name("mlflow")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("mlflow")
    if found:
        return [found]
    return [sys.executable, "-m", "mlflow"]


class EmbeddedServer:
    """A local `mlflow server` owned by this process (sqlite store + proxied artifacts)."""

    def __init__(self, workdir: str | os.PathLike | None = None, port: int | None = None):
        self.workdir = Path(workdir or os.getcwd()).resolve()
        self.port = port or _free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "mlflow-server.log"

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 120.0) -> "EmbeddedServer":
        if self.alive():
            return self
        db = self.workdir / "mlflow.db"
        cmd = _mlflow_command() + [
            "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{db}",
            "--artifacts-destination", str(self.workdir / "mlartifacts"),
        ]
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(cmd, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the local MLflow server exited with code {self.proc.returncode}; "
                                   f"see {self.log_path}")
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the local MLflow server did not start within {timeout:.0f} s; see {self.log_path}")

    def stop(self, timeout: float = 3.0) -> None:
        """SIGTERM to the server's process group, SIGKILL to whatever is left after `timeout`."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                continue
            # the leader is gone; its workers share the group: make sure they go too
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            break


_EMBEDDED: EmbeddedServer | None = None


def embedded_server(start: bool = True) -> EmbeddedServer | None:
    """The kernel's embedded server (started once, reused, stopped at exit)."""
    global _EMBEDDED
    if _EMBEDDED is not None and _EMBEDDED.alive():
        return _EMBEDDED
    if not start:
        return None
    server = EmbeddedServer().start()
    if _EMBEDDED is None:
        atexit.register(_stop_embedded)
    _EMBEDDED = server
    print(f"ortrain: started a local MLflow server (store {server.workdir / 'mlflow.db'}); "
          f"UI at {server.uri}", flush=True)
    return server


def _stop_embedded() -> None:
    if _EMBEDDED is not None:
        _EMBEDDED.stop()


def resolve_tracking_uri(uri: str | None = None, *, start: bool = True) -> str:
    """The tracking URI to use (see the module docstring)."""
    if uri:
        return uri.strip()
    for key in _ENV_KEYS:
        v = os.environ.get(key, "").strip()
        if v:
            return v
    if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        return "databricks"  # on a Databricks cluster, runs belong in the workspace
    server = embedded_server(start=start)
    return server.uri if server else "(embedded local server, not started yet)"


def client(uri: str | None = None, timeout_s: float = 30.0):
    """A Rust `MlflowClient` for the resolved tracking URI."""
    from ortrain._ortrain import MlflowClient

    return MlflowClient(resolve_tracking_uri(uri), timeout_s)


def ui_url(tracking_uri: str, experiment_id: str, run_id: str | None = None) -> str:
    """A link to an experiment (or a run) in the MLflow UI of an http(s) server."""
    base = tracking_uri.rstrip("/")
    if not base.startswith(("http://", "https://")):
        host = os.environ.get("DATABRICKS_HOST", "").rstrip("/")
        base = host if host.startswith("http") else (f"https://{host}" if host else base)
        return f"{base}/ml/experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "")
    return f"{base}/#/experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "")
