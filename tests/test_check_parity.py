"""`ortrain.check_parity` and `%%ort --check` find where the engine and PyTorch part ways: on a
healthy model every intermediate value agrees; with a real fault injected into one engine kernel
(ORTRAIN_FAULT_INJECT, engine/src/exec/fault.rs) the report names the PyTorch op and module whose
output diverges first, and the gradients that follow from it."""
from __future__ import annotations

import torch

import ortrain
from models import tutorial_inputs, tutorial_transformer
from test_magics import LOOP, SETUP


def test_check_parity_agrees_on_the_tutorial_model():
    model, _, _ = tutorial_transformer(dropout=0.2, seq=8, batch=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = ortrain.check_parity(model, *tutorial_inputs(seq=8, batch=3))
    assert report.ok, str(report)
    assert report.first is None and report.compared >= 50
    assert report.output_rel < 1e-5 and report.export_rel < 1e-6
    assert len(report.grads) == sum(1 for p in model.parameters() if p.requires_grad)
    assert "forward: all" in str(report) and "dropout set to 0" in str(report)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the model is not changed
    assert not ortrain.is_accelerated(model)


def test_check_parity_names_the_first_diverging_op(monkeypatch):
    model, _, _ = tutorial_transformer(dropout=0.0, seq=8, batch=3)
    # the engine runs the attention (its products and softmax) as one fused Attention node
    monkeypatch.setenv("ORTRAIN_FAULT_INJECT", "Attention")
    report = ortrain.check_parity(model, *tutorial_inputs(seq=8, batch=3))
    assert not report.ok
    first = report.first
    assert first.torch_op.startswith("aten.scaled_dot_product_attention")
    assert first.module == "transformer_encoder.layers.0.self_attn"
    assert "Softmax" in first.onnx_ops
    assert first.rel > 1e-2
    text = str(report)
    assert "first diverging op: aten.scaled_dot_product_attention.default in transformer_encoder.layers.0.self_attn" in text
    assert "beyond tolerance" in text  # the parameter gradients behind it differ too


def test_magic_check_reports_the_first_diverging_op(shell, capsys, monkeypatch):
    assert shell.run_cell(SETUP).success
    monkeypatch.setenv("ORTRAIN_FAULT_INJECT", "Gather")
    before = {k: v.clone() for k, v in shell.user_ns["model"].state_dict().items()}
    res = shell.run_cell("%%ort --check --max-steps 2\n" + LOOP.format(n=10, extra=""))
    assert res.success, res.error_in_exec
    out = capsys.readouterr().out
    assert "ortrain --check: step 1 diverges" in out
    assert "first diverging op: aten.embedding.default in 0: ONNX Gather node" in out, out
    after = shell.user_ns["model"].state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())  # --check leaves the model as it was


def test_public_names_stay_functions_after_internal_use():
    """A fresh process that first builds an ORTTrainer and runs check_parity can still call
    ortrain.accelerate (the submodule of the same name must not shadow the function)."""
    import subprocess
    import sys

    code = (
        "import torch, ortrain\n"
        "from ortrain.optim import SGDConfig\n"
        "m = torch.nn.Linear(4, 2)\n"
        "ortrain.ORTTrainer(m, {'inputs': [('x', ['b', 4])], 'outputs': [('y', ['b', 2], True)]}, SGDConfig())\n"
        "ortrain.check_parity(m, torch.randn(3, 4))\n"
        "assert callable(ortrain.accelerate) and callable(ortrain.deaccelerate), ortrain.accelerate\n"
        "ortrain.accelerate(m)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
