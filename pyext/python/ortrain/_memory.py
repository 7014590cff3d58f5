"""The training memory estimate `explain()` prints before the first step: what the process will
hold above its size before the model was built, as the sum of its parts: the module's tensors,
one gradient per trainable parameter, the optimizer's state (by the optimizer's kind), the engine's
planned arena peak, and what exporting and building the engine graph cost (measured: the
process's resident size before and after, which includes the exporter's modules and caches),
plus an allowance for what no plan sees: the code the first training step pages in (torch's
autograd and optimizer, the engine's kernels) and malloc's caches, about RUNTIME_ALLOWANCE on the
tutorial (2 threads, glibc); the estimate states it separately.
"""
from __future__ import annotations

import os

#: code first paged in by the training step + malloc caches, measured on the tutorial (2 threads)
RUNTIME_ALLOWANCE = 24 << 20


def rss_bytes() -> int | None:
    """The process's resident size now (Linux), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _bytes(tensors, device_type: str = "cpu") -> int:
    """The bytes of `tensors` on `device_type`, each memory counted once; of a DTensor (an FSDP2
    shard), the part this process holds."""
    from ortrain.engine.tensors import local_part

    seen, total = set(), 0
    for t in tensors:
        t = local_part(t)
        if t is not None and t.device.type == device_type and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizer, device_type: str = "cpu") -> tuple[int | None, str]:
    """(bytes, kind) of the state `optimizer` keeps per parameter once it has stepped: Adam and
    AdamW two tensors (three with amsgrad), SGD one with momentum and none without; None for
    other optimizers."""
    import torch

    if optimizer is None:
        return 0, "no optimizer"
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    per = 0
    for g in optimizer.param_groups:
        if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            per = 3 if g.get("amsgrad") else 2
        elif isinstance(optimizer, torch.optim.SGD):
            per = max(per, 1 if g.get("momentum", 0) else 0)
        else:
            return None, type(optimizer).__name__
    return per * _bytes(params, device_type), f"{type(optimizer).__name__}: {per} per parameter"


_MIB = 1 / 2**20


def _tensor_parts(module, optimizer, arena_bytes: int, device_type: str) -> tuple[list, int]:
    """The parts every estimate has (the module's tensors, gradients, optimizer state, the peak
    arena) on `device_type`, as text, and their sum in bytes."""
    from ortrain import fully_sharded

    tensors = _bytes(list(module.parameters()) + list(module.buffers()), device_type)
    state, kind = optimizer_state_bytes(optimizer, device_type)
    if fully_sharded.is_sharded_root(module):
        # FSDP2: during the backward pass the whole parameters (gathered for the engine) and their
        # whole gradients (until FSDP reduce-scatters them) are held beside the shards
        whole = [p for p in module.parameters() if p.device.type == device_type]
        gathered = sum(p.numel() * p.element_size() for p in whole)
        grads = sum(p.numel() * p.element_size() for p in whole if p.requires_grad)
        parts = [f"parameter shards and buffers {tensors * _MIB:.1f}",
                 f"whole parameters gathered for the step {gathered * _MIB:.1f}",
                 f"whole gradients until FSDP reduce-scatters them {grads * _MIB:.1f}"]
        tensors += gathered
    else:
        grads = _bytes([p for p in module.parameters() if p.requires_grad], device_type)
        parts = [f"parameters and buffers {tensors * _MIB:.1f}", f"gradients {grads * _MIB:.1f}"]
    total = tensors + grads + arena_bytes
    if state is None:
        parts.append(f"optimizer state not estimated ({kind})")
    else:
        parts.append(f"optimizer state {state * _MIB:.1f} ({kind})")
        total += state
    parts.append(f"peak arena {arena_bytes * _MIB:.1f}")
    return parts, total


def training_estimate(module, optimizer, arena_bytes: int, setup_bytes: int | None) -> str:
    """One line: the parts and their sum, in MiB."""
    parts, total = _tensor_parts(module, optimizer, arena_bytes, "cpu")
    if setup_bytes is not None:
        parts.append(f"export and engine build {max(setup_bytes, 0) * _MIB:.1f} (measured)")
        total += max(setup_bytes, 0)
    parts.append(f"runtime code and malloc caches ~{RUNTIME_ALLOWANCE * _MIB:.0f} (allowance)")
    total += RUNTIME_ALLOWANCE
    return f"training memory: {' + '.join(parts)} = {total * _MIB:.0f} MiB above the process before the model was built"


def gpu_training_estimate(module, optimizer, arena_bytes: int) -> str:
    """explain()'s planned GPU memory of a training step on CUDA: the module's CUDA tensors, one
    gradient per trainable parameter, the optimizer's state and the step's planned arena (a
    torch.cuda allocation). From the second step on, all four are alive at once during the
    backward pass, so their sum is what torch.cuda.max_memory_allocated() should show then."""
    parts, total = _tensor_parts(module, optimizer, arena_bytes, "cuda")
    from ortrain import _ortrain

    from ortrain.engine.cuda_device import model_gpu

    gpu = model_gpu(module)
    own = _ortrain.cuda_runtime_bytes(gpu.index)  # 0 only before the GPU's runtime exists (accelerate makes it)
    outside = (f"; ortrain's runtime holds {own * _MIB:.1f} MiB more outside PyTorch's allocator (cuBLAS's "
               "workspace, scratch)" if own else "; plus ortrain's runtime buffers outside PyTorch's allocator "
               "(cuBLAS's 32 MiB workspace, scratch), from the first GPU step")
    return (f"GPU memory planned: {' + '.join(parts)} = {total * _MIB:.1f} MiB "
            f"(torch.cuda.max_memory_allocated({gpu}) during a later step)" + outside)


def peak_summary(info: dict, top: int = 4) -> str:
    """What fills a plan at its heaviest step (`Session.plan_info`'s `peak_values`), grouped by
    producing op, element type and shape, largest first: where a smaller batch, bf16 activations
    or a fusion would save memory."""
    groups: dict = {}
    for _name, op, dtype, shape, nbytes in info.get("peak_values", []):
        key = (op, dtype, tuple(shape))
        count, total = groups.get(key, (0, 0))
        groups[key] = (count + 1, total + nbytes)
    if not groups:
        return "nothing in the arena"
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])
    parts = [f"{op} {dtype} {list(shape)}{f' ×{n}' if n > 1 else ''} {total / 2**20:.1f} MiB"
             for (op, dtype, shape), (n, total) in ranked[:top]]
    step, phase = info["peak_step"]
    return (f"{info['peak_live_bytes'] / 2**20:.1f} MiB alive at the peak (step {step}, {phase}), largest: "
            + "; ".join(parts))
