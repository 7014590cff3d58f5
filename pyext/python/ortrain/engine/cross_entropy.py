"""The model with a softmax cross-entropy appended, as one engine graph: what a user's
`criterion(output.view(-1, C), target)` becomes when it is fused (engine/lazy.py). The loss and
its gradient are computed inside the engine: the logits and their gradient never round-trip
through PyTorch. The graph's only output is the loss: the engine's fuse_linear_cross_entropy
pass then computes the LM head and the loss chunk by chunk (a few hundred rows at a time on the
CPU, thousands on a GPU), and the logits never exist whole; a user who reads the logits gets
them from a forward-only replay (engine/lazy.py)."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .function import EngineFunction
from .runner import Runner


class FusedCrossEntropyLoss(EngineFunction):
    """EngineFunction for model + cross-entropy: the loss's grad_fn reads
    `FusedCrossEntropyLossBackward`, so tools that recognise a cross-entropy loss by its grad_fn
    (perplexity logging) still do."""

TARGET = "ortrain_ce_target"
LOSS = "ortrain_ce_loss"


def _with_cross_entropy(onnx_bytes: bytes, slices, classes: int, ignore_index: int, reduction: str) -> bytes:
    """The only output becomes the loss; one new input, the int64 targets. `slices` ((axis, start, stop), ...) are applied to the logits before
    the rows are formed."""
    model = onnx.load_from_string(onnx_bytes)
    g = model.graph
    logits = g.output[0].name
    scores = logits
    if slices:
        big = np.iinfo(np.int64).max
        for name, values in (("starts", [0 if a is None else a for _, a, _ in slices]),
                             ("ends", [big if b is None else b for _, _, b in slices]),
                             ("axes", [axis for axis, _, _ in slices])):
            g.initializer.append(numpy_helper.from_array(np.array(values, dtype=np.int64), f"ortrain_ce_{name}"))
        g.node.append(helper.make_node("Slice", [logits, "ortrain_ce_starts", "ortrain_ce_ends", "ortrain_ce_axes"],
                                       ["ortrain_ce_sliced"], name="ortrain_ce_slice"))
        scores = "ortrain_ce_sliced"
    g.initializer.append(numpy_helper.from_array(np.array([-1, classes], dtype=np.int64), "ortrain_ce_shape"))
    g.node.append(helper.make_node("Reshape", [scores, "ortrain_ce_shape"], ["ortrain_ce_rows"], name="ortrain_ce_reshape"))
    g.node.append(helper.make_node("SoftmaxCrossEntropyLoss", ["ortrain_ce_rows", TARGET], [LOSS],
                                   name="ortrain_ce_loss", reduction=reduction, ignore_index=ignore_index))
    g.input.append(helper.make_tensor_value_info(TARGET, TensorProto.INT64, ["ortrain_ce_n"]))
    del g.output[:]
    g.output.append(helper.make_empty_tensor_value_info(LOSS))
    return model.SerializeToString()


class CrossEntropyRunner(Runner):
    """A Runner over the model + loss graph; its one output is the loss."""

    seeded_outputs = (True,)
    function = FusedCrossEntropyLoss

    def __init__(self, module, exported, slices, classes: int, ignore_index: int, reduction: str, precision: str = "fp32",
                 device: str = "cpu"):
        # the CPU's fused LM head + loss makes its weight gradients in the forward pass: written
        # straight into the gradient tensors, they take no arena space until the backward (the
        # CUDA plans keep them in the arena)
        self.grads_at_forward = device == "cpu"
        fused = dataclasses.replace(
            exported,
            onnx_bytes=_with_cross_entropy(exported.onnx_bytes, slices, classes, ignore_index, reduction),
            input_names=list(exported.input_names) + [TARGET],
            output_names=[LOSS],
        )
        super().__init__(module, fused, precision, device)
