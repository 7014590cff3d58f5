"""The Rust tracking client through its Python binding, against a real MLflow server: batching
limits, non-finite values, artifacts, the background logger, key validation, and the replay
CLI (`python -m ortrain.mlflow replay`) on a spill written while no server was listening."""
from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time

import pytest

from ortrain import _ortrain


def test_batches_are_split_at_mlflow_limits(client):
    exp = client.get_or_create_experiment("py-batching")
    run = client.create_run(exp, "batching", {"k": "v"})
    ts = int(time.time() * 1000)
    metrics = [("m", float(i), i, ts) for i in range(2500)] + [("m2", math.nan, 0, ts), ("m2", math.inf, 1, ts)]
    assert client.log_batch(run, metrics, {f"p{i}": str(i) for i in range(120)}) == 3
    hist = client.get_metric_history(run, "m")
    assert [s for s, _, _ in hist] == list(range(2500))
    nan, inf = client.get_metric_history(run, "m2")
    assert math.isnan(nan[1]) and inf[1] > 1e300
    got = client.get_run(run)
    assert len(got["params"]) == 120 and got["tags"]["k"] == "v"
    client.update_run(run, "FINISHED")
    assert client.get_run(run)["status"] == "FINISHED"


def test_artifacts_and_bad_keys(client, tmp_path):
    exp = client.get_or_create_experiment("py-artifacts")
    run = client.create_run(exp)
    f = tmp_path / "summary.json"
    f.write_text(json.dumps({"speedup": 1.5}))
    client.log_artifact(run, str(f), "compare")
    assert client.list_artifacts(run, "compare") == [("compare/summary.json", False, f.stat().st_size)]
    with pytest.raises(ValueError, match=r'invalid metric key "bad key!"'):
        client.log_batch(run, [("bad key!", 1.0, 0, 0)])
    with pytest.raises(ValueError, match="status"):
        client.update_run(run, "DONE")


def test_logger_never_blocks_and_spills_then_replays(client, tmp_path):
    exp = client.get_or_create_experiment("py-spill")
    run = client.create_run(exp, "spill")
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    spill = tmp_path / "spill.jsonl"
    log = _ortrain.MetricLogger(_ortrain.MlflowClient(dead), run, flush_interval_ms=10, max_retries=1,
                                initial_backoff_ms=5, spill_path=str(spill))
    t = time.perf_counter()
    for i in range(500):
        log.log_metric("loss", 1.0 / (i + 1), i)
    assert time.perf_counter() - t < 0.5
    stats = log.end_run("FINISHED")
    log.close()
    assert stats["metrics_spilled"] == 500 and stats["spill_path"] == str(spill)
    assert "cannot reach MLflow" in stats["last_error"]
    out = subprocess.run([sys.executable, "-m", "ortrain.mlflow", "replay", str(spill), "--tracking-uri",
                          client.base_url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "replayed 500 metrics" in out.stdout and "1 runs ended" in out.stdout
    assert len(client.get_metric_history(run, "loss")) == 500
    assert client.get_run(run)["status"] == "FINISHED"
    assert not spill.exists() and (tmp_path / "spill.jsonl.replayed").exists()
    bad = subprocess.run([sys.executable, "-m", "ortrain.mlflow", "replay", str(tmp_path / "missing.jsonl"),
                          "--tracking-uri", client.base_url], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "missing.jsonl" in bad.stderr


def test_databricks_token_never_printed(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DATABRICKS_HOST", "https://adb-123.azuredatabricks.net")
    monkeypatch.setenv("DATABRICKS_TOKEN", "dapiTOPSECRET")
    c = _ortrain.MlflowClient("databricks", timeout_s=0.5)
    assert c.is_databricks and c.base_url == "https://adb-123.azuredatabricks.net"
    assert "dapiTOPSECRET" not in repr(c)
    monkeypatch.delenv("DATABRICKS_TOKEN")
    with pytest.raises(ValueError, match="DATABRICKS_TOKEN") as e:
        _ortrain.MlflowClient("databricks")
    assert "dapi" not in str(e.value)


def test_import_is_fast_and_lazy():
    code = "import sys, time; t=time.perf_counter(); import ortrain; dt=time.perf_counter()-t; " \
           "print(dt, 'torch' in sys.modules, 'mlflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.split()
    assert out[1:] == ["False", "False"]
    assert float(out[0]) < 0.5
