"""The process-wide, in-memory cache of exports: a second `accelerate` of the same module in one
process (`%%ort compare`, `%ort off` then on, `--check`, `deaccelerate` + `accelerate`) reuses
its export instead of running the exporter again (2-5 s each for the tutorial model).

Owns the cache key. An entry belongs to one module object (held weakly: it goes with the module)
and is reused only while everything the exported graph was traced from is unchanged:
- the call: `export.signature` (constant values, tensor dtypes, ranks and devices), the mode
  (training), the exporter choice, dynamic, opset, torch's default dtype;
- every submodule: its name, its class (by identity: a class redefined in a notebook is a new
  class), its forward (the function object and its code, an instance-level forward too) and the
  functions and classes that forward names as globals, its hooks, its plain attributes (numbers,
  strings, flags such as a dropout's p or `batch_first`; plain tensor attributes by content,
  since the exporter bakes them in; other objects by identity and repr), and every parameter's
  and buffer's name, shape, dtype, device and requires_grad.
Parameter and buffer values are not part of the key: the cached graph holds none (it is an
`export_module(weights=False)` graph) and the engine binds the live tensors on every call.
Not seen: code reached only through a deeper call chain that is redefined while the module
object lives on; `clear()` (or a new module object) covers that. Only successful exports are
kept. `ORTRAIN_EXPORT_CACHE=0` turns the cache off.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import weakref

import torch

from ortrain.export.inputs import signature

_ENTRIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # module -> {key: ExportedGraph}
_MODULE_INTERNALS = {"_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set",
                     "_is_full_backward_hook", "forward"}
_PRIMITIVES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
_REPR_LIMIT = 100_000


def enabled() -> bool:
    return os.environ.get("ORTRAIN_EXPORT_CACHE", "1") != "0"


def clear() -> None:
    """Forgets every cached export (the next accelerate of any module exports again)."""
    _ENTRIES.clear()


def export_cached(module: torch.nn.Module, args=(), kwargs: dict | None = None, **options):
    """`export_module(module, args, kwargs, weights=False, **options)` (in a child process where
    export/isolated.py can), or the graph an earlier identical export returned in this process
    (its `from_cache` set)."""
    from ortrain.export.isolated import export_isolated

    options["weights"] = False
    if not enabled():
        return export_isolated(module, args, kwargs, **options)
    if not isinstance(args, tuple):
        args = (args,)
    key = cache_key(module, args, kwargs, options)
    per_module = _ENTRIES.get(module)
    if per_module is not None and key in per_module:
        return dataclasses.replace(per_module[key], from_cache=True)
    exported = export_isolated(module, args, kwargs, **options)
    _ENTRIES.setdefault(module, {})[key] = exported
    return exported


def cache_key(module: torch.nn.Module, args: tuple, kwargs: dict | None, options: dict) -> str:
    """A digest of everything the export depends on but the parameter values (module docstring)."""
    h = hashlib.blake2b(digest_size=20)
    h.update(repr((signature(args, kwargs), sorted(options.items()), str(torch.get_default_dtype()))).encode())
    for name, sub in module.named_modules(remove_duplicate=False):
        h.update(repr(("module", name, _identity(type(sub)), _forward_of(sub))).encode())
        for attr, value in sorted(sub.__dict__.items()):
            if attr in _MODULE_INTERNALS or attr.startswith("_ortrain"):
                continue
            h.update(repr((attr, _describe(value, h))).encode())
        for kind, tensors in (("param", sub._parameters), ("buffer", sub._buffers)):
            for pname, t in tensors.items():
                h.update(repr((kind, pname, None if t is None else
                               (tuple(t.shape), str(t.dtype), t.device.type, t.requires_grad))).encode())
        h.update(repr(("persistent", sorted(sub._non_persistent_buffers_set))).encode())
    return h.hexdigest()


def _identity(obj) -> tuple:
    return (getattr(obj, "__module__", None), getattr(obj, "__qualname__", type(obj).__name__), id(obj))


def _forward_of(module: torch.nn.Module) -> tuple:
    """The forward that runs (instance attribute or the class's), its code and its globals."""
    fn = module.__dict__.get("forward", type(module).forward)
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    names = []
    if code is not None:
        glob = getattr(fn, "__globals__", {})
        for n in code.co_names:
            if n in glob and callable(glob[n]):
                names.append((n, id(glob[n])))
    return (_identity(fn), id(code), tuple(names))


def _describe(value, h, depth: int = 0):
    """What of an attribute value can change a trace: primitives by value, tensors by content,
    containers item by item, functions by identity, other objects by identity and repr."""
    if isinstance(value, _PRIMITIVES):
        return ("v", value)
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return ("tensor", tuple(t.shape), str(t.dtype), value.device.type)
    if depth < 4 and isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_describe(v, h, depth + 1) for v in value))
    if depth < 4 and isinstance(value, dict):
        return ("dict", tuple((repr(k), _describe(v, h, depth + 1)) for k, v in value.items()))
    if depth < 4 and isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(v) for v in value)))
    if callable(value) and not isinstance(value, torch.nn.Module):
        return ("fn", _identity(getattr(value, "__func__", value)))
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - an object without a usable repr counts by identity
        text = ""
    return ("obj", _identity(type(value)), id(value), text if len(text) < _REPR_LIMIT else hash(text))
