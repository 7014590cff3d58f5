"""databricks/: the cluster init script against a fresh virtual environment standing in for the
cluster's Python (installs the built wheel, is idempotent, fails loudly on a missing wheel or
Python), and the generated Databricks source notebook (parses back into the notebook's cells;
the committed file is up to date)."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INIT = ROOT / "databricks" / "ortrain-init.sh"
sys.path.insert(0, str(ROOT / "databricks"))
import make_notebook  # noqa: E402


def built_wheel() -> str:
    found = os.environ.get("ORTRAIN_WHEEL_PATH") or next(iter(sorted(glob.glob(str(ROOT / "target" / "wheels" / "ortrain-*.whl")))), None)
    if not found:
        pytest.skip("no built wheel: run maturin build -m pyext/Cargo.toml --out target/wheels (or set ORTRAIN_WHEEL_PATH)")
    return found


def run_init(env_extra: dict, home: Path):
    env = {"PATH": os.environ["PATH"], "HOME": str(home), **env_extra}
    return subprocess.run(["bash", str(INIT)], env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def cluster_python(tmp_path_factory):
    venv = tmp_path_factory.mktemp("cluster") / "python3"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    return venv / "bin" / "python"


def test_init_script_installs_and_is_idempotent(cluster_python, tmp_path):
    wheel = built_wheel()
    env = {"ORTRAIN_PYTHON": str(cluster_python), "ORTRAIN_WHEEL": str(Path(wheel).parent)}
    for _ in range(2):
        r = run_init(env, tmp_path)
        assert r.returncode == 0, r.stderr
        assert "ready; in a notebook: %load_ext ortrain" in r.stdout
    startup = tmp_path / ".ipython" / "profile_default" / "startup"
    assert [p.name for p in startup.iterdir()] == ["50-ortrain.py"]
    ok = subprocess.run([str(cluster_python), "-c", "import ortrain, ortrain.magics as m; "
                         "from ortrain._ortrain import MlflowClient; print(m.load_ipython_extension.__name__)"],
                        capture_output=True, text=True, timeout=60)
    # ortrain.magics needs IPython, which every Databricks runtime has; the bare venv may not
    assert ok.returncode == 0 or "No module named 'IPython'" in ok.stderr, ok.stderr
    plain = subprocess.run([str(cluster_python), "-c", "import ortrain._ortrain as o; print(o.ENGINE_VERSION)"],
                           capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0, plain.stderr


@pytest.mark.parametrize("env, message", [
    ({"ORTRAIN_WHEEL": "/nonexistent/ortrain-9.9.9-cp39-abi3-linux_x86_64.whl"}, "does not exist"),
    ({}, "ORTRAIN_WHEEL is not set"),
    ({"ORTRAIN_WHEEL": "/tmp", "ORTRAIN_PYTHON": "/nonexistent/python"}, "does not exist or is not executable"),
])
def test_init_script_fails_loudly(cluster_python, tmp_path, env, message):
    env = {"ORTRAIN_PYTHON": str(cluster_python), **env}
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_init(env, tmp_path)
    assert r.returncode != 0
    assert "ortrain init script: ERROR:" in r.stderr and message in r.stderr, r.stderr


def test_init_script_fails_on_a_directory_without_wheels(cluster_python, tmp_path):
    r = run_init({"ORTRAIN_PYTHON": str(cluster_python), "ORTRAIN_WHEEL": str(tmp_path)}, tmp_path)
    assert r.returncode != 0 and "no ortrain-*.whl in directory" in r.stderr


def test_databricks_notebook_round_trips():
    cells = make_notebook.cells_of(make_notebook.SOURCE)
    text = make_notebook.to_databricks(cells)
    assert text.startswith("# Databricks notebook source\n") and "\n# COMMAND ----------\n" in text
    assert make_notebook.from_databricks(text) == cells
    assert "# MAGIC %%ort compare --experiment tutorial" in text
    committed = make_notebook.TARGET.read_text()
    assert committed == text, "databricks/tutorial_transformer.py is stale: run python databricks/make_notebook.py"
    assert make_notebook.from_databricks(committed) == cells
    with pytest.raises(ValueError, match="not a Databricks source notebook"):
        make_notebook.from_databricks("print(1)\n")
