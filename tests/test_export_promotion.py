"""ortrain/export/promotion.py: torch.onnx's type-promotion pass is skipped exactly where it would
change nothing. For every model, the skip decision is checked against the pass itself run on a
copy of the same graph, and the exported graph is the same whether the pass ran or not."""
import copy

import onnx
import pytest
import torch

import models
from ortrain.export import export_module, promotion


class _Spy:
    """Records, for every graph the export hands to the pass, ortrain's decision and whether
    torch's own pass changes (a copy of) that graph."""

    def __init__(self, monkeypatch, force=False):
        from torch.onnx._internal.exporter import _fx_passes

        self.seen = []
        self._pass = _fx_passes.insert_type_promotion_nodes
        decide = promotion.needs_promotion

        def needs_promotion(gm):
            twin = copy.deepcopy(gm)
            before = str(twin.graph)
            self._pass(twin)
            self.seen.append((decide(gm), str(twin.graph) != before))
            return True if force else self.seen[-1][0]

        monkeypatch.setattr(promotion, "needs_promotion", needs_promotion)
        monkeypatch.setenv("ORTRAIN_EXPORT_DISK_CACHE", "0")
        monkeypatch.setenv("ORTRAIN_EXPORT_IN_CHILD", "0")  # the spy records in this process


class _Promoting(torch.nn.Module):
    """Needs casts: an int64 input times a float, added to a float parameter."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))

    def forward(self, ids, x):
        return x * self.w + ids * 0.5 + torch.tensor(2, dtype=torch.float64).float()


def _zoo(name):
    builder, _ = models.ZOO[name]
    kw = {"tutorial": dict(ntokens=50, dropout=0.1), "gpt2": dict(vocab=100), "bert": dict(vocab=100),
          "cnn": dict()}[name]
    model, example, _ = builder(**kw)
    return model, example


CASES = ["tutorial", "gpt2", "bert", "cnn", "promoting"]


def _case(name):
    if name == "promoting":
        return _Promoting(), (torch.arange(12).reshape(3, 4), torch.randn(3, 4))
    return _zoo(name)


@pytest.mark.parametrize("name", CASES)
def test_skipped_only_where_the_pass_changes_nothing(name, monkeypatch):
    spy = _Spy(monkeypatch)
    model, example = _case(name)
    export_module(model, example, exporter="dynamo", weights=False)
    assert spy.seen, "the export never reached the type-promotion pass"
    for decided, changed in spy.seen:
        assert decided == changed, (name, spy.seen)
    if name in ("promoting", "gpt2"):  # these need casts: the pass runs
        assert any(changed for _, changed in spy.seen)
    if name == "tutorial":  # the case the skip is for
        assert not any(changed for _, changed in spy.seen)


@pytest.mark.parametrize("name", ["tutorial", "promoting"])
def test_same_graph_with_and_without_the_pass(name, monkeypatch):
    model, example = _case(name)
    torch.manual_seed(0)
    skipped = export_module(model, example, exporter="dynamo", weights=False)
    _Spy(monkeypatch, force=True)
    torch.manual_seed(0)
    forced = export_module(model, example, exporter="dynamo", weights=False)
    a, b = onnx.load_from_string(skipped.onnx_bytes), onnx.load_from_string(forced.onnx_bytes)
    assert [(n.op_type, list(n.input), list(n.output)) for n in a.graph.node] == \
        [(n.op_type, list(n.input), list(n.output)) for n in b.graph.node]
    assert skipped.onnx_bytes == forced.onnx_bytes
