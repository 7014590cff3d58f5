"""Tests of ortrain.export on the model zoo (tests/models.py): which exporter ran, a valid graph
with symbolic input dims, exact parameter names, eval-mode numerics vs PyTorch through
onnx.reference at two shapes, the training-mode Dropout/BatchNorm repairs, and the refusals."""
from __future__ import annotations

import os
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

from ortrain.errors import ExportError  # noqa: E402
from ortrain.export import export_module, signature, unflatten_outputs  # noqa: E402

HF = {"return_dict": False}
# zoo name -> (builder kwargs, call kwargs, exporter that "auto" picks, (small shapes) x2)
CASES = {
    "tutorial": (dict(ntokens=50, dropout=0.0), None, "dynamo",
                 [dict(ntokens=50, seq=7, batch=3), dict(ntokens=50, seq=4, batch=2)]),
    "gpt2": (dict(vocab=100), HF, "dynamo",
             [dict(vocab=100, batch=2, seq=8), dict(vocab=100, batch=3, seq=5)]),
    "bert": (dict(vocab=100), HF, "dynamo",
             [dict(vocab=100, batch=2, seq=8), dict(vocab=100, batch=3, seq=5)]),
    "cnn": (dict(), None, "dynamo", [dict(batch=2), dict(batch=3)]),
}


def _build(name):
    builder, inputs = models.ZOO[name]
    kw, call_kw, expected, shapes = CASES[name]
    model, example, loss_fn = builder(**kw)
    return model, example, call_kw, expected, [inputs(**s) for s in shapes]


@pytest.mark.parametrize("name", list(CASES))
def test_train_export(name):
    model, example, call_kw, expected, _ = _build(name)
    g = export_module(model, example, call_kw, training=True)
    assert g.exporter == expected, g.attempts
    assert g.attempts[-1] == (expected, None)
    proto = onnx.load_from_string(g.onnx_bytes)
    onnx.checker.check_model(proto)
    # every dimension of every tensor input is symbolic
    by_name = {vi.name: vi for vi in proto.graph.input}
    assert g.input_names and set(g.input_names) <= set(by_name)
    for n in g.input_names:
        dims = by_name[n].type.tensor_type.shape.dim
        assert dims and all(d.dim_param for d in dims), (n, dims)
    assert g.static_dims == {}
    # parameters: exact state_dict keys, every trainable parameter covered (directly or via a tie)
    state = model.state_dict()
    init_names = {t.name for t in proto.graph.initializer}
    assert set(g.param_map) <= init_names
    for onnx_name, key in g.param_map.items():
        assert key in state or key in dict(model.named_buffers()), key
        assert g.param_kinds[onnx_name] in ("param", "frozen", "buffer")
    covered = set(g.param_map.values()) | {k for ks in g.aliases.values() for k in ks}
    trainable = {k for k, p in model.named_parameters() if p.requires_grad}
    assert trainable - covered - set(g.unused_params) == set()
    assert {k for k, v in g.param_kinds.items() if v == "param"} <= set(g.param_map)
    assert model.training  # the module's mode is restored


def test_tied_weights_reported():
    model, example, call_kw, _, _ = _build("gpt2")
    g = export_module(model, example, call_kw)
    tied = [ks for ks in g.aliases.values() if "lm_head.weight" in ks]
    assert tied == [["lm_head.weight", "transformer.wte.weight"]]


class GatherElements(OpRun):
    """onnx.reference's GatherElements uses np.choose (at most 64 choices); same op, general."""

    def _run(self, data, indices, axis=None):
        axis = 0 if axis is None else axis
        indices = np.where(indices < 0, indices + data.shape[axis], indices)
        return (np.take_along_axis(data, indices, axis=axis),)


def _run_ref(g, inputs):
    sess = ReferenceEvaluator(g.model(), new_ops=[GatherElements])
    feeds = {n: t.numpy() for n, t in zip(g.input_names, inputs)}
    return sess.run(None, feeds)


@pytest.mark.parametrize("name", list(CASES))
def test_eval_parity_two_shapes(name):
    model, example, call_kw, _, shapes = _build(name)
    model.eval()
    g = export_module(model, shapes[0], call_kw, training=False)
    assert g.dropout_fixes == [] and g.buffer_updates == {}
    for inputs in shapes:
        with torch.no_grad():
            want = model(*inputs, **(call_kw or {}))
        got = _run_ref(g, inputs)
        rebuilt = unflatten_outputs(g.output_structure, [torch.from_numpy(x) for x in got])
        want_t = want if isinstance(want, torch.Tensor) else want[0]
        got_t = rebuilt if isinstance(rebuilt, torch.Tensor) else rebuilt[0]
        assert type(rebuilt) is type(want)
        assert got_t.shape == want_t.shape
        np.testing.assert_allclose(got_t.numpy(), want_t.numpy(), atol=1e-4, rtol=1e-4)


def _dropouts(g):
    proto = g.model()
    consts = {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t)
              for n in proto.graph.node if n.op_type == "Constant" and n.attribute
              and n.attribute[0].name == "value"}
    consts.update({t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer})
    out = {}
    for n in proto.graph.node:
        if n.op_type == "Dropout":
            ratio = float(consts[n.input[1]]) if len(n.input) > 1 and n.input[1] else 0.5
            mode = bool(consts[n.input[2]]) if len(n.input) > 2 and n.input[2] else False
            out[n.name] = (ratio, mode)
    return out


def test_mha_attention_dropout_is_training_mode():
    model, example, _ = models.tutorial_transformer(ntokens=50, dropout=0.2, seq=6, batch=2)
    g = export_module(model, example, exporter="legacy")
    assert sorted(g.dropout_fixes) == ["/transformer_encoder/layers.0/self_attn/Dropout",
                                       "/transformer_encoder/layers.1/self_attn/Dropout"]
    drops = _dropouts(g)
    for fixed in g.dropout_fixes:
        assert drops[fixed] == (pytest.approx(0.2), True)
    assert drops and all(mode and ratio == pytest.approx(0.2) for ratio, mode in drops.values())
    # the fixed attention dropout really drops: two evaluations of the graph differ
    (x,) = example
    a = _run_ref(g, [x])[0]
    b = _run_ref(g, [x])[0]
    assert not np.allclose(a, b)


def test_eval_export_has_no_active_dropout():
    model, example, _ = models.tutorial_transformer(ntokens=50, dropout=0.2, seq=6, batch=2)
    g = export_module(model.eval(), example, training=False, exporter="legacy")
    assert g.dropout_fixes == []
    assert all(not mode for _, mode in _dropouts(g).values())
    assert not model.training


def test_batchnorm_training_mode_and_buffers():
    model, example, _ = models.small_cnn(batch=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for exporter in ("legacy", "dynamo"):
        g = export_module(model, example, exporter=exporter)
        assert g.exporter == exporter
        assert set(g.buffer_updates) == {"features.1.running_mean", "features.1.running_var",
                                         "features.5.running_mean", "features.5.running_var"}
        assert g.param_kinds["features.1.running_mean"] == "buffer"
        assert g.param_kinds["features.1.weight"] == "param"
        for n in g.model().graph.node:
            if n.op_type == "BatchNormalization":
                assert any(a.name == "training_mode" and a.i == 1 for a in n.attribute)
    # exporting did not touch the module's running statistics
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_frozen_parameter_kind():
    model, example, _ = models.small_cnn(batch=2)
    model.features[0].weight.requires_grad_(False)
    g = export_module(model, example, exporter="legacy")
    assert g.param_kinds["features.0.weight"] == "frozen"


def test_bad_exporter_value():
    model, example, _ = models.small_cnn(batch=2)
    with pytest.raises(ValueError, match=r"'onnxruntime'.*'auto', 'legacy', 'dynamo'"):
        export_module(model, example, exporter="onnxruntime")


def test_unsupported_input_names_argument():
    model, example, _ = models.small_cnn(batch=2)
    with pytest.raises(TypeError, match="argument 'labels'"):
        export_module(model, example, {"labels": ["cat", "dog"]})


class NumpyRoundTrip(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        idx = torch.nonzero(x > 0)
        if idx.shape[0] > 3:  # data-dependent Python control flow
            x = torch.from_numpy(np.round(x.detach().numpy()))
        return self.lin(x)


def test_export_error_names_model_and_each_exporter():
    with pytest.raises(ExportError) as info:
        export_module(NumpyRoundTrip(), (torch.randn(3, 4),))
    msg = str(info.value)
    assert "NumpyRoundTrip" in msg and "legacy:" in msg and "dynamo:" in msg, msg


def test_constants_and_signature_and_kwargs():
    model, (ids, mask), _ = models.bert_small(vocab=100, batch=2, seq=6)
    g = export_module(model, (ids,), {"attention_mask": mask, "return_dict": False},
                      exporter="legacy")
    assert g.input_names == ["input_ids", "attention_mask"]
    assert ("return_dict", False) in g.constants
    s1 = signature((ids,), {"attention_mask": mask, "return_dict": False})
    s2 = signature((ids[:, :3],), {"attention_mask": mask[:1], "return_dict": False})
    s3 = signature((ids,), {"attention_mask": mask, "return_dict": True})
    s4 = signature((ids.float(),), {"attention_mask": mask, "return_dict": False})
    assert s1 == s2 == g.signature and s1 != s3 and s1 != s4
    hash(s1)


def test_flat_tensors_follow_flatten_calls_order():
    """The forward's fast path (flat_tensors) hands the engine the same tensors in the same order
    as the export's flattening: nested tuples, lists and dicts, kwargs in the order given."""
    from ortrain.export.inputs import flat_tensors, flatten_call

    t = [torch.randn(2) for _ in range(6)]
    args = (t[0], (t[1], [t[2], 3]), {"b": t[3], "a": None})
    kwargs = {"z": t[4], "mask": {"k": (t[5],)}, "flag": True}
    _, want = flatten_call(torch.nn.Identity(), args, kwargs)
    got = flat_tensors(args, kwargs)
    assert [id(x) for x in got] == [id(x) for x in want] == [id(x) for x in t]


def test_dict_output_structure():
    class DictOut(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x, scale=2.0):
            y = self.lin(x)
            return {"logits": y, "aux": (y * scale, None)}

    g = export_module(DictOut(), (torch.randn(2, 4),), {"scale": 3.0})
    assert g.output_names == ["logits", "aux_0"]
    outs = [torch.zeros(1), torch.ones(1)]
    rebuilt = unflatten_outputs(g.output_structure, outs)
    assert rebuilt["logits"] is outs[0] and rebuilt["aux"][0] is outs[1]
    assert rebuilt["aux"][1] is None


def test_static_when_not_dynamic():
    model, example, _ = models.small_cnn(batch=2)
    g = export_module(model, example, dynamic=False, exporter="legacy")
    assert g.static_dims == {"x": [0, 1, 2, 3]}
