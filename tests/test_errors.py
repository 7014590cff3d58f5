"""Bad input gets a message naming the thing, and the process (and the user's training) survives."""
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import ortrain
from ortrain import _ortrain


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _f32(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


W = numpy_helper.from_array(np.ones((4,), np.float32), "w")


def test_truncated_file_names_the_problem():
    ok = _model([helper.make_node("Mul", ["x", "w"], ["y"], name="mul")], [_f32("x", [2, 4])], [_f32("y", [2, 4])], [W])
    with pytest.raises(_ortrain.EngineError, match="invalid ONNX model: ModelProto"):
        _ortrain.Session(ok[: len(ok) // 2], ["w"], [True])
    with pytest.raises(_ortrain.EngineError, match="invalid ONNX model"):
        _ortrain.Session(b"definitely not a model", [], [])


def test_unknown_op_names_op_and_node():
    m = _model([helper.make_node("Mul", ["x", "w"], ["t"], name="mul"),
                helper.make_node("Hardmax", ["t"], ["y"], name="my_hardmax")],
               [_f32("x", [2, 4])], [_f32("y", [2, 4])], [W])
    with pytest.raises(_ortrain.EngineError, match=r"Hardmax.*my_hardmax"):
        _ortrain.Session(m, ["w"], [True])


def test_op_without_gradient_is_reported_before_the_first_step():
    m = _model([helper.make_node("Mul", ["x", "w"], ["t"], name="mul"),
                helper.make_node("Mod", ["t", "x"], ["y"], name="the_mod", fmod=1)],
               [_f32("x", [2, 4])], [_f32("y", [2, 4])], [W])
    with pytest.raises(_ortrain.EngineError, match=r"no gradient rule for op Mod \(node 'the_mod'\)"):
        _ortrain.Session(m, ["w"], [True])
    _ortrain.Session(m, ["w"], [False])  # frozen: no gradient needed, fine


def test_wrong_input_shape_names_the_input():
    m = _model([helper.make_node("Mul", ["x", "w"], ["y"], name="mul")], [_f32("x", ["batch", 4])], [_f32("y", ["batch", 4])], [W])
    s = _ortrain.Session(m, ["w"], [True])
    w = torch.ones(4)
    x = torch.ones(3, 5)
    with pytest.raises(_ortrain.EngineError, match=r"input 'x': expected shape \[batch, 4\], got \[3, 5\]"):
        s.forward([(x.data_ptr(), "float32", [3, 5])], [w.data_ptr()], True, 0)
    x = torch.ones(3, 4, dtype=torch.float64)
    with pytest.raises(_ortrain.EngineError, match="input 'x': expected element type float32, got float64"):
        s.forward([(x.data_ptr(), "float64", [3, 4])], [w.data_ptr()], True, 0)


class _Atan(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.atan(self.lin(x))


def test_unsupported_model_keeps_training_in_pytorch_with_one_warning():
    model = _Atan()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ortrain.accelerate(model, opt)
    x = torch.randn(8, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    ours = [w for w in caught if "ortrain" in str(w.message)]
    msgs = [str(w.message) for w in ours]
    assert len(msgs) == 1 and "Atan" in msgs[0] and "runs in PyTorch" in msgs[0], msgs
    # attributed to the user's line (here: this test), not to ortrain's or torch's internals
    assert ours[0].filename == __file__, ours[0].filename
    assert "runs in PyTorch" in ortrain.explain(model)


def test_strict_mode_raises_instead():
    model = ortrain.accelerate(_Atan(), strict=True)
    with pytest.raises(ortrain.OrtrainError, match="strict.*Atan"):
        model(torch.randn(2, 4))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="device='tpu' is not one of cpu, cuda"):
        ortrain.accelerate(_Atan(), device="tpu")
    with pytest.raises(TypeError, match="takes an nn.Module"):
        ortrain.accelerate(lambda x: x)
    with pytest.raises(ortrain.OrtrainError, match="CUDA backend is not available"):
        ortrain.accelerate(_Atan(), device="cuda")


def test_a_model_without_gpu_tensors_runs_on_the_current_gpu(monkeypatch):
    """The CUDA engine runs a model on the GPU its tensors are on (one runtime per GPU): a
    data-parallel rank k > 0 on cuda:k is no longer refused. A module with no CUDA tensor yet
    goes to PyTorch's current device. No machine here has a GPU, so the current device is set by
    monkeypatch; tests/test_cuda_multi_gpu.py trains on cuda:1 where there are two."""
    from ortrain.engine.cuda_device import model_gpu

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert model_gpu(_Atan()) == torch.device("cuda", 1)


def test_reaccelerating_on_another_device_is_refused_and_no_device_keeps_the_models():
    model = _Atan()
    ortrain.accelerate(model)
    with pytest.raises(ortrain.OrtrainError, match=r"device='cuda': the model is already accelerated on 'cpu'; call ortrain.deaccelerate"):
        ortrain.accelerate(model, device="cuda")
    ortrain.accelerate(model, precision="fp32")  # device left out: the model's own (cpu)
    assert model.__dict__["_ortrain_state"].device == "cpu"
    ortrain.deaccelerate(model)
