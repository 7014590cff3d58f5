"""CUDA support as users meet it on any machine: `ortrain.cuda_available()` answers without
raising (False with the reason where there is no usable GPU, True with the GPU found where there
is one), a CUDA request on a machine without one fails with a message that names the reason, and
the wheel (built with the CUDA backend) links no CUDA library, so it imports where there is none.
The kernels are checked by engine/tests/cuda_kernels.rs (NVRTC, in CI) and the engine's GPU unit
tests; training on a GPU by tests/test_cuda_train.py."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import pytest
import torch

import ortrain
from ortrain import _ortrain


def _driver_loadable() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def test_cuda_available_answers_with_a_reason():
    ok, why = ortrain.cuda_available()
    assert isinstance(ok, bool) and why
    if not _driver_loadable():
        assert ok is False and why.startswith("libcuda.so.1 not found (no NVIDIA driver on this machine)"), why
    elif ok:
        assert why.startswith("CUDA ") and "sm_" in why, why


def test_accelerate_on_cuda_names_the_reason():
    ok, why = ortrain.cuda_available()
    if ok:
        pytest.skip(f"this machine has a usable GPU ({why}): tests/test_cuda_train.py covers it")
    with pytest.raises(ortrain.OrtrainError) as err:
        ortrain.accelerate(torch.nn.Linear(2, 2), device="cuda")
    msg = str(err.value)
    assert msg.startswith("device='cuda': the CUDA backend is not available: ") and why in msg, msg
    assert "doc/GPU-RUNS.md" in msg and "device='cpu'" in msg, msg


def test_runtime_memory_is_none_without_a_gpu_and_counts_the_cublas_workspace_with_one():
    """The bytes ortrain's CUDA runtime holds outside PyTorch's allocator (bench.gpu adds them to
    ortrain's peak): nothing before any GPU step, at least cuBLAS's 32 MiB workspace after one."""
    if not ortrain.cuda_available()[0] or not torch.cuda.is_available():
        assert _ortrain.cuda_runtime_bytes() == 0
        return
    model = torch.nn.Linear(8, 8).cuda()
    ortrain.accelerate(model, device="cuda", strict=True, fuse_loss=False)
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    assert _ortrain.cuda_runtime_bytes() >= 32 << 20


def test_the_extension_links_no_cuda_library():
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed: cannot list the extension's DT_NEEDED entries")
    out = subprocess.run([readelf, "-d", _ortrain.__file__], capture_output=True, text=True, check=True).stdout
    needed = [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]
    assert needed, out
    cuda = [n for n in needed if any(k in n for k in ("cuda", "nvrtc", "cublas", "nvidia"))]
    assert not cuda, f"the wheel must load CUDA at run time, not link it: {needed}"


@pytest.mark.gpu
def test_gpu_driver_probe_finds_the_gpu():
    """On a GPU machine: the engine's driver probe, NVRTC (kernels compiled or read from the
    disk cache) and cuBLAS all load, and the answer names the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here (torch.cuda.is_available() is False)")
    ok, why = ortrain.cuda_available()
    assert ok, why
    assert torch.cuda.get_device_name() in why, why


def _warm(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ortrain.cuda", "warm", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def test_warming_the_kernel_cache_names_a_bad_architecture():
    """`python -m ortrain.cuda warm` (the Databricks init script's warm-up; tests/test_databricks.py
    runs a whole one) refuses what is not an architecture the kernels support, naming it."""
    r = _warm("--arch", "sm_75")
    assert r.returncode == 1, r.stdout + r.stderr
    assert 'arch "sm_75": ortrain\'s CUDA kernels need compute capability 8.0 (sm_80, Ampere) or newer' in r.stderr, r.stderr
    r = _warm("--arch", "compute_90")
    assert r.returncode == 1 and "an architecture is sm_ and the compute capability's digits, e.g. sm_80" in r.stderr, r.stderr
    r = _warm("--arch", ",")
    assert r.returncode == 2 and "--arch names no architecture" in r.stderr, r.stderr


def test_warming_without_a_gpu_or_an_arch_warms_nothing(tmp_path):
    """--arch auto on a machine without nvidia-smi (a CPU node of a cluster): nothing to do, exit 0."""
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi: auto finds its GPUs (tests/test_databricks.py warms with a stand-in)")
    r = _warm(env={"ORTRAIN_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0 and "no NVIDIA GPU found (nvidia-smi is not on PATH" in r.stdout, r.stdout + r.stderr
    assert not any(tmp_path.iterdir())
