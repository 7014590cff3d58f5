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
    if "ORTRAIN_EXPORT_CACHE_DIR" not in os.environ:  # start cold, leave the user's cache alone
        import atexit
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="ortrain-test-export-cache-")
        os.environ["ORTRAIN_EXPORT_CACHE_DIR"] = folder
        atexit.register(shutil.rmtree, folder, True)


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


def require_cuda() -> None:
    """Skips the calling test where there is no usable GPU; fails it where PyTorch sees one but
    ortrain's CUDA backend does not load. TF32 off, for parity."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here (torch.cuda.is_available() is False)")
    import ortrain

    ok, why = ortrain.cuda_available()
    if not ok:
        pytest.fail(f"PyTorch sees a GPU but ortrain's CUDA backend does not load: {why}")
    torch.backends.cuda.matmul.allow_tf32 = False
    # cuDNN's convolutions default to TF32; ortrain's are exact f32 unless matmul TF32 is on
    torch.backends.cudnn.allow_tf32 = False


def runs_of(client, experiment: str) -> list:
    exp = client.get_experiment_id(experiment)
    return client.search_runs([exp]) if exp else []


@pytest.fixture
def engine_api():
    """The engine API the magics use."""
    import ortrain.magics as m

    return m.engine()