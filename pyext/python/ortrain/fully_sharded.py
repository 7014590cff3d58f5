"""FSDP2 (`torch.distributed.fsdp.fully_shard`) on an accelerated module.

fully_shard keeps each parameter as a DTensor shard between steps. In the forward pre-hook of
every module it was applied to, it all-gathers that module's parameters into whole tensors and
registers them on the module for the call ("unshard"); after the backward pass it
reduce-scatters their gradients into the shards' `.grad` and frees the whole tensors again.

The engine runs the model's graph in one call, without calling the submodules (whose hooks
would unshard them). So, on a model that fully_shard was applied to (its root, as FSDP2 asks),
the accelerated forward first unshards every fully_shard module inside it (`unshard()`, the
public call), and the engine binds the whole tensors. The root's own hooks still run around the
accelerated forward: they gather the root's parameters, hook the output's backward (on a lazy
output, engine/lazy.py, FSDP's hook runs where the backward pass starts: at the fused loss),
and after the backward pass reduce-scatter and reshard every group (FSDP's post-backward
callback covers groups whose modules did not run forward). The whole model is gathered from the
forward pass to the end of the backward pass (the memory of `reshard_after_forward=False`);
gradients and optimizer state stay sharded, and the engine's optimizer updates each rank's
shards (engine/optimizer.py: the update is elementwise). The export runs with FSDP's forward and
state_dict hooks taken off the modules, so tracing sees plain tensors and starts no collective."""
from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

from ortrain.engine.tensors import addressable
from ortrain.errors import UnsupportedError


@functools.cache  # asked at every accelerated call: the import looked up once
def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a PyTorch build without torch.distributed
        return None
    return FSDPModule


def is_sharded_root(module: torch.nn.Module) -> bool:
    """Whether fully_shard was applied to `module` itself."""
    cls = _fsdp_module_class()
    return cls is not None and isinstance(module, cls)


def _inner(module: torch.nn.Module) -> list:
    cls = _fsdp_module_class()
    if cls is None:
        return []
    return [m for m in module.modules() if m is not module and isinstance(m, cls)]


def check_bindable(module: torch.nn.Module) -> None:
    """Raises UnsupportedError, before an export is tried, where the parameters of `module` are
    shards nothing gathers for the engine: fully_shard applied to submodules but not to `module`
    itself, or DTensor parameters of another kind (tensor parallelism)."""
    if is_sharded_root(module):
        return
    inner = _inner(module)
    if inner:
        names = [n for n, m in module.named_modules() if m in inner]
        raise UnsupportedError(f"fully_shard was applied to {', '.join(repr(n) for n in names[:3])}"
                               f"{' ...' if len(names) > 3 else ''} but not to {type(module).__name__} itself; "
                               "apply it to the model too (its root, as FSDP2 asks) so that it can be accelerated")
    for name, p in module.named_parameters():
        if not addressable(p):
            raise UnsupportedError(f"parameter '{name}' is a {type(p).__name__}, a shard (tensor parallelism: "
                                   "parallelize_module, distribute_tensor); the engine runs whole tensors, and "
                                   "gathers them itself only under FSDP2's fully_shard on the model")


def gather(module: torch.nn.Module) -> None:
    """Unshards every fully_shard module inside `module` (the root is unsharded by its own
    pre-forward hook, which has run): their whole parameters are now the module's."""
    for m in _inner(module):
        m.unshard()


def release(module: torch.nn.Module) -> None:
    """Reshards the modules inside `module` after a call whose outputs start no backward pass
    (no FSDP post-backward will): an inference call frees the gathered parameters, as FSDP's
    post-forward hook does in PyTorch."""
    for m in _inner(module):
        m.reshard()


def describe(module: torch.nn.Module, optimizer_in_engine: bool) -> str | None:
    """explain()'s line for a model under fully_shard, else None."""
    if not is_sharded_root(module):
        return None
    n = 1 + len(_inner(module))
    step = "the engine steps each rank's shards" if optimizer_in_engine else "the optimizer's step runs in PyTorch"
    return (f"FSDP2 (fully_shard on {n} module{'s' if n > 1 else ''}): the parameters are gathered whole for each "
            f"engine forward and kept until its backward pass ends; FSDP reduce-scatters the gradients into the "
            f"shards, and {step}")


def is_fsdp_hook(hook) -> bool:
    """Whether `hook` is one of FSDP's own (a bound method or closure of torch.distributed.fsdp)."""
    fn = getattr(hook, "__func__", hook)
    return getattr(fn, "__module__", "").startswith("torch.distributed.fsdp")


@contextmanager
def hooks_off(module: torch.nn.Module):
    """FSDP's forward and state_dict hooks taken off `module` and its submodules for the body
    (the export): a trace that ran them would start collectives, reshard mid-trace (the exporters
    read the state_dict, which FSDP reshards first) and record FSDP's autograd functions. Every
    module's hook tables are restored as they were, in order."""
    if not is_sharded_root(module):
        yield
        return
    saved = []
    for m in module.modules():
        for table in (m._forward_pre_hooks, m._forward_hooks, m._state_dict_pre_hooks):
            fsdp = [k for k, h in table.items() if is_fsdp_hook(h)]
            if fsdp:
                saved.append((table, dict(table)))
                for k in fsdp:
                    del table[k]
    try:
        yield
    finally:
        for table, entries in saved:
            table.clear()
            table.update(entries)
