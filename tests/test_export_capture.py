"""ortrain/export/capture.py's shortcuts in the one trace:
- shape rules: the kept linear, layer_norm and scaled_dot_product_attention ops get their output
  types from the input shapes instead of their decomposition on fake tensors;
- only the CompositeImplicitAutograd ops whose decomposition is not their own are overridden.
For every model the export with a shortcut is the export without it: the same ONNX graph (value
names aside: the rules record fewer dead symbolic nodes, which renumbers FX names), the same type
of every tensor node of the captured program, and the same symbol ranges."""
import onnx
import pytest
import torch

import models
from ortrain.export import capture, dynamo, export_module


def _canonical(onnx_bytes: bytes):
    """The graph with every value renamed by first appearance: node ops, domains, attributes
    and wiring, and the output types."""
    model = onnx.load_from_string(onnx_bytes)
    names: dict = {}

    def name(x):
        if x and x not in names:
            names[x] = f"v{len(names)}"
        return names.get(x, "")

    for v in list(model.graph.input) + list(model.graph.initializer):
        name(v.name)
    nodes = [(n.op_type, n.domain, tuple(map(name, n.input)), tuple(map(name, n.output)),
              tuple(a.SerializeToString() for a in n.attribute)) for n in model.graph.node]
    outputs = [(name(o.name), o.type.SerializeToString()) for o in model.graph.output]
    return nodes, outputs


def _tensor_types(program):
    return [(str(n.target), tuple(map(str, v.shape)), tuple(map(str, v.stride())), v.dtype)
            for n in program.graph.nodes if isinstance(v := n.meta.get("val"), torch.Tensor)]


def _export(model, args, training, rules, monkeypatch, all_overrides=False):
    with monkeypatch.context() as m:
        if not rules:
            m.setattr(capture, "_kept_rules", lambda: {})
        if all_overrides:
            m.setattr(capture, "_overrides_that_change_something", lambda cia: cia)
        applied = []
        rule = capture._apply_rule

        def counting(*a, **kw):
            applied.append(a[1])
            return rule(*a, **kw)

        m.setattr(capture, "_apply_rule", counting)
        torch.manual_seed(0)
        with dynamo.capture_programs() as programs:
            graph = export_module(model, args, training=training, weights=False)
    assert graph.exporter == "dynamo" and len(programs) == 1
    program = programs[0]
    return _canonical(graph.onnx_bytes), _tensor_types(program), str(program.range_constraints), applied


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(16, 4, dropout=0.1, batch_first=True)
        self.out = torch.nn.Linear(16, 8)

    def forward(self, x, mask=None):
        return self.out(self.attn(x, x, x, need_weights=False, attn_mask=mask)[0])


class _Sdpa(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 32)

    def forward(self, x):
        q = self.qkv(x).view(x.shape[0], x.shape[1], 2, 16).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=0.1)


class _Norms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.LayerNorm(16)
        self.b = torch.nn.LayerNorm([5, 16], elementwise_affine=False)

    def forward(self, x):
        return self.a(x.transpose(0, 1)) + self.b(x).transpose(0, 1)


_X = torch.randn(3, 5, 16)
CASES = {
    "tutorial": lambda: (models.tutorial_transformer(50, dropout=0.2, seed=0)[0], (torch.randint(0, 50, (7, 4)),)),
    "mha": lambda: (_Attention(), (_X,)),
    "mha-float-mask": lambda: (_Attention(), (_X, torch.zeros(5, 5))),
    "mha-bool-mask": lambda: (_Attention(), (_X, torch.ones(5, 5, dtype=torch.bool).triu(1))),
    "sdpa-causal": lambda: (_Sdpa(), (_X,)),
    "linear-2d": lambda: (torch.nn.Linear(16, 4), (torch.randn(7, 16),)),
    "linear-strided": lambda: (torch.nn.Linear(16, 4), (torch.randn(2, 7, 16).transpose(0, 1),)),
    "linear-no-bias": lambda: (torch.nn.Linear(16, 4, bias=False), (torch.randn(2, 7, 16),)),
    "layer-norms": lambda: (_Norms(), (_X,)),
}


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", list(CASES))
def test_shape_rules_change_nothing_in_the_export(case, training, monkeypatch):
    monkeypatch.setenv("ORTRAIN_EXPORT_DISK_CACHE", "0")
    model, args = CASES[case]()
    with_rules = _export(model, args, training, True, monkeypatch)
    without = _export(model, args, training, False, monkeypatch)
    assert without[3] == []
    assert with_rules[0] == without[0], "ONNX graph"
    assert with_rules[1] == without[1], "tensor types of the captured program"
    assert with_rules[2] == without[2], "symbol ranges"
    if training:  # every case has an op the rules make (attention only with dropout)
        assert with_rules[3], "no rule applied"


def _untied(model):
    """The model with every parameter its own tensor (tied models take torch.onnx's own two
    traces, not the one trace)."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(p.detach().clone()))
    return model


OVERRIDE_CASES = {
    "tutorial": CASES["tutorial"],
    "mha-bool-mask": CASES["mha-bool-mask"],
    "cnn": lambda: (models.small_cnn()[0], (models.cnn_inputs(batch=5)[0],)),
    "gpt2-untied": lambda: (_untied(models.gpt2_small(vocab=200, dropout=0.1)[0]),
                            (models.gpt2_inputs(vocab=200, batch=3, seq=20)[0],)),
}


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", list(OVERRIDE_CASES))
def test_fewer_overrides_change_nothing_in_the_export(case, training, monkeypatch):
    monkeypatch.setenv("ORTRAIN_EXPORT_DISK_CACHE", "0")
    if case == "gpt2-untied":
        pytest.importorskip("transformers")
    model, args = OVERRIDE_CASES[case]()
    fewer = _export(model, args, training, True, monkeypatch)
    every = _export(model, args, training, True, monkeypatch, all_overrides=True)
    assert fewer[:3] == every[:3]


def test_attention_errors_are_still_raised(monkeypatch):
    # a call the decomposition rejects (mask with is_causal) still fails to export
    monkeypatch.setenv("ORTRAIN_EXPORT_DISK_CACHE", "0")

    class Both(torch.nn.Module):
        def forward(self, q, mask):
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask, dropout_p=0.1,
                                                                    is_causal=True)

    q, mask = torch.randn(2, 2, 5, 8), torch.zeros(5, 5)
    with pytest.raises(RuntimeError):
        Both()(q, mask)
    from ortrain.export import ExportError
    with pytest.raises(ExportError):
        export_module(Both(), (q, mask), exporter="dynamo", weights=False)
