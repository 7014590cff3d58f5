"""Whether ortrain can train on CUDA here, and the message users see when it cannot.

`cuda_available(device=0)` probes the NVIDIA driver and that GPU, then loads ortrain's CUDA kernels (NVRTC
compiles them once per machine, then a disk cache serves them) and cuBLAS, both found in the
`nvidia/cu13/lib` folders of PyTorch's CUDA wheels. It answers False, with the reason, where any
of that is missing (no driver, a driver older than CUDA 13.0, no GPU, no NVRTC/cuBLAS). The CUDA
executor covers a growing subset of the CPU backend's ops; a model using others runs in PyTorch
with a warning naming them. doc/GPU-RUNS.md records what has run on a GPU.
"""
from __future__ import annotations

import functools
import glob
import os
import sys

# what every CUDA refusal says besides the machine-specific reason
STATUS = "see doc/GPU-RUNS.md for what ortrain's CUDA backend runs"


def nvidia_lib_dirs() -> list[str]:
    """The `nvidia/*/lib` folders of the installed NVIDIA wheels (NVRTC, cuBLAS)."""
    dirs = []
    for root in sys.path:
        if root and os.path.isdir(os.path.join(root, "nvidia")):
            dirs += sorted(d for d in glob.glob(os.path.join(root, "nvidia", "*", "lib")) if os.path.isdir(d))
    return dirs


@functools.lru_cache(maxsize=None)
def _status(device: int) -> tuple[bool, str]:
    try:
        from ortrain import _ortrain
    except ImportError as e:  # a source tree without a built extension
        return False, f"the ortrain engine extension is not built: {e}"
    ok, why = _ortrain.cuda_status(nvidia_lib_dirs(), device=device)
    return bool(ok), str(why)


def cuda_available(device: int = 0) -> tuple[bool, str]:
    """(usable, what was found or why not) for GPU `device` (`cuda:<device>`). Never raises,
    whatever the machine (no driver, no GPU, old driver, no NVRTC); the answer is computed once
    per process and GPU."""
    return _status(int(device))


def unavailable_message(what: str, device: int = 0) -> str:
    """`what`: the CUDA backend is not available: <why>; <status>. Use the CPU."""
    _, why = cuda_available(device)
    return f"{what}: the CUDA backend is not available: {why}; {STATUS}. Use the CPU (device='cpu', model.cpu())"
