"""torch.nn.utils.clip_grad_norm_ in the engine for the gradients of accelerated models: on the
CPU, in one engine call on its threads with the same arithmetic as torch's (each gradient's L2
norm as an f32, the norm of those, coefficient min(max_norm / (total + 1e-6), 1) in f32 as torch
computes it on the 0-dim norm, gradients multiplied by it in place unless it is 1), returning
the same 0-dim total-norm tensor; on
the GPU, as three kernel launches queued on the current stream (kernels/optim.cu: squares summed
per chunk in f64, the norm and the coefficient computed on the device, every gradient scaled):
no host synchronisation, where torch's function takes about ten launches and the Python that
groups the tensors; the norm is the f64 sum's square root rounded once, within an f32 rounding
of torch's.

Why: with it, a training step of an accelerated model runs no parallel region of torch's at
all. After one, torch's OpenMP workers spin for milliseconds (libgomp's default wait policy) on
the cores the engine's next phase needs. On a 2-core AMD EPYC (Zen 4), `python bench/clip_threads.py
--rounds 5` (the tutorial step, medians): clip + optimizer step 4.8 + 10.3 ms with torch's clip,
5.5 + 7.8 with torch's clip and OMP_WAIT_POLICY=passive, 3.9 + 7.2 with the engine's.

`accelerate()` patches torch.nn.utils.clip_grad_norm_ (the module attributes, so code that calls
it through torch.nn.utils sees the patch; a reference taken with `from ... import` before the
first accelerate() keeps torch's). Anything this does not cover goes to torch's own function
unchanged: another norm_type, gradients that are not all dense contiguous f32 tensors on the CPU
or all on the engine's GPU, parameters of models that are not accelerated, error_if_nonfinite
on the GPU (torch's check synchronises anyway). ORTRAIN_ENGINE_CLIP=0 turns the engine path off.
"""
from __future__ import annotations

import functools
import math
import os
import types
import weakref

import torch

from ortrain import _ortrain
from ortrain.engine.cuda_device import engine_device, stream
from ortrain.engine.gpu_tables import device_tables
from ortrain.engine.tensors import addressable

_F32 = torch.float32
_STRIDED = torch.strided

#: accelerated CPU models: their parameters' gradients are clipped in the engine
_MODELS: weakref.WeakSet = weakref.WeakSet()
#: ((registration count, models), {id of a parameter: a weak reference to its model}), rebuilt
#: when either changes (weak: a model the user drops is freed, cache or not)
_PARAM_IDS: list = [None, {}]
_ORIGINAL: list = []
#: per accelerated model, the calls that clipped its gradients: {"engine": n, "torch": n, "why":
#: why torch's function clipped them, the last time}
_CALLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def install(model: torch.nn.Module) -> None:
    """Clips `model`'s gradients in the engine from now on (torch's function patched once)."""
    _MODELS.add(model)
    if _ORIGINAL:
        return
    from torch.nn.utils import clip_grad

    original = clip_grad.clip_grad_norm_
    _ORIGINAL.append(original)
    patched = functools.wraps(original)(functools.partial(_clip_grad_norm_, original))
    clip_grad.clip_grad_norm_ = patched
    torch.nn.utils.clip_grad_norm_ = patched


def forget(model: torch.nn.Module) -> None:
    """`model` is no longer accelerated: torch clips its gradients again."""
    _MODELS.discard(model)


def _accelerated_ids() -> dict:
    """{id of a parameter of an accelerated model: a weak reference to that model}."""
    from ortrain.accelerate import _REGISTRATIONS

    key = (_REGISTRATIONS[0], tuple(sorted(id(m) for m in _MODELS)))
    if _PARAM_IDS[0] != key:
        _PARAM_IDS[0] = key
        owners = {}
        for m in list(_MODELS):
            owners.update(dict.fromkeys(map(id, m.parameters()), weakref.ref(m)))
        _PARAM_IDS[1] = owners
    return _PARAM_IDS[1]


def _count(owners: set, where: str, why: str = "") -> None:
    """One clip of the gradients of the accelerated models `owners` (weak references), in the
    engine or in torch's function (`why`)."""
    for model in filter(None, (ref() for ref in owners)):
        calls = _CALLS.setdefault(model, {"engine": 0, "torch": 0, "why": ""})
        calls[where] += 1
        if why:
            calls["why"] = why


#: whether the engine's GPU clip still works in this process
_GPU_CLIP_WORKS = [True]
#: (address, numel) rows of the gradients -> gpu_tables.device_tables
_GPU_TABLES: dict = {}


def _engine_grads(params: list, norm_type, error_if_nonfinite: bool) -> tuple:
    """(the gradients to clip in the engine, "", the accelerated models they belong to) or (None,
    why torch's function clips them: empty when no accelerated model's gradient is among them,
    those models). One pass of identity and flag tests per
    gradient: this runs every step (about 27 µs for the tutorial model's 27 on a 2-core AMD EPYC)."""
    ids = _accelerated_ids()
    grads, owners, why = [], set(), ""
    device = None  # the gradients' device index (-1: the CPU), False once they differ
    for p in params:
        g = p.grad
        if g is None:
            continue
        owner = ids.get(id(p))
        if owner is not None:
            owners.add(owner)
        elif not why:
            why = "parameters of models that are not accelerated among them"
        if not why and not addressable(g):
            why = f"a {type(g).__name__} gradient (a shard: FSDP2, tensor parallelism)"
        if not why and not (g.dtype is _F32 and g.layout is _STRIDED and (g.is_cpu or g.is_cuda) and g.is_contiguous()):
            why = f"a {g.dtype} {g.layout} gradient on {g.device}, not a contiguous float32 one"
        d = g.get_device()
        if device is None:
            device = d
        elif device is not False and d != device:
            device = False
        grads.append(g)
    if not owners:
        return None, "", owners
    if os.environ.get("ORTRAIN_ENGINE_CLIP", "1") == "0":
        why = "ORTRAIN_ENGINE_CLIP=0"
    elif float(norm_type) != 2.0:
        why = f"norm_type={norm_type}"
    elif device is False:
        why = why or f"gradients on {len({g.device for g in grads})} devices"
    elif device is not None and device >= 0 and not why:
        why = _gpu_why_not(torch.device("cuda", device), error_if_nonfinite)
    return (None, why, owners) if why else (grads, "", owners)


def _gpu_why_not(device: torch.device, error_if_nonfinite: bool) -> str:
    """Why the engine cannot clip gradients on GPU `device`, or ""."""
    if error_if_nonfinite:
        return "error_if_nonfinite=True on the GPU"
    if not _GPU_CLIP_WORKS[0]:
        return "the engine's GPU clip failed earlier in this process"
    from ortrain.cuda import cuda_available

    ok, why = cuda_available(device.index)
    return "" if ok else f"the engine's CUDA runtime is unavailable on {device} ({why})"


def _gpu_clip(grads: list, max_norm: float):
    """The engine's clip of f32 gradients on the GPU, queued on the current stream: the 0-dim
    total norm (a device tensor, as torch's), or None where the launch failed (warned once; torch
    clips from then on)."""
    device = grads[0].device  # one GPU: _engine_grads checked it
    table, chunk_tensor, chunk_start = device_tables(_GPU_TABLES, tuple((g.data_ptr(), g.numel()) for g in grads), device)
    chunks = chunk_tensor.numel()
    partial = torch.empty(max(chunks, 1), dtype=torch.float64, device=device)
    out = torch.empty(2, dtype=torch.float32, device=device)  # the norm, the coefficient
    try:
        with engine_device(device):
            _ortrain.cuda_clip_grad_norm(table.data_ptr(), chunk_tensor.data_ptr(), chunk_start.data_ptr(), chunks,
                                         float(max_norm), partial.data_ptr(), out.data_ptr(), out.data_ptr() + 4,
                                         stream(device), device=device.index)
    except _ortrain.EngineError as exc:
        _GPU_CLIP_WORKS[0] = False
        from ortrain._warn import warn

        warn(f"ortrain: the engine's GPU clip_grad_norm_ failed ({str(exc).splitlines()[0]}); PyTorch clips the "
             "GPU gradients from now on")
        return None
    return out[0]


def describe(model) -> str | None:
    """explain()'s line: where clip_grad_norm_ ran for `model`'s gradients, if it did."""
    calls = _CALLS.get(model)
    if calls is None:
        return None
    line = f"clip_grad_norm_ of its gradients: {calls['engine']} call(s) in the engine"
    if calls["torch"]:
        line += f", {calls['torch']} in PyTorch (last: {calls['why']})"
    return line


@torch.no_grad()
def _clip_grad_norm_(original, parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    is_generator = isinstance(parameters, types.GeneratorType)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads, why, owners = _engine_grads(params, norm_type, error_if_nonfinite)
    if grads and grads[0].device.type == "cuda":
        total_norm = _gpu_clip(grads, max_norm)
        if total_norm is not None:
            _count(owners, "engine")
            return total_norm
        grads, why = None, "the engine's GPU clip failed"
    if why:
        _count(owners, "torch", why)
    if grads is None:
        # an emptied generator goes on as one, so that torch warns about it as it would
        again = (p for p in params) if is_generator else params
        return original(again, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    total = _ortrain.clip_by_global_norm([(g.data_ptr(), g.numel()) for g in grads], float(max_norm),
                                         bool(error_if_nonfinite))
    total_norm = torch.tensor(total, dtype=torch.float32)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`")
    _count(owners, "engine")
    return total_norm
