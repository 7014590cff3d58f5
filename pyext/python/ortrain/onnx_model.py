"""Starting from an ONNX file: `ortrain.load_onnx(path)` runs a model that did not come from
PyTorch (inference here; ORTTrainer trains PyTorch modules). External data files are read from
the model's folder."""
from __future__ import annotations

import torch

from ortrain import _ortrain
from ortrain.engine.function import read_outputs
from ortrain.engine.tensors import triple


class OnnxModel:
    """An ONNX model in the engine: `model(*tensors)` returns its outputs as torch tensors."""

    def __init__(self, path: str):
        self.path = str(path)
        self.session = _ortrain.Session.load(self.path, [], [])
        self.input_names = self.session.input_names
        self.output_names = self.session.output_names

    def __call__(self, *inputs: torch.Tensor):
        if len(inputs) != len(self.input_names):
            raise TypeError(f"{self.path} takes {len(self.input_names)} inputs ({', '.join(self.input_names)}), got {len(inputs)}")
        inputs = [x.contiguous() for x in inputs]
        pending = self.session.forward([triple(x, n) for x, n in zip(inputs, self.input_names)], [], False, 0)
        try:
            outs = read_outputs(pending, len(self.output_names))
        finally:
            pending.release()
        return outs[0] if len(outs) == 1 else tuple(outs)


def load_onnx(path: str) -> OnnxModel:
    return OnnxModel(path)
