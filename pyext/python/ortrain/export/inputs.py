"""Flattening of a call's (args, kwargs) into named tensor inputs plus baked-in constants.

Owns: which values become graph inputs (tensors, also nested in tuples/lists/dicts), which are
baked into the graph as constants (int, float, bool, str, None, torch.dtype/device), the
refusal of anything else (naming the argument), the rebuilding of the call from the flat tensors,
and `signature`: the hashable re-export key (constants, tensor dtypes and ranks, not sizes).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

_CONST_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device)


@dataclass(frozen=True)
class CallSpec:
    """How to rebuild (args, kwargs) from the flat tensor list: a tree with leaves
    ("tensor", index) and ("const", value)."""

    args: tuple
    kwargs: tuple  # ((name, tree), ...)
    input_names: tuple  # one per tensor leaf, in flat order
    constants: tuple  # ((path, value), ...) the values baked into the graph


def _arg_names(module, n_args: int) -> list[str]:
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for i in range(n_args):
        if i < len(params) and params[i].kind in (params[i].POSITIONAL_ONLY,
                                                  params[i].POSITIONAL_OR_KEYWORD):
            names.append(params[i].name)
        else:
            names.append(f"arg{i}")
    return names


def _clean(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)


def _tree(value, path: str, tensors: list, names: list, consts: list, root: str | None = None):
    root = root or path
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        names.append(_clean(path))
        return ("tensor", len(tensors) - 1)
    if isinstance(value, str) and path != root:
        raise TypeError(f"argument {root!r} (at {path}) holds a string: ortrain cannot export "
                        "data that is not tensors (strings are allowed only as a whole argument)")
    if isinstance(value, _CONST_TYPES):
        consts.append((path, value))
        return ("const", value)
    if isinstance(value, (tuple, list)):
        kids = tuple(_tree(v, f"{path}_{i}", tensors, names, consts, root) for i, v in enumerate(value))
        return ("tuple" if isinstance(value, tuple) else "list", kids)
    if isinstance(value, dict):
        kids = tuple((k, _tree(v, f"{path}_{k}", tensors, names, consts, root)) for k, v in value.items())
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"argument {root!r}: dict keys must be strings to export")
        return ("dict", kids)
    raise TypeError(
        f"argument {root!r}" + ("" if path == root else f" (at {path})")
        + f" has type {type(value).__name__}, which ortrain cannot export: "
        "pass tensors, (nested) tuples/lists/dicts of tensors, or int/float/bool/str/None constants")


def flatten_call(module, args: tuple, kwargs: dict | None) -> tuple[CallSpec, list[torch.Tensor]]:
    """Split a call into its tensor leaves and a spec; raises TypeError naming a bad argument."""
    if not isinstance(args, tuple):
        args = (args,)
    kwargs = dict(kwargs or {})
    tensors: list = []
    names: list = []
    consts: list = []
    arg_trees = tuple(_tree(a, n, tensors, names, consts)
                      for a, n in zip(args, _arg_names(module, len(args))))
    kw_trees = tuple((k, _tree(v, k, tensors, names, consts)) for k, v in kwargs.items())
    # unique names (a nested path can collide with a kwarg name)
    seen: dict = {}
    uniq = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        uniq.append(n if seen[n] == 1 else f"{n}_{seen[n] - 1}")
    return CallSpec(arg_trees, kw_trees, tuple(uniq), tuple(consts)), tensors


def flat_tensors(args: tuple, kwargs: dict | None) -> list[torch.Tensor]:
    """The tensor leaves of a call in flatten_call's order, without its names and checks (for a
    call whose signature was already exported: ~1 instead of ~25 us)."""
    if not isinstance(args, tuple):
        args = (args,)
    out: list = []
    for value in (*args, *(kwargs or {}).values()):
        _collect_tensors(value, out)
    return out


def _collect_tensors(value, out: list) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _collect_tensors(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _collect_tensors(v, out)


def _build(tree, flat):
    kind = tree[0]
    if kind == "tensor":
        return flat[tree[1]]
    if kind == "const":
        return tree[1]
    if kind in ("tuple", "list"):
        items = [_build(t, flat) for t in tree[1]]
        return tuple(items) if kind == "tuple" else items
    return {k: _build(t, flat) for k, t in tree[1]}


def rebuild_call(spec: CallSpec, flat) -> tuple[tuple, dict]:
    """The (args, kwargs) of the original call, with tensors taken from `flat`."""
    return (tuple(_build(t, flat) for t in spec.args),
            {k: _build(t, flat) for k, t in spec.kwargs})


def sizes(args: tuple, kwargs: dict | None = None) -> tuple:
    """The sizes of a call's tensors (in `signature`'s order): with the signature, the key of a
    graph exported with fixed sizes."""
    if not isinstance(args, tuple):
        args = (args,)
    out: list = []
    for value in (*args, *(v for _, v in sorted((kwargs or {}).items()))):
        _collect_sizes(value, out)
    return tuple(out)


def _collect_sizes(value, out: list) -> None:
    if isinstance(value, torch.Tensor):
        out.append(tuple(value.shape))
    elif isinstance(value, (tuple, list)):
        for v in value:
            _collect_sizes(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _collect_sizes(v, out)


def _sig(value):
    if isinstance(value, torch.Tensor):
        return ("T", str(value.dtype), value.dim(), value.device.type)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__,) + tuple(_sig(v) for v in value)
    if isinstance(value, dict):
        return ("dict",) + tuple((k, _sig(v)) for k, v in value.items())
    if isinstance(value, (torch.dtype, torch.device)):
        return ("C", str(value))
    if isinstance(value, _CONST_TYPES):
        return ("C", type(value).__name__, value)
    return ("?", type(value).__name__, id(value))


def signature(args: tuple, kwargs: dict | None = None):
    """A hashable key of a call: constant values, tensor dtypes/ranks/devices, not tensor sizes.

    Two calls with the same key can run the same exported graph; a different key needs a new
    export (e.g. a different bool flag, or a tensor of another rank).
    """
    if not isinstance(args, tuple):
        args = (args,)
    return (tuple(_sig(a) for a in args),
            tuple(sorted((k, _sig(v)) for k, v in (kwargs or {}).items())))
