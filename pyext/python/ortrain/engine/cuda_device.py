"""Which GPU an engine call runs on. The engine's CUDA runtime of GPU `k` (`cuda:k`) has its
kernels in that device's primary context and makes it current on the calling thread, which is
what PyTorch reads as its current device; so every call for a model on `cuda:k` runs with `k`
as PyTorch's current device, and the caller's current device is back afterwards (a rank that
trains on cuda:1 without `torch.cuda.set_device(1)` keeps allocating where it did)."""
from __future__ import annotations

from contextlib import nullcontext

import torch


def engine_device(device: torch.device):
    """A context manager making `device` PyTorch's current CUDA device for the engine calls in
    its body (nothing to do when it already is)."""
    if device.index is None or device.index == torch.cuda.current_device():
        return nullcontext()
    return torch.cuda.device(device)


def stream(device: torch.device) -> int:
    """PyTorch's current stream of `device`, as the handle the engine queues on."""
    return torch.cuda.current_stream(device).cuda_stream


def model_gpu(module: torch.nn.Module) -> torch.device:
    """The GPU of `module`'s CUDA parameters and buffers (PyTorch's current CUDA device for a
    module that has none there); an error naming the devices where they are on several."""
    from ortrain.errors import OrtrainError

    tensors = list(module.parameters()) + list(module.buffers())
    devices = {t.device for t in tensors if t.is_cuda}
    if len(devices) > 1:
        raise OrtrainError(f"device='cuda': the model's tensors are on {', '.join(sorted(str(d) for d in devices))}; "
                           "ortrain runs a model on one GPU (model.to('cuda:N') first)")
    return devices.pop() if devices else torch.device("cuda", torch.cuda.current_device())
