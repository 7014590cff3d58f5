"""databricks/: the cluster init script against a fresh virtual environment standing in for the
cluster's Python (installs the built wheel, is idempotent, fails loudly on a missing wheel or
Python, warms the CUDA kernel cache for the node's GPUs in the background or before it ends),
and the generated Databricks source notebook (parses back into the notebook's cells; the
committed file is up to date). This machine has no GPU: the warm-up test puts an `nvidia-smi`
that reports a compute capability 9.0 GPU first on PATH (the driver's tool, which is all the
warm-up asks the node); NVRTC compiles for real."""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import time
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
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "ORTRAIN_WARM_KERNELS": "0", **env_extra}
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


def own_kernel_cache() -> Path:
    """The engine's disk cache of this process (engine/src/backend/cuda/cache.rs default_dir)."""
    if os.environ.get("ORTRAIN_CACHE_DIR"):
        return Path(os.environ["ORTRAIN_CACHE_DIR"]) / "cuda"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "ortrain" / "cuda"
    return Path.home() / ".cache" / "ortrain" / "cuda"


def seed_kernel_cache(cache: Path, left_out: str) -> None:
    """Copies into `cache` the newest sm_90 CUBIN of each kernel file in this process's own disk
    cache (CI's kernel compile check leaves every current one there), but none of `left_out`'s:
    the warm-up then compiles that file, and any whose newest entry is stale or missing, instead
    of compiling all of them again (100 s of CI's 2 cores)."""
    newest: dict[str, Path] = {}
    for entry in own_kernel_cache().glob("*-sm_90-*.cubin"):
        family = entry.name.split("-sm_90-")[0]
        if family != left_out and (family not in newest or entry.stat().st_mtime > newest[family].stat().st_mtime):
            newest[family] = entry
    cache.mkdir(parents=True)
    for entry in newest.values():
        shutil.copy2(entry, cache / entry.name)


def test_init_script_warms_the_kernel_cache_for_the_nodes_gpus(cluster_python, tmp_path):
    """Background (the default): the script ends before the compiles, whose log lists every kernel
    file for sm_90 and says the one the cache lacked (scan.cu: the others are seeded from this
    process's own cache) was compiled into the cache the notebooks' startup file names; `wait` on
    a second start finds them all in the cache; a node without nvidia-smi warms nothing."""
    nvrtc = os.environ.get("ORTRAIN_NVRTC_LIB") or str(ROOT / ".cuda-wheels" / "nvidia" / "cu13" / "lib")
    if not os.path.exists(nvrtc):
        pytest.skip(f"no NVRTC at {nvrtc} (scripts/bootstrap.sh installs the pinned CUDA wheels)")
    wheel = built_wheel()
    tools = tmp_path / "bin"
    tools.mkdir()
    smi = tools / "nvidia-smi"
    smi.write_text('#!/bin/sh\n[ "$1" = "--query-gpu=compute_cap" ] && printf "9.0\\n9.0\\n" && exit 0\nexit 9\n')
    smi.chmod(0o755)
    cache, log = tmp_path / "kernel-cache", tmp_path / "warm.log"
    seed_kernel_cache(cache / "cuda", left_out="scan")
    env = {"ORTRAIN_PYTHON": str(cluster_python), "ORTRAIN_WHEEL": wheel, "ORTRAIN_NVRTC_LIB": nvrtc,
           "ORTRAIN_CACHE_DIR": str(cache), "ORTRAIN_WARM_LOG": str(log), "ORTRAIN_WARM_KERNELS": "background",
           "PATH": f"{tools}:{os.environ['PATH']}"}
    start = time.monotonic()
    r = run_init(env, tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"warming the CUDA kernel cache in {cache} in the background (log: {log})" in r.stdout, r.stdout
    files = len(glob.glob(str(ROOT / "kernels" / "*.cu")))  # one kernel family a file
    summary = re.compile(rf"{files} kernel files for sm_90: ([0-9]+) compiled")
    while not summary.search(log.read_text() if log.exists() else ""):
        assert time.monotonic() - start < 900, f"the background warm-up did not finish:\n{log.read_text() if log.exists() else ''}"
        assert "failed" not in (log.read_text() if log.exists() else ""), log.read_text()
        time.sleep(2)
    warmed = log.read_text()
    assert int(summary.search(warmed).group(1)) >= 1, warmed
    assert re.search(r"kernels/scan\.cu +compiled in", warmed) and "kernels/attention_flash.cu" in warmed, warmed
    startup = (tmp_path / ".ipython" / "profile_default" / "startup" / "50-ortrain.py").read_text()
    assert f'os.environ.setdefault("ORTRAIN_CACHE_DIR", {str(cache)!r})' in startup, startup

    r = run_init({**env, "ORTRAIN_WARM_KERNELS": "wait"}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"{files} kernel files for sm_90: 0 compiled" in r.stdout and f"{files} already cached" in r.stdout, r.stdout

    r = run_init({**env, "ORTRAIN_WARM_KERNELS": "wait", "PATH": os.environ["PATH"]}, tmp_path)
    assert r.returncode == 0 and "no NVIDIA GPU found" in r.stdout and "no CUDA kernels to warm" in r.stdout, r.stdout + r.stderr
    r = run_init({**env, "ORTRAIN_WARM_KERNELS": "yes"}, tmp_path)
    assert r.returncode != 0 and "ORTRAIN_WARM_KERNELS='yes': allowed values are background (default), wait, 0" in r.stderr


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
