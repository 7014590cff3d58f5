"""A model that computes its own loss, run in training for the loss alone.

Hugging Face's language models are trained as `model(input_ids, labels=labels).loss`: the
exported graph computes the LM head, the logits (a graph output) and the cross-entropy. With the
logits an output the engine must write them whole, and its fused LM head + loss (which never
holds the logits) cannot apply. In training, such a call runs this graph instead: the same
nodes with the loss as the only output. The model's output then holds that loss and, for the
logits, a LazyOutput (engine/lazy.py) computed only if read, by a forward-only replay of the
model's whole graph with the same dropout seed and parameters (the values this step had).

Used only where the engine fuses the LM head into the loss in that graph: for a classifier's
small logits the saving is nothing, and a training loop reading them every step would pay a
replay each time."""
from __future__ import annotations

import dataclasses

import onnx

from .cross_entropy import FusedCrossEntropyLoss
from .function import EngineFunction
from .runner import Runner

#: ONNX ops whose output is a cross-entropy (perplexity is logged for it, ortrain/_steps.py)
_CROSS_ENTROPY_OPS = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
#: ops between that op and a loss output that keep it a per-token loss: casts, and a scaling by
#: something no trainable parameter feeds (HF's sum / num_items_in_batch, a division by the
#: accumulation steps). PyTorch's side of the same rule is ortrain/_steps.py's `loss_kind`: the
#: accelerated run logs perplexity where the baseline does
_CASTS = ("Cast", "Identity")
_SCALINGS = ("Mul", "Div")


def _loss_leaves(structure) -> dict | None:
    """{key: output index} of the tensors of a mapping or ModelOutput `structure`
    (export/outputs.py) holding a `loss` tensor, of tensors and constants only; None otherwise."""
    if structure[0] != "dict" or any(s[0] not in ("tensor", "const") for _, s in structure[1]):
        return None
    leaves = {key: s[1] for key, s in structure[1] if s[0] == "tensor"}
    return leaves if "loss" in leaves else None


def splittable(structure) -> bool:
    """Whether `structure` holds a `loss` and one other tensor: split_outputs may apply (checked
    before asking the engine for the output types, which costs a planning call)."""
    leaves = _loss_leaves(structure)
    return leaves is not None and len(leaves) == 2


def split_outputs(structure, types: list):
    """(loss index, other index) where the output `structure` holds a scalar float `loss` and
    exactly one other tensor, a float of two dimensions or more (the logits); None otherwise."""
    if not splittable(structure):
        return None
    leaves = _loss_leaves(structure)
    loss = leaves.pop("loss")
    (other,) = leaves.values()
    (loss_dtype, loss_shape), (dtype, shape) = types[loss], types[other]
    if not (loss_dtype.is_floating_point and len(loss_shape) == 0 and dtype.is_floating_point and len(shape) >= 2):
        return None
    return loss, other


def loss_is_cross_entropy(graph, name: str, params) -> bool:
    """Whether graph value `name` is a cross-entropy, through casts and through scalings by
    values that none of `params` (the trainable parameters' graph names) feeds."""
    producers = {out: node for node in graph.node for out in node.output}
    node = producers.get(name)
    while node is not None and node.op_type in _CASTS + _SCALINGS:
        if node.op_type in _CASTS:
            node = producers.get(node.input[0])
            continue
        # a Div scales its numerator by a scale; a Mul its one factor that is not a scale
        if node.op_type == "Div":
            scaled = [node.input[0]] if _is_scale(producers, node.input[1], params) else []
        else:
            scaled = [i for i in node.input if not _is_scale(producers, i, params)]
        if len(scaled) != 1:
            return False
        node = producers.get(scaled[0])
    return node is not None and node.op_type in _CROSS_ENTROPY_OPS


def _is_scale(producers: dict, name: str, params) -> bool:
    """Whether no trainable parameter and no cross-entropy feeds graph value `name`."""
    seen, todo = set(), [name]
    while todo:
        value = todo.pop()
        if value in seen:
            continue
        seen.add(value)
        if value in params:
            return False
        node = producers.get(value)
        if node is not None:
            if node.op_type in _CROSS_ENTROPY_OPS:
                return False
            todo.extend(i for i in node.input if i)
    return True


def autograd_function(exported):
    """The autograd.Function for a runner of the model's whole graph: where the model returns
    its own loss and that loss is a cross-entropy, one whose grad_fn names a cross-entropy
    (PyTorch's loss would show NllLossBackward0; `%%ort` logs perplexity for either)."""
    leaves = _loss_leaves(exported.output_structure)
    if leaves is None:
        return EngineFunction
    graph = onnx.load_from_string(exported.onnx_bytes).graph
    loss = graph.output[leaves["loss"]].name
    return FusedCrossEntropyLoss if loss_is_cross_entropy(graph, loss, exported.param_map) else EngineFunction


def _loss_only(exported, loss: int) -> tuple[bytes, bool]:
    """The graph with output `loss` its only output; whether that output is a cross-entropy."""
    model = onnx.load_from_string(exported.onnx_bytes)
    g = model.graph
    is_cross_entropy = loss_is_cross_entropy(g, g.output[loss].name, exported.param_map)
    for o in [o for i, o in enumerate(g.output) if i != loss]:
        g.output.remove(o)
    return model.SerializeToString(), is_cross_entropy


class ModelLossRunner(Runner):
    """A Runner over the model's graph with its loss as the only output."""

    def __init__(self, module, exported, loss: int, precision: str = "fp32", device: str = "cpu"):
        # as CrossEntropyRunner: the CPU's fused LM head + loss writes the weight gradients in
        # the forward pass
        self.grads_at_forward = device == "cpu"
        onnx_bytes, is_cross_entropy = _loss_only(exported, loss)
        # the loss's grad_fn names a cross-entropy where it is one, as the model's in PyTorch does
        self.function = FusedCrossEntropyLoss if is_cross_entropy else EngineFunction
        only = dataclasses.replace(exported, onnx_bytes=onnx_bytes, output_names=[exported.output_names[loss]])
        super().__init__(module, only, precision, device)

    def fuses_lm_head(self) -> bool:
        """Whether the engine computes the LM head and the loss together (the logits never whole)."""
        return dict(self.session.passes).get("fuse_linear_cross_entropy", 0) > 0
