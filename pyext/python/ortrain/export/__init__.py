"""Export a PyTorch module to ONNX for the ortrain engine: `export_module(...) -> ExportedGraph`.

Owns the orchestration: flatten the call (export/inputs.py), try the exporters in order
(export/legacy.py, export/dynamo.py: one file each, replaceable), post-process the graph the same
way whatever exporter ran (export/graph.py), and record what happened. Exporter noise is
silenced (export/quiet.py); failures are never silent: each attempt's reason is recorded and,
if all fail, ExportError names the model class and every exporter's reason.

Order for exporter="auto": dynamo first, then legacy (measured, doc/EXPORT.md). The dynamo
exporter (2-5 s) exports every zoo model with truly symbolic dims (the tutorial once its causal
-mask check is neutralised, export/dynamo.py). The legacy exporter (0.1-0.2 s) is faster but
fails on GPT-2 under transformers 5.x (aten::diff) and bakes nn.MultiheadAttention's key length
into a Reshape: its tutorial graph runs only at the exported sequence length.
"""
from __future__ import annotations

import contextlib
import gc
import re
import time
from dataclasses import dataclass, field

import onnx
import torch

from ortrain.errors import ExportError
from ortrain.export import checkpoints as _checkpoints
from ortrain.export import dynamo as _dynamo
from ortrain.export import graph as _graph
from ortrain.export import legacy as _legacy
from ortrain.export.inputs import flat_tensors, flatten_call, rebuild_call, signature, sizes
from ortrain.export.outputs import flatten_outputs, unflatten_outputs
from ortrain.export.quiet import quiet
from ortrain.export.cache import export_cached

__all__ = ["ExportedGraph", "export_module", "export_cached", "flat_tensors", "signature", "sizes", "unflatten_outputs",
           "EXPORTERS"]

EXPORTERS = {"legacy": _legacy, "dynamo": _dynamo}
AUTO_ORDER = ("dynamo", "legacy")
_PREFIX = "ortrain_inner."
_RECORDS: dict = {}  # id(wrapper) -> what its forward saw (output structure and names)


@dataclass
class ExportedGraph:
    """An exported forward graph and everything the engine needs to bind it to the module.

    Parameters and buffers are initializers with data; the engine binds each to the live torch
    tensor named by param_map (state_dict key) and ignores the stored copy.
    """

    onnx_bytes: bytes
    input_names: list  # the real tensor inputs, flat, in call order
    output_names: list
    param_map: dict  # onnx initializer name -> state_dict key
    param_kinds: dict  # onnx initializer name -> "param" | "frozen" | "buffer"
    aliases: dict  # onnx initializer name -> all state_dict keys sharing its storage (ties)
    output_structure: tuple  # for unflatten_outputs(structure, flat_tensors)
    exporter: str  # "legacy" | "dynamo"
    opset: int
    attempts: list  # [(exporter, None | "reason")]
    dropout_fixes: list  # Dropout node names set to training mode
    seconds: float
    training: bool = True
    batchnorm_fixes: list = field(default_factory=list)  # BatchNorm nodes set to training mode
    constants: tuple = ()  # ((argument path, value), ...) non-tensor inputs baked in
    signature: tuple = ()  # signature(args, kwargs) of the exported call
    buffer_updates: dict = field(default_factory=dict)  # buffer key -> value with its new data
    unused_params: list = field(default_factory=list)  # trainable params the graph never reads
    static_dims: dict = field(default_factory=dict)  # input -> axes left fixed by the exporter
    notes: list = field(default_factory=list)  # exporter remarks (legacy tracer warnings)
    weights: bool = True  # False: param_map's initializers carry no data (external at ortrain:bound)
    from_cache: bool = False  # returned by export.cache.export_cached without exporting again
    in_child: bool = False  # exported in a forked child process (export/isolated.py)
    # torch.utils.checkpoint: module paths the trace saw checkpointed, those whose parts the
    # graph marks for recomputation (export/checkpoints.py), and checkpointed functions that
    # are no module of the model (not recomputed)
    checkpointed: list = field(default_factory=list)
    recomputed: list = field(default_factory=list)
    checkpoints_unmatched: int = 0
    # outputs returned as None: key/value caches (export/outputs.py is_kv_cache)
    dropped_outputs: list = field(default_factory=list)

    def model(self) -> onnx.ModelProto:
        return onnx.load_from_string(self.onnx_bytes)

    def op_counts(self) -> dict:
        counts: dict = {}
        for node in self.model().graph.node:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
        return dict(sorted(counts.items()))


class _Wrapper(torch.nn.Module):
    """forward(*flat_tensors): rebuilds the user's call (constants baked in), flattens outputs."""

    def __init__(self, module, spec):
        super().__init__()
        setattr(self, _PREFIX[:-1], module)
        self._spec = spec
        # kept outside the module: torch.export restores the module's attributes after tracing
        self.key = id(self)
        _RECORDS[self.key] = {"structure": None, "names": None}

    @property
    def record(self) -> dict:
        return _RECORDS[self.key]

    def forward(self, *flat):
        args, kwargs = rebuild_call(self._spec, flat)
        out = getattr(self, _PREFIX[:-1])(*args, **kwargs)
        dropped: list = []
        structure, tensors, names = flatten_outputs(out, dropped=dropped)
        _RECORDS[self.key].update(structure=structure, names=names, dropped=dropped)
        return tuple(tensors)


def _reason(exc: BaseException) -> str:
    """First line of the innermost cause, without ANSI colours."""
    root = exc
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(root)).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(root).__name__}: {line}"[:300]


def _order(exporter: str):
    if exporter == "auto":
        return AUTO_ORDER
    if exporter in EXPORTERS:
        return (exporter,)
    allowed = ", ".join(repr(x) for x in ("auto", *EXPORTERS))
    raise ValueError(f"exporter={exporter!r} is not one of {allowed}")


def export_module(module: torch.nn.Module, args=(), kwargs: dict | None = None, *,
                  training: bool = True, exporter: str = "auto", dynamic: bool = True,
                  opset: int | None = None, quiet_logs: bool = True, weights: bool = True) -> ExportedGraph:
    """Export `module(*args, **kwargs)` to ONNX (see ExportedGraph).

    training: export train()-mode semantics (Dropout active, BatchNorm batch statistics) or
        eval(). The module's own modes, buffers and RNG state are restored afterwards.
    exporter: "auto" (dynamo, then legacy), "legacy" or "dynamo".
    dynamic: every dimension of every tensor input symbolic (True) or fixed (False).
    weights: False leaves the data of the module's parameters and buffers out of the graph (each
        initializer in param_map keeps its name, type and shape, marked external at
        `ortrain:bound`): what the engine needs, since it binds the live tensors. It saves
        copying the weights several times (the dynamo exporter then never writes them).
    """
    order = _order(exporter)
    if not isinstance(args, tuple):
        args = (args,)
    spec, flat = flatten_call(module, args, kwargs)
    if not flat:
        raise TypeError(f"{type(module).__name__}: the call has no tensor argument to export")
    sig = signature(args, kwargs)
    attempts = []
    t0 = time.perf_counter()
    bound = frozenset() if weights else _state_names(module)
    with _gc_paused():
        for name in order:
            model = _attempt(EXPORTERS[name], module, spec, flat, training, dynamic, opset,
                             quiet_logs, attempts, bound)
            if model is not None:
                break
    if model is None:
        reasons = "; ".join(f"{n}: {r}" for n, r in attempts)
        raise ExportError(f"could not export {type(module).__name__} to ONNX: {reasons}")
    model, wrapper, notes, checkpointed = model
    record = _RECORDS.pop(wrapper.key)
    _graph.strip_prefix(model, _PREFIX)
    _graph.name_outputs(model, record["names"] or [])
    fixes = _graph.fix_dropouts(model) if training else []
    bn_fixes = _graph.fix_batchnorms(model) if training else []
    pmap, kinds, aliases, unused = _graph.map_parameters(model, module)
    updates = _graph.buffer_updates(model, pmap, kinds) if training else {}
    input_names = list(spec.input_names)
    if not weights:
        _graph.mark_bound(model, pmap)
    recomputed = _checkpoints.mark(model, checkpointed.paths, _PREFIX) if training else []
    _graph.check(model)
    onnx_bytes = model.SerializeToString()
    seconds = time.perf_counter() - t0
    return ExportedGraph(
        onnx_bytes=onnx_bytes, input_names=input_names,
        output_names=[o.name for o in model.graph.output], param_map=pmap, param_kinds=kinds,
        aliases=aliases, output_structure=record["structure"], exporter=name,
        opset=_graph.opset_of(model), attempts=attempts, dropout_fixes=fixes, batchnorm_fixes=bn_fixes, seconds=seconds,
        training=training, constants=spec.constants, signature=sig, buffer_updates=updates,
        unused_params=unused, notes=notes, static_dims=_graph.static_input_dims(model, input_names),
        weights=weights, checkpointed=checkpointed.paths, recomputed=recomputed,
        checkpoints_unmatched=checkpointed.unmatched, dropped_outputs=record.get("dropped", []))


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic garbage collector off while an exporter runs, then one collection of what
    was allocated meanwhile. The ~5*10^5 objects importing torch leaves make every full
    collection slow: a cold tutorial export ran 4 of them (0.6-0.7 s of its ~4 s, measured;
    doc/EXPORT.md). Paused, the export's ~2*10^5 objects of cyclic garbage (+17 MB peak RSS) wait
    for the collection of the young generation at the end (~0.25 s)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect(0)


def _state_names(module: torch.nn.Module) -> frozenset:
    """The initializer names (as the wrapper sees them) of the module's parameters and buffers."""
    keys = set(module.state_dict(keep_vars=True))
    keys.update(k for k, _ in module.named_parameters(remove_duplicate=False))
    keys.update(k for k, _ in module.named_buffers(remove_duplicate=False))
    return frozenset(_PREFIX + k for k in keys)


def _attempt(backend, module, spec, flat, training, dynamic, opset, quiet_logs, attempts, bound):
    modes = {m: m.training for m in module.modules()}
    buffers = {k: b.detach().clone() for k, b in module.named_buffers()}
    rng = torch.random.get_rng_state()
    wrapper = _Wrapper(module, spec)
    try:
        module.train(training)
        with quiet(quiet_logs), _checkpoints.recording(module) as checkpointed:
            model, notes = backend.export(wrapper, flat, list(spec.input_names), [], training=training,
                                          dynamic=dynamic, opset=opset, bound=bound)
        attempts.append((backend.NAME, None))
        return model, wrapper, notes, checkpointed
    except Exception as exc:  # recorded, reported in ExportError if every exporter fails
        attempts.append((backend.NAME, _reason(exc)))
        _RECORDS.pop(wrapper.key, None)
        return None
    finally:
        for m, mode in modes.items():
            m.training = mode
        with torch.no_grad():
            for k, b in module.named_buffers():
                if k in buffers:
                    b.copy_(buffers[k])
        torch.random.set_rng_state(rng)
