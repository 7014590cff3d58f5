"""The legacy TorchScript ONNX exporter (`torch.onnx.export(dynamo=False)`).

Owns: one function, `export(wrapper, flat, ...) -> onnx.ModelProto`: training mode (or eval),
constant folding off (folding would bake parameters into constants), parameters as initializers
(not graph inputs), every input dimension named in `dynamic_axes` when dynamic. Deprecated since
torch 2.9; kept as a replaceable fallback (it exports the nn.Transformer tutorial model, which
the dynamo exporter cannot). Its nn.MultiheadAttention dropout comes out in inference mode:
graph.fix_dropouts repairs that.

Tracer warnings are collected: one saying a tensor went through NumPy (`.numpy()`,
`torch.from_numpy`) fails the attempt, because the trace then holds values computed from the
example input as constants; the others (e.g. "tensor to a Python boolean", in nearly every
model) are returned as notes.
"""
from __future__ import annotations

import io
import warnings

import onnx
import torch

NAME = "legacy"
DEFAULT_OPSET = 17


_FATAL = ("to a NumPy array", "torch.from_numpy")


class TraceBakedValuesError(RuntimeError):
    """The trace froze values computed from the example input (a NumPy round trip)."""


def export(wrapper: torch.nn.Module, flat: list, input_names: list, output_names: list, *,
           training: bool, dynamic: bool, opset: int | None, bound=frozenset()) -> tuple[onnx.ModelProto, list]:
    """`bound` is not used: the legacy exporter names some parameters `onnx::...`, matched by
    value afterwards (graph.map_parameters), so their data is dropped only after that."""
    dynamic_axes = None
    if dynamic:
        dynamic_axes = {n: {i: f"{n}_dim{i}" for i in range(t.dim())}
                        for n, t in zip(input_names, flat)}
    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    buf = io.BytesIO()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.onnx.export(
            wrapper, tuple(flat), buf, dynamo=False, training=mode, do_constant_folding=False,
            opset_version=opset or DEFAULT_OPSET, input_names=list(input_names),
            output_names=list(output_names), dynamic_axes=dynamic_axes, export_params=True,
            keep_initializers_as_inputs=False)
    notes = []
    for w in caught:
        if w.category.__name__ == "TracerWarning":
            line = str(w.message).splitlines()[0][:160]
            if any(f in line for f in _FATAL):
                raise TraceBakedValuesError(f"the trace is wrong for other inputs: {line}")
            if line not in notes:
                notes.append(line)
    return onnx.load_from_string(buf.getvalue()), notes
