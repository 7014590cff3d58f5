"""The torch.export-based ONNX exporter (`torch.onnx.export(dynamo=True, optimize=False)`).

Owns: one function, `export(wrapper, flat, ...) -> onnx.ModelProto`. optimize=False keeps the
module's own parameter names (optimize=True renames, pre-transposes and dedups them). Every
dimension of every input is `Dim.AUTO` when dynamic: torch.export keeps it symbolic unless the
model specializes it (e.g. a Linear after Flatten fixes the image size).

nn.TransformerEncoder(src, mask) asks `_detect_is_causal_mask` whether the mask is causal by
comparing its values (a data-dependent guard torch.export cannot trace). The answer is only a
hint that lets attention skip the mask; during export we answer "not causal" (or the caller's
explicit is_causal), so the mask is applied explicitly: same values, exportable graph.
"""
from __future__ import annotations

import contextlib

import onnx
import torch

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


def export(wrapper: torch.nn.Module, flat: list, input_names: list, output_names: list, *,
           training: bool, dynamic: bool, opset: int | None) -> tuple[onnx.ModelProto, list]:
    from torch.export import Dim

    dynamic_shapes = None
    if dynamic:
        # forward(*flat): one entry for the varargs parameter, a tuple with one spec per tensor
        dynamic_shapes = (tuple({i: Dim.AUTO for i in range(t.dim())} for t in flat),)
    kw = {} if opset is None else {"opset_version": opset}
    with _no_causal_mask_detection():
        program = torch.onnx.export(
            wrapper, tuple(flat), None, dynamo=True, optimize=False,
            dynamic_shapes=dynamic_shapes, input_names=list(input_names),
            output_names=list(output_names), verbose=False, report=False, verify=False,
            external_data=False, **kw)
    if _captured is not None:
        _captured.append(program.exported_program)
    return program.model_proto, []


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
