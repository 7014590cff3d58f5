"""The torch.export-based ONNX exporter (`torch.onnx.export(dynamo=True, optimize=False)`).

Owns: one function, `export(wrapper, flat, ...) -> onnx.ModelProto`. optimize=False keeps the
module's own parameter names (optimize=True renames, pre-transposes and dedups them). Every
dimension of every input is `Dim.AUTO` when dynamic: torch.export keeps it symbolic unless the
model specializes it (e.g. a Linear after Flatten fixes the image size).
"""
from __future__ import annotations

import onnx
import torch

NAME = "dynamo"


def export(wrapper: torch.nn.Module, flat: list, input_names: list, output_names: list, *,
           training: bool, dynamic: bool, opset: int | None) -> onnx.ModelProto:
    from torch.export import Dim

    dynamic_shapes = None
    if dynamic:
        # forward(*flat): one entry for the varargs parameter, a tuple with one spec per tensor
        dynamic_shapes = (tuple({i: Dim.AUTO for i in range(t.dim())} for t in flat),)
    kw = {} if opset is None else {"opset_version": opset}
    program = torch.onnx.export(
        wrapper, tuple(flat), None, dynamo=True, optimize=False, dynamic_shapes=dynamic_shapes,
        input_names=list(input_names), output_names=list(output_names), verbose=False,
        report=False, verify=False, external_data=False, **kw)
    return program.model_proto
