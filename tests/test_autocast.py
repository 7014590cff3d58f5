"""16-bit activations: the opt-in `autocast` graph pass (ORTRAIN_ENABLE_PASSES=autocast) keeps a
bf16 session's activations in bf16 between matmuls by PyTorch autocast's rules (matmuls in
bf16, softmax/normalisation/losses in f32, elementwise ops in the widest operand type). On the
CPU the 16-bit values run widened to f32 (a reference path); the training must follow
`torch.autocast("cpu", dtype=torch.bfloat16)` within the noise bf16 rounding itself puts
between autocast and fp32."""
import copy
import re

import torch

import models
import ortrain
from test_bf16 import NTOK, _mean_rel, _text_batches, _train


def _ort_curve(base, batches, monkeypatch, autocast_pass=True):
    if autocast_pass:
        monkeypatch.setenv("ORTRAIN_ENABLE_PASSES", "autocast")
    else:
        monkeypatch.delenv("ORTRAIN_ENABLE_PASSES", raising=False)
    model = copy.deepcopy(base)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ortrain.accelerate(model, opt, strict=True, precision="bf16")
    losses = _train(model, opt, batches)
    return losses, ortrain.explain(model), model


def _torch_curve(base, batches, autocast):
    model = copy.deepcopy(base)
    return _train(model, torch.optim.Adam(model.parameters(), lr=1e-3), batches, autocast=autocast)


def test_bf16_activations_follow_autocast(monkeypatch):
    base, _, _ = models.tutorial_transformer(NTOK, dropout=0.0, seed=3)
    batches = _text_batches(60)
    fp32 = _torch_curve(base, batches, autocast=False)
    autocast = _torch_curve(base, batches, autocast=True)
    ort, text, _ = _ort_curve(base, batches, monkeypatch)
    ort_rounded, _, _ = _ort_curve(base, batches, monkeypatch, autocast_pass=False)
    rewrites = re.search(r"autocast ×(\d+)", text)
    assert rewrites and int(rewrites.group(1)) >= 8, text
    noise = _mean_rel(autocast, fp32)
    assert noise > 0
    # the same numbers as autocast up to bf16 noise, and learning as it does
    assert _mean_rel(ort, autocast) < 3 * noise + 2e-3, (ort, autocast, noise)
    assert ort[-1] < ort[0] - 0.5, ort
    # and really 16-bit activations: not the f32-activation path's curve
    assert ort != ort_rounded
