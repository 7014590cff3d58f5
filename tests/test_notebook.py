"""notebooks/tutorial_transformer.ipynb executed headless by nbclient in a real IPython kernel
against a real MLflow server, then checked through the REST API: one parent run with two child
runs, per-step histories of the expected length, params, tags and the parent's artifacts.
The accelerated child ran in the engine (its explain line says which exporter ran), starting
from the same state as the baseline."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import runs_of

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "tutorial_transformer.ipynb"
STEPS = 4

@pytest.fixture(scope="module")
def executed(mlflow_server, tmp_path_factory):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {"ORTRAIN_TRACKING_URI": mlflow_server.uri, "ORTRAIN_TUTORIAL_STEPS": str(STEPS),
           "ORTRAIN_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    workdir = tmp_path_factory.mktemp("nb")
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def outputs(nb) -> str:
    text = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            text.append(o.get("text", "") or o.get("data", {}).get("text/plain", ""))
    return "\n".join(text)


def test_parent_and_two_children_in_mlflow(executed, client):
    nb = executed
    out = outputs(nb)
    assert "pydoc_data.topics (offline)" in out
    runs = runs_of(client, "tutorial")
    parents = [r for r in runs if "mlflow.parentRunId" not in r["tags"]]
    assert len(parents) == 1, [r["run_name"] for r in runs]
    parent = parents[0]
    kids = {r["tags"]["ortrain.role"]: r for r in runs if r["tags"].get("mlflow.parentRunId") == parent["run_id"]}
    assert set(kids) == {"baseline", "accelerated"}
    assert parent["status"] == "FINISHED" and all(k["status"] == "FINISHED" for k in kids.values())
    group = parent["tags"]["ortrain.compare_group"]
    print(f"parent run {parent['run_id']}")
    for role, run in kids.items():
        assert run["tags"]["ortrain.compare_group"] == group
        counts = {}
        for key in ("batch_time_ms", "loss", "ppl", "learning_rate", "samples_per_sec", "tokens_per_sec"):
            hist = client.get_metric_history(run["run_id"], key)
            assert [s for s, _, _ in hist] == list(range(STEPS)), (role, key)
            counts[key] = len(hist)
        print(f"{role} run {run['run_id']}: metric values read back {counts}")
        p = run["params"]
        assert p["model_class"] == "TransformerModel" and p["optimizer"] == "Adam"
        assert p["optimizer.lr"] == "0.001" and p["batch_shape"] == "35x20" and p["batch_size"] == "20"
        assert int(p["parameter_count"]) > 1_000_000 and p["precision"] == "float32"
    files = dict((path, size) for path, _, size in client.list_artifacts(parent["run_id"], "compare"))
    assert files.get("compare/summary.json") and files.get("compare/loss_and_batch_time.png", 0) > 1000
    # the inline table and plot
    assert "median ms" in out and "speedup" in out
    print(out)
    assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


def test_compare_starts_both_runs_from_the_same_state(executed, client):
    runs = runs_of(client, "tutorial")
    by_role = {r["tags"].get("ortrain.role"): r for r in runs}
    base = [v for _, v, _ in client.get_metric_history(by_role["baseline"]["run_id"], "loss")]
    acc = [v for _, v, _ in client.get_metric_history(by_role["accelerated"]["run_id"], "loss")]
    # same weights and data; dropout masks differ (the engine draws its own), so the first
    # losses agree to dropout noise, far closer than two different initialisations would
    assert abs(base[0] - acc[0]) / base[0] < 0.02, (base, acc)


def test_accelerated_half_ran_in_the_engine(executed, client):
    nb = executed
    out = outputs(nb)
    assert "ortrain engine: [train] exporter" in out and "peak arena" in out, out[-2000:]
    assert "runs in PyTorch" not in out, out[-2000:]
    runs = runs_of(client, "tutorial")
    acc = next(r for r in runs if r["tags"].get("ortrain.role") == "accelerated")
    assert acc["status"] == "FINISHED"
    assert len(client.get_metric_history(acc["run_id"], "batch_time_ms")) == STEPS
