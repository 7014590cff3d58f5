"""Shared fixtures: the test folder on sys.path (for the model zoo), torch threads matched to the
machine, a real MLflow server (session-wide, sqlite store in a temp dir, free loopback port) and
an in-process IPython shell with `%load_ext ortrain`, pointed at that server."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _torch_threads():
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield


def pytest_configure(config):
    os.environ.setdefault("ORTRAIN_OFFLINE", "1")


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    from ortrain.tracking import EmbeddedServer

    server = EmbeddedServer(tmp_path_factory.mktemp("mlflow")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def client(mlflow_server):
    from ortrain._ortrain import MlflowClient

    return MlflowClient(mlflow_server.uri)


@pytest.fixture
def shell(mlflow_server, monkeypatch, tmp_path):
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setenv("ORTRAIN_TRACKING_URI", mlflow_server.uri)
    monkeypatch.chdir(tmp_path)
    sh = InteractiveShell.instance()
    if "ortrain" not in sh.extension_manager.loaded:
        sh.run_cell("%load_ext ortrain")
    sh.user_ns.clear()
    sh.init_user_ns()
    yield sh
    sh.user_ns.clear()
    sh.init_user_ns()


def runs_of(client, experiment: str) -> list:
    exp = client.get_experiment_id(experiment)
    return client.search_runs([exp]) if exp else []


@pytest.fixture
def stand_in_engine():
    """Until the engine is merged: an engine stand-in that keeps the model in PyTorch, so that
    the magics' own logic (which model, state handling, modes) is exercised. Never used when the
    real `ortrain.accelerate` exists."""
    import ortrain.magics as m

    if m.engine() is not None:
        yield m.engine()
        return
    accelerated = set()
    m._TEST_ENGINE = {
        "accelerate": lambda model, optimizer=None, *, device="cpu", strict=False: (accelerated.add(id(model)), model)[1],
        "deaccelerate": lambda model: (accelerated.discard(id(model)), model)[1],
        "is_accelerated": lambda model: id(model) in accelerated,
        "explain": lambda model: "stand-in engine (PyTorch)",
    }
    try:
        yield m._TEST_ENGINE
    finally:
        m._TEST_ENGINE = None
