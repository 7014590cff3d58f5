"""User-facing API details: keyword and non-tensor arguments, dict outputs, the memory plan
shown before the first step, and running a model that starts as an ONNX file."""
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import models
import ortrain


class _KwModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 3)

    def forward(self, x, *, scale=None, double=False):
        h = torch.relu(self.a(x))
        if scale is not None:
            h = h * scale
        if double:
            h = h * 2
        return {"logits": self.b(h), "hidden": h}


def test_keyword_tensor_and_flag_arguments_and_dict_outputs():
    torch.manual_seed(0)
    ref = _KwModel()
    acc = ortrain.accelerate(_KwModel())
    acc.load_state_dict(ref.state_dict())
    x, s = torch.randn(4, 6), torch.rand(6)
    for double in (False, True, False):
        out_a = acc(x, scale=s, double=double)
        out_r = ref(x, scale=s, double=double)
        assert set(out_a) == {"logits", "hidden"}
        torch.testing.assert_close(out_a["logits"], out_r["logits"])
        out_a["logits"].sum().backward()
        out_r["logits"].sum().backward()
    torch.testing.assert_close(acc.a.weight.grad, ref.a.weight.grad)
    runners = acc._ortrain_state.runners
    assert len(runners) == 2  # one export per value of the bool flag, reused when it comes back
    assert "runs in PyTorch" not in ortrain.explain(acc)


def test_a_replaced_layer_or_frozen_weight_is_seen_by_the_next_call():
    """The parameter list is cached between calls: replacing a layer after accelerate() (a new
    head) and freezing a weight both reach the next call, which exports again and trains what
    the model now holds."""
    torch.manual_seed(0)
    acc = ortrain.accelerate(_KwModel())
    x = torch.randn(4, 6)
    acc(x)["logits"].sum().backward()
    acc.b = torch.nn.Linear(6, 3)
    ref = _KwModel()
    ref.load_state_dict(acc.state_dict())
    out = acc(x)["logits"]
    torch.testing.assert_close(out, ref(x)["logits"])
    out.sum().backward()
    assert acc.b.weight.grad is not None and acc.b.weight.grad.abs().sum() > 0
    acc.a.weight.requires_grad_(False)
    acc.a.weight.grad = None
    acc(x)["logits"].sum().backward()
    assert acc.a.weight.grad is None and acc.a.bias.grad is not None
    assert len(acc._ortrain_state.runners) == 3


def test_explain_with_example_inputs_holding_no_tensor_names_its_signature():
    """A keyword explain() does not have (verbose=True) is an example input; holding no tensor,
    it is an error that shows explain's signature, not an exporter's message."""
    model = torch.nn.Linear(4, 2)
    ortrain.accelerate(model)
    with pytest.raises(TypeError, match=r"explain\(model, \*example_args, profile=False, \*\*example_kwargs\): "
                                        r"the example inputs \(verbose=True\) hold no tensor"):
        ortrain.explain(model, verbose=True)
    assert "not called yet" in ortrain.explain(model)


def test_explain_shows_the_plan_before_the_first_step():
    model, (x,), _ = models.tutorial_transformer(1000, dropout=0.0)
    ortrain.accelerate(model)
    text = ortrain.explain(model, x)
    assert "peak arena" in text and "MiB" in text and "exporter" in text
    assert model._ortrain_state.engine_calls == 0
    # what fills the plan at its peak: the values alive then, grouped, largest group first; the
    # LM head's [35, 20, 1000] f32 logits (the largest single value of the tutorial's forward)
    # are among them, beside groups such as the attention's q, k, v kept for the backward pass
    peak = next(line for line in text.splitlines() if "alive at the peak" in line)
    groups = peak.split("largest: ")[1].split("; ")
    assert "Linear float32 [35, 20, 1000] 2.7 MiB" in groups, peak
    sizes = [float(g.rsplit(" ", 2)[1]) for g in groups]
    assert sizes == sorted(sizes, reverse=True), peak
    alive = float(peak.split(" MiB alive")[0])
    arena = float(text.split("peak arena ")[1].split(" MiB")[0])
    assert 0.5 * arena <= alive <= arena, (alive, arena)


def test_onnx_file_with_external_data(tmp_path):
    w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 32])],
                          [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "model.onnx"
    onnx.save_model(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)
    assert (tmp_path / "weights.bin").exists()
    model = ortrain.load_onnx(str(path))
    x = torch.randn(5, 64)
    torch.testing.assert_close(model(x), x @ torch.from_numpy(w))
