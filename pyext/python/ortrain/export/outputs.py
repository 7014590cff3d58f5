"""Output structures: flatten a forward's result to a list of tensors and rebuild it.

Owns: the `output_structure` recorded at export (tensor / tuple / list / dict / HF ModelOutput /
constant leaves), the output names derived from it, and `unflatten_outputs`.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch


def is_kv_cache(value) -> bool:
    """Whether `value` is a Hugging Face key/value cache (transformers.cache_utils.Cache:
    DynamicCache, StaticCache, ...), which a causal LM returns as `past_key_values` unless
    called with use_cache=False."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(value).__mro__)


def flatten_outputs(value, path="output", dropped: list | None = None):
    """Returns (structure, tensors, names). Structure leaves: ("tensor", i) or ("const", v).

    A key/value cache in the output (`is_kv_cache`) becomes None: the engine computes the step's
    outputs, and keeps no cache for a next call. Its path is appended to `dropped`."""
    tensors: list = []
    names: list = []

    def walk(v, p):
        if is_kv_cache(v):
            if dropped is not None:
                dropped.append(p)
            return ("const", None)
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            names.append(p)
            return ("tensor", len(tensors) - 1)
        if v is None or isinstance(v, (int, float, bool, str)):
            return ("const", v)
        if isinstance(v, (tuple, list)) and not hasattr(v, "_fields"):
            kind = "tuple" if isinstance(v, tuple) else "list"
            return (kind, tuple(walk(x, f"{p}_{i}") for i, x in enumerate(v)))
        if isinstance(v, Mapping):
            cls = type(v)
            kids = tuple((k, walk(x, str(k))) for k, x in v.items())
            return ("dict", kids, None if cls is dict else cls)
        raise TypeError(f"model output at {p!r} has type {type(v).__name__}, which ortrain "
                        "cannot export: return tensors or tuples/lists/dicts of tensors")

    structure = walk(value, path)
    if structure[0] == "tensor":
        names = ["output"]
    return structure, tensors, names


def unflatten_outputs(structure, tensors):
    """Rebuild the model's output structure from the flat list of output tensors."""
    kind = structure[0]
    if kind == "tensor":
        return tensors[structure[1]]
    if kind == "const":
        return structure[1]
    if kind in ("tuple", "list"):
        items = [unflatten_outputs(s, tensors) for s in structure[1]]
        return tuple(items) if kind == "tuple" else items
    d = {k: unflatten_outputs(s, tensors) for k, s in structure[1]}
    cls = structure[2]
    return d if cls is None else cls(**d)
