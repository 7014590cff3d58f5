"""notebooks/tutorial_transformer.ipynb executed headless by nbclient in a real IPython kernel
against a real MLflow server, then checked through the REST API: one parent run with two child
runs, per-step histories of the expected length, params, tags and the parent's artifacts.

Until the engine is merged (`ortrain.accelerate` missing), the test installs a stand-in engine
that leaves the model in PyTorch, so that the whole compare machinery (state snapshot and
restore, parent/child runs, table, plot, artifacts) runs for real; the identical loss curves of
both children then prove the restore. The accelerated half's own checks skip with the reason
"engine not merged yet"."""
from __future__ import annotations

import json
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

STAND_IN = """
import ortrain.magics as _m
_acc = set()
_m._TEST_ENGINE = {
    "accelerate": lambda model, optimizer=None, *, device="cpu", strict=False: (_acc.add(id(model)), model)[1],
    "deaccelerate": lambda model: (_acc.discard(id(model)), model)[1],
    "is_accelerated": lambda model: id(model) in _acc,
    "explain": lambda model: "stand-in engine: PyTorch",
}
"""


def engine_available() -> bool:
    try:
        import ortrain

        ortrain.accelerate  # noqa: B018
        return True
    except (ImportError, AttributeError):
        return False


@pytest.fixture(scope="module")
def executed(mlflow_server, tmp_path_factory):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    stand_in = not engine_available()
    if stand_in:
        nb.cells.insert(1, nbformat.v4.new_code_cell(STAND_IN))
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
    return nb, stand_in


def outputs(nb) -> str:
    text = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            text.append(o.get("text", "") or o.get("data", {}).get("text/plain", ""))
    return "\n".join(text)


def test_parent_and_two_children_in_mlflow(executed, client):
    nb, _ = executed
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
    for role, run in kids.items():
        assert run["tags"]["ortrain.compare_group"] == group
        for key in ("batch_time_ms", "loss", "ppl", "learning_rate", "samples_per_sec", "tokens_per_sec"):
            hist = client.get_metric_history(run["run_id"], key)
            assert [s for s, _, _ in hist] == list(range(STEPS)), (role, key)
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
    nb, stand_in = executed
    if not stand_in:
        pytest.skip("with the real engine the losses agree only to tolerance (checked by the parity tests)")
    runs = runs_of(client, "tutorial")
    by_role = {r["tags"].get("ortrain.role"): r for r in runs}
    base = [v for _, v, _ in client.get_metric_history(by_role["baseline"]["run_id"], "loss")]
    acc = [v for _, v, _ in client.get_metric_history(by_role["accelerated"]["run_id"], "loss")]
    assert base == acc  # same weights, optimizer state, RNG (dropout) and data: identical


def test_accelerated_half(executed, client):
    nb, stand_in = executed
    if stand_in:
        pytest.skip("engine not merged yet")
    runs = runs_of(client, "tutorial")
    acc = next(r for r in runs if r["tags"].get("ortrain.role") == "accelerated")
    assert acc["params"]["engine_device"] in ("cpu", "cuda")
    summary = json.loads(json.dumps(acc))
    assert summary["status"] == "FINISHED"
