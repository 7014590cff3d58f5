"""The torch.export-based ONNX exporter (`torch.onnx.export(dynamo=True, optimize=False)`).

Owns: one function, `export(wrapper, flat, ...) -> onnx.ModelProto`. optimize=False keeps the
module's own parameter names (optimize=True renames, pre-transposes and dedups them). Every
dimension of every input is `Dim.AUTO` when dynamic: torch.export keeps it symbolic unless the
model specializes it (e.g. a Linear after Flatten fixes the image size).

nn.TransformerEncoder(src, mask) asks `_detect_is_causal_mask` whether the mask is causal by
comparing its values (a data-dependent guard torch.export cannot trace). The answer is only a
hint that lets attention skip the mask; during export we answer "not causal" (or the caller's
explicit is_causal), so the mask is applied explicitly: same values, exportable graph.

Three costs of torch.onnx.export that ortrain does not need are avoided (measured, doc/EXPORT.md):
- every call rebuilds the aten -> ONNX function registry from onnxscript's torchlib, parsing the
  Python source of ~500 functions (0.6-0.9 s on 2 cores): the registry of export/registry.py
  holds the same entries but parses a function only when the translation uses it, and is built
  once per process per opset (nothing mutates it: custom translation tables are never passed);
- it traces the module twice (torch.export, then run_decompositions): export/capture.py traces
  it once, already decomposed with the same table, and torch.onnx.export skips its
  decomposition of that program (modules with tied weights keep the two traces);
- the initializers named in `bound` (the module's parameters and buffers, which the engine binds
  to the live tensors) are written without data, marked external at `ortrain:bound`, instead of
  copying every weight into the protobuf (48 MB for the tutorial model) to drop it later.
The program is captured first and, for weightless exports, its translation looked up in the
disk cache (export/disk_cache.py: keyed by a digest of the captured program); on a miss the
captured program is translated and stored. Where ortrain's capture fails, torch.onnx.export
runs as before (its first capture strategy, then its others).
"""
from __future__ import annotations

import contextlib

import onnx
import torch

from ortrain.export import capture as _one_trace
from ortrain.export import disk_cache
from ortrain.export import promotion as _promotion
from ortrain.export import registry as _registry

NAME = "dynamo"
_captured: list | None = None  # inside capture_programs(): the ExportedPrograms behind each export


@contextlib.contextmanager
def capture_programs():
    """Collects the torch.export ExportedProgram of every dynamo export run inside (for
    `ortrain.check_parity`: its FX node names are the ONNX graph's value names)."""
    global _captured
    outer, _captured = _captured, []
    try:
        yield _captured
    finally:
        _captured = outer


def capturing_programs() -> bool:
    """Inside capture_programs(): the programs must be collected in this process."""
    return _captured is not None


BOUND_LOCATION = "ortrain:bound"
_REGISTRIES: dict = {}  # (class, from_torchlib arguments: the opset) -> the ONNXRegistry built for them


def export(wrapper: torch.nn.Module, flat: list, input_names: list, output_names: list, *,
           training: bool, dynamic: bool, opset: int | None, bound=frozenset()) -> tuple[onnx.ModelProto, list]:
    from torch.export import Dim

    dynamic_shapes = None
    if dynamic:
        # forward(*flat): one entry for the varargs parameter, a tuple with one spec per tensor
        dynamic_shapes = (tuple({i: Dim.AUTO for i in range(t.dim())} for t in flat),)
    kw = {} if opset is None else {"opset_version": opset}
    registry = _registry.build(_registry_opset(opset))
    with _no_causal_mask_detection():
        captured, decomposed = _capture(wrapper, flat, dynamic_shapes, registry, bound)
    if captured is not None and bound and disk_cache.enabled() and _captured is None:
        # capture_programs() needs the translation's program
        digest = disk_cache.key(captured, {"opset": opset, "inputs": list(input_names),
                                           "outputs": list(output_names)}, bound)
        cached = disk_cache.load(digest)
        if cached is not None:
            return cached, []  # nothing of the translation (onnxscript, the registry) was needed
    else:
        digest = None
    with _no_causal_mask_detection(), _reused_registry(), _promotion.promoting_only_where_needed(), \
            _one_trace.skipping_decomposition(captured if decomposed else None, registry):
        program = torch.onnx.export(
            captured if captured is not None else wrapper, tuple(flat), None, dynamo=True, optimize=False,
            dynamic_shapes=None if captured is not None else dynamic_shapes, input_names=list(input_names),
            output_names=list(output_names), verbose=False, report=False, verify=False,
            external_data=False, **kw)
    if _captured is not None:
        _captured.append(program.exported_program)
    if bound:
        _without_data(program.model, bound)
    model = program.model_proto
    if digest is not None:
        disk_cache.store(digest, model)
    return model, []


def _capture(wrapper, flat, dynamic_shapes, registry, bound):
    """(program, decomposed): the module traced once, already decomposed for `registry`
    (export/capture.py); else, where weightless exports use the disk cache, the program as
    torch.onnx.export's first capture strategy makes it (torch.export, non-strict; decomposed by
    torch.onnx.export); else (None, False): torch.onnx.export runs from the module, with all of
    its strategies."""
    if registry is not None:
        program = _one_trace.capture_decomposed(wrapper, flat, dynamic_shapes, registry)
        if program is not None:
            return program, True
    if not (bound and disk_cache.enabled()):
        return None, False
    try:
        from torch.onnx._internal.exporter import _capture_strategies
        strategy = _capture_strategies.TorchExportNonStrictStrategy(verbose=False)
    except (ImportError, AttributeError, TypeError):
        return None, False
    result = strategy(wrapper, tuple(flat), {}, dynamic_shapes)
    return getattr(result, "exported_program", None), False


def _registry_opset(opset):
    """The opset torch.onnx.export builds its registry for, given `opset_version=opset`."""
    try:
        from torch.onnx import _constants as onnx_constants
        from torch.onnx._internal.exporter import _constants
    except ImportError:
        return opset
    requested = onnx_constants.ONNX_DEFAULT_OPSET if opset is None else opset
    return max(requested, _constants.TORCHLIB_OPSET)


def _without_data(model, bound) -> None:
    """The initializers named in `bound` become data-less external tensors at `ortrain:bound`
    (same name, dtype and shape), so that serializing the model copies no weight."""
    import onnx_ir as ir

    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if name in bound and tensor is not None and not isinstance(tensor, ir.ExternalTensor):
            value.const_value = ir.ExternalTensor(BOUND_LOCATION, None, None, tensor.dtype,
                                                  shape=ir.Shape(tensor.shape), name=tensor.name or name)


@contextlib.contextmanager
def _reused_registry():
    """torch.onnx.export builds its ONNXRegistry from torchlib on every call; within this
    context it gets the lazily-signed one of export/registry.py for its opset (built once per
    process), else the first one torch built for these arguments. Where the private hook
    `ONNXRegistry.from_torchlib` does not exist, nothing is changed."""
    try:
        from torch.onnx._internal.exporter import _registration
        cls = _registration.ONNXRegistry
        original = cls.__dict__["from_torchlib"]
    except (ImportError, AttributeError, KeyError):
        yield
        return
    build = original.__func__

    def from_torchlib(klass, *args, **kwargs):
        opset = kwargs.get("opset_version", args[0] if args else None)
        lazy = _registry.build(opset) if klass is cls and isinstance(opset, int) and len(args) + len(kwargs) == 1 else None
        if lazy is not None:
            return lazy
        key = (klass, args, tuple(sorted(kwargs.items())))
        if key not in _REGISTRIES:
            _REGISTRIES[key] = build(klass, *args, **kwargs)
        return _REGISTRIES[key]

    cls.from_torchlib = classmethod(from_torchlib)
    try:
        yield
    finally:
        cls.from_torchlib = original


def _hint_only(mask, is_causal=None, size=None):
    return bool(is_causal) if is_causal is not None else False


@contextlib.contextmanager
def _no_causal_mask_detection():
    try:
        from torch.nn.modules import transformer
    except ImportError:
        yield
        return
    original = getattr(transformer, "_detect_is_causal_mask", None)
    if original is None:
        yield
        return
    transformer._detect_is_causal_mask = _hint_only
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = original
