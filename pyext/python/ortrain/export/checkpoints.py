"""Which parts of a model run under `torch.utils.checkpoint`, found while it is exported, and
their mark in the ONNX model for the engine, which recomputes them in the backward pass
(engine passes/recompute_segments.rs) as PyTorch would.

The exporters trace through a checkpoint as through any call, so the graph alone does not say
that the user asked to keep less memory. `recording(module)` watches torch's checkpoint entry
points during the trace and notes each checkpointed function that is a module of the model (the
module, its bound forward / __call__, functools.partial of those or of its class's forward with
the module as first argument: `checkpoint(layer, x)`, Hugging Face's
`gradient_checkpointing_enable()`; a closure holding one module of the model; the modules of a
checkpoint_sequential slice); a function that holds none (or only the whole model) is counted
and left as it is, and explain says so.
`mark(model, paths)` then finds each module's nodes (the dynamo exporter's `namespace` node
metadata, the legacy exporter's node-name scopes), the values going into and out of them, and
writes them as the ModelProto metadata entry `ortrain.recompute_segments`
(engine onnx/recompute_meta.rs reads it)."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import onnx
import torch

KEY = "ortrain.recompute_segments"
_NAMES = "\x1f"


@dataclass
class Checkpointed:
    """What a trace saw: the checkpointed parts, each a tuple of module paths (in call order,
    once each; checkpoint_sequential's parts hold several modules), and how many
    checkpointed calls were of functions that are no module of the model (an exporter may run
    the forward more than once: a count of calls, not of functions)."""
    paths: list = field(default_factory=list)
    unmatched: int = 0


def _owners(fn, paths_by_id: dict) -> tuple:
    """The model paths of the modules `fn` runs (one part), or () when they cannot be told."""
    for _ in range(8):
        if isinstance(fn, functools.partial) and fn.args and isinstance(fn.args[0], torch.nn.Module):
            fn = fn.args[0]  # partial(Layer.forward, layer, ...): transformers' GradientCheckpointingLayer
        elif isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "function") and callable(fn.function):  # torch's _CheckpointedFunction
            fn = fn.function
        elif isinstance(getattr(fn, "__self__", None), torch.nn.Module):
            fn = fn.__self__
        else:
            break
    if isinstance(fn, torch.nn.Module):
        path = paths_by_id.get(id(fn))
        return (path,) if path else ()
    return _closure_owners(fn, paths_by_id)


def _closure_owners(fn, paths_by_id: dict) -> tuple:
    """A closure's modules: checkpoint_sequential's `forward` over functions[start..end], or the
    one module of the model a closure (or a default argument) holds, as in
    `checkpoint(create_custom_forward(layer), x)` and `checkpoint(lambda t, layer=layer: layer(t), x)`.
    Recomputing a module is the same arithmetic whatever else the closure does, so taking the
    module it holds is safe; the root model itself is no part."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return ()
    cells = {}
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            cells[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    functions, start, end = cells.get("functions"), cells.get("start"), cells.get("end")
    if isinstance(functions, (list, tuple)) and isinstance(start, int) and isinstance(end, int):
        paths = tuple(paths_by_id.get(id(m)) for m in functions[start:end + 1])
        return paths if paths and all(paths) else ()
    held = list(cells.values()) + list(getattr(fn, "__defaults__", None) or ())
    modules = {paths_by_id[id(v)] for v in held if isinstance(v, torch.nn.Module) and paths_by_id.get(id(v))}
    return (modules.pop(),) if len(modules) == 1 else ()


def part_name(paths: tuple) -> str:
    """How explain and the metadata name a part: its module, or its first..last modules."""
    return paths[0] if len(paths) == 1 else f"{paths[0]}..{paths[-1]}"


@contextlib.contextmanager
def recording(module: torch.nn.Module, prefix: str = ""):
    """Yields a Checkpointed filled while the body traces `module` (module paths without
    `prefix`)."""
    import torch.utils.checkpoint as ckpt

    seen = Checkpointed()
    paths_by_id = {id(m): name[len(prefix):] if name.startswith(prefix) else name for name, m in module.named_modules()}

    def note(fn):
        paths = _owners(fn, paths_by_id)
        if not paths:
            seen.unmatched += 1
        elif paths not in seen.paths:
            seen.paths.append(paths)

    patched = {}
    impl = getattr(ckpt, "_checkpoint_impl", None)
    if impl is not None:  # torch >= 2.12: every checkpoint call goes through it
        def checkpoint_impl(function, *args, **kwargs):
            note(function)
            return impl(function, *args, **kwargs)
        patched["_checkpoint_impl"] = checkpoint_impl
    else:  # older torch: the reentrant and non-reentrant entry points
        generator = getattr(ckpt, "_checkpoint_without_reentrant_generator", None)
        function_cls = getattr(ckpt, "CheckpointFunction", None)
        if generator is not None:
            def without_reentrant(fn, *args, **kwargs):
                note(fn)
                return generator(fn, *args, **kwargs)
            patched["_checkpoint_without_reentrant_generator"] = without_reentrant
        if function_cls is not None:
            class Reentrant:
                @staticmethod
                def apply(function, *args):
                    note(function)
                    return function_cls.apply(function, *args)
            patched["CheckpointFunction"] = Reentrant
    saved = {name: getattr(ckpt, name) for name in patched}
    try:
        for name, fn in patched.items():
            setattr(ckpt, name, fn)
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(ckpt, name, fn)


def _within(path: str, outer: str) -> bool:
    return path == outer or path.startswith(outer + ".")


def _outermost(parts: list) -> list:
    """`parts` without those inside another one (a checkpoint within a checkpointed module)."""
    return [p for p in parts
            if not any(q != p and all(any(_within(a, b) for b in q) for a in p) for q in parts)]


def _scopes(node: onnx.NodeProto, prefix: str) -> list:
    """The module paths a node was made in, outermost first."""
    for entry in node.metadata_props:  # dynamo: ": Wrapper/inner: M/inner.layers.0: Layer/op: aten.op"
        if entry.key == "namespace":
            scopes = [part.split(": ")[0] for part in entry.value.split("/")]
            return [s[len(prefix):] if s.startswith(prefix) else s for s in scopes]
    parts = node.name.split("/")[1:-1]  # legacy: "/layers.0/attn/proj/Gemm"
    return [".".join(parts[: k + 1]) for k in range(len(parts))]


def mark(model: onnx.ModelProto, parts: list, prefix: str = "") -> list:
    """Writes the metadata entry for the checkpointed `parts` (tuples of module paths); returns
    the names (`part_name`) of those whose nodes were found, in order."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    graph_outputs = {o.name for o in graph.output}
    scopes = [set(_scopes(n, prefix)) for n in graph.node]  # once per node, not once per part
    readers: dict = {}
    for k, n in enumerate(graph.node):
        for v in n.input:
            readers.setdefault(v, set()).add(k)
    lines, found = [], []
    for paths in _outermost(parts):
        path = part_name(paths)
        members = [k for k, s in enumerate(scopes) if not s.isdisjoint(paths)]
        if not members:
            continue
        inside = [graph.node[k] for k in members]
        made = {o for n in inside for o in n.output if o}
        constants = {o for n in inside if n.op_type == "Constant" for o in n.output}
        inputs = list(dict.fromkeys(v for n in inside for v in n.input
                                    if v and v not in made and v not in initializers))
        member_set = set(members)
        outputs = [o for n in inside for o in n.output if o and o not in constants
                   and (readers.get(o, set()) - member_set or o in graph_outputs)]
        names = inputs + outputs + [path]
        if not outputs or any("\t" in s or "\n" in s or _NAMES in s for s in names):
            continue
        lines.append(f"{path}\t{_NAMES.join(inputs)}\t{_NAMES.join(outputs)}")
        found.append(path)
    if lines:
        entry = model.metadata_props.add()
        entry.key, entry.value = KEY, "\n".join(lines)
    return found


def repeated_layers(model: torch.nn.Module) -> list:
    """The model's transformer layers, as ORTTrainer's `transformer_layer_recompute` means them:
    the children of the largest ModuleList (or Sequential) of two or more modules of one class,
    in order, as (path, module)."""
    best: list = []
    for path, m in model.named_modules():
        if not isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        kids = list(m.named_children())
        if len(kids) >= 2 and len({type(k) for _, k in kids}) == 1 and len(kids) > len(best):
            best = [(f"{path}.{name}" if path else name, k) for name, k in kids]
    return best


@contextlib.contextmanager
def checkpointed_forwards(modules: list):
    """While the body runs (an export), each of `modules` runs its forward under
    torch.utils.checkpoint (non-reentrant), so that `recording` marks it for recomputation."""
    from torch.utils.checkpoint import checkpoint

    saved = []
    for m in modules:
        forward = m.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
        saved.append((m, "forward" in vars(m), forward))
        m.forward = checkpointed
    try:
        yield
    finally:
        for m, own, forward in reversed(saved):
            if own:
                m.forward = forward
            else:
                del m.forward
