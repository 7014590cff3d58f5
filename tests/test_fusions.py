"""Fused vs unfused: every graph pass (engine/src/passes/) is checked by training the same model
with the pass on and with all passes off (ORTRAIN_DISABLE_PASSES=all), from the same start on
the same batches: the loss and every parameter gradient of the first step, and the loss after a
few Adam steps, agree to fp32 rounding. Each case also asserts that the pass really rewrote
something in that model, so a pattern that silently stops matching fails here."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

import ortrain  # noqa: E402

STEPS = 5


def _tutorial():
    model, inputs, _ = models.tutorial_transformer(500, dropout=0.0)
    ntok = 500

    def loss_fn(out, x):
        return torch.nn.functional.cross_entropy(out.view(-1, ntok), x.reshape(-1))
    return model, inputs, loss_fn


# model builder; the pass; how many rewrites it must at least make in that model
CASES = {
    "tutorial-fuse_linear": (_tutorial, "fuse_linear", 5),
    "gpt2-fuse_linear": (lambda: models.gpt2_small(vocab=200, dropout=0.0), "fuse_linear", 1),
    "bert-fuse_linear": (lambda: models.bert_small(vocab=200, dropout=0.0), "fuse_linear", 5),
}


def _train(model, inputs, loss_fn, disable: str | None, monkeypatch):
    if disable is None:
        monkeypatch.delenv("ORTRAIN_DISABLE_PASSES", raising=False)
    else:
        monkeypatch.setenv("ORTRAIN_DISABLE_PASSES", disable)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ortrain.accelerate(model, opt, strict=True)
    losses, grads = [], None
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model(*inputs), *inputs)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    (runner,) = [r for r in model._ortrain_state.runners.values()]
    return losses, grads, dict(runner.session.passes)


@pytest.mark.parametrize("case", list(CASES))
def test_pass_matches_unfused(case, monkeypatch):
    build, name, min_rewrites = CASES[case]
    torch.manual_seed(0)
    model, inputs, loss_fn = build()
    fused_model, plain_model = copy.deepcopy(model), copy.deepcopy(model)
    fused, fused_grads, rewrites = _train(fused_model, inputs, loss_fn, None, monkeypatch)
    plain, plain_grads, plain_rewrites = _train(plain_model, inputs, loss_fn, "all", monkeypatch)
    assert rewrites.get(name, 0) >= min_rewrites, f"{name} rewrote {rewrites.get(name, 0)} sites, expected ≥ {min_rewrites}"
    assert plain_rewrites == {}, f"ORTRAIN_DISABLE_PASSES=all still ran {plain_rewrites}"
    print(f"\n{case}: {rewrites}; losses fused {fused[-1]:.6f} unfused {plain[-1]:.6f}")
    assert abs(fused[0] - plain[0]) <= 1e-6 * abs(plain[0])
    for n, g in plain_grads.items():
        scale = max(g.abs().max().item(), 1e-6)
        diff = (fused_grads[n] - g).abs().max().item() / scale
        assert diff <= 1e-4, f"{n}: fused gradient differs by {diff:.2e} (relative to its max)"
    for a, b in zip(fused, plain):
        assert abs(a - b) <= 1e-4 * abs(b), f"loss curves diverge: {fused} vs {plain}"


def test_unknown_pass_name_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("ORTRAIN_DISABLE_PASSES", "fuse_everything")
    model, inputs, _ = models.tutorial_transformer(50, dropout=0.0)
    ortrain.accelerate(model, strict=True)
    with pytest.raises(ortrain.OrtrainError, match="unknown pass 'fuse_everything'.*fuse_linear"):
        model(*inputs)
