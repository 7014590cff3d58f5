"""Whether ortrain can train on CUDA here, and the message users see when it cannot.

ortrain's CUDA backend is compiled, not yet verified on a GPU: its kernels compile (CI checks
every one) but there is no CUDA executor yet, so `cuda_available()` answers False everywhere,
with the reason: no NVIDIA driver, a driver older than CUDA 13.0, no GPU, or (with a usable
driver) the missing executor. See doc/GPU-RUNS.md.
"""
from __future__ import annotations

# what every CUDA refusal says besides the machine-specific reason
STATUS = "ortrain's CUDA backend is compiled but not yet verified on a GPU (doc/GPU-RUNS.md)"


def cuda_available() -> tuple[bool, str]:
    """(usable, reason). Never raises, whatever the machine (no driver, no GPU, old driver)."""
    try:
        from ortrain import _ortrain
    except ImportError as e:  # a source tree without a built extension
        return False, f"the ortrain engine extension is not built: {e}"
    ok, why = _ortrain.cuda_status()
    return bool(ok), str(why)


def unavailable_message(what: str) -> str:
    """`what`: the CUDA backend is not available: <why>; <status>. Use the CPU."""
    _, why = cuda_available()
    return f"{what}: the CUDA backend is not available: {why}; {STATUS}. Use the CPU (device='cpu', model.cpu())"
