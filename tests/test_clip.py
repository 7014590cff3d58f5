"""torch.nn.utils.clip_grad_norm_ on accelerated CPU models runs in the engine
(ortrain/engine/clip.py) and gives what torch's gives: the same total norm and the same clipped
gradients; what it does not cover goes to torch's own function."""
from __future__ import annotations

import copy
import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

import ortrain  # noqa: E402
from ortrain import _ortrain  # noqa: E402
from ortrain.engine import clip  # noqa: E402

V = 300


def _model_with_grads(accelerated: bool, scale: float = 1.0):
    model, (x,), loss_fn = models.tutorial_transformer(V, dropout=0.0)
    if accelerated:
        ortrain.accelerate(model, torch.optim.Adam(model.parameters(), lr=1e-3), strict=True)
    (loss_fn(model(x), x) * scale).backward()
    return model


def _torch_clip(params, *args, **kwargs):
    """torch's own function, whatever is patched."""
    return clip._ORIGINAL[0](params, *args, **kwargs) if clip._ORIGINAL else torch.nn.utils.clip_grad_norm_(params, *args, **kwargs)


def _count_engine_calls(monkeypatch) -> list:
    calls = []
    real = _ortrain.clip_by_global_norm
    monkeypatch.setattr(_ortrain, "clip_by_global_norm", lambda t, *a: calls.append(len(t)) or real(t, *a))
    return calls


@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["clipped", "under-the-limit"])
def test_engine_clip_matches_torch(max_norm, monkeypatch):
    model = _model_with_grads(accelerated=True)
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref_params = []
    for n, p in model.named_parameters():
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = ref[n]
        ref_params.append(q)
    calls = _count_engine_calls(monkeypatch)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    want = _torch_clip(ref_params, max_norm)
    assert calls == [len(ref_params)], "the engine did not clip"
    assert total.dtype == torch.float32 and total.shape == ()
    assert abs(total.item() - want.item()) <= 1e-6 * want.item()
    for (n, p), q in zip(model.named_parameters(), ref_params):
        d = (p.grad - q.grad).abs().max().item()
        assert d <= 1e-6 * max(q.grad.abs().max().item(), 1e-12), n
    if max_norm > total.item():
        for n, p in model.named_parameters():  # a coefficient of 1: gradients unchanged
            assert torch.equal(p.grad, ref[n]), n
    assert "call(s) in the engine" in ortrain.explain(model)


def test_accelerated_training_loop_with_clip_follows_pytorch():
    torch.manual_seed(0)
    model, (x,), loss_fn = models.tutorial_transformer(V, dropout=0.0, activation="gelu")
    ref = copy.deepcopy(model)
    opt, opt_ref = torch.optim.Adam(model.parameters(), lr=1e-3), torch.optim.Adam(ref.parameters(), lr=1e-3)
    ortrain.accelerate(model, opt, strict=True)
    for _ in range(3):
        norms = []
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            loss_fn(m(x), x).backward()
            norms.append(_torch_clip(list(m.parameters()), 0.5) if m is ref
                         else torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
            o.step()
        assert abs(norms[0].item() - norms[1].item()) <= 1e-4 * norms[1].item()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p - q).abs().max().item() <= 1e-4, n


def test_what_the_engine_does_not_cover_goes_to_torch(monkeypatch):
    calls = _count_engine_calls(monkeypatch)
    model = _model_with_grads(accelerated=True)
    plain = _model_with_grads(accelerated=False)
    grads = [p.grad.clone() for p in model.parameters()]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for q, g in zip(ref, grads):
        q.grad = g
    # another norm: torch's result, from torch's function
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, norm_type=float("inf"))
    assert torch.equal(total, _torch_clip(ref, 0.1, norm_type=float("inf")))
    assert "in PyTorch (last: norm_type=inf)" in ortrain.explain(model)
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)  # a model that is not accelerated
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))  # a gradient that is not f32
    w.grad = torch.full((3,), 4.0, dtype=torch.float64)
    assert torch.nn.utils.clip_grad_norm_([w], 1.0).dtype == torch.float64
    monkeypatch.setenv("ORTRAIN_ENGINE_CLIP", "0")  # the engine path turned off
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    assert calls == []


def test_explain_counts_each_models_own_clips():
    """explain() counts the clips of that model's gradients, not every accelerated model's."""
    a, b, never = (_model_with_grads(accelerated=True) for _ in range(3))
    for _ in range(3):
        torch.nn.utils.clip_grad_norm_(a.parameters(), 1.0)
    torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0)
    torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0, norm_type=float("inf"))
    assert "clip_grad_norm_ of its gradients: 3 call(s) in the engine\n" in ortrain.explain(a) + "\n"
    assert "clip_grad_norm_ of its gradients: 1 call(s) in the engine, 1 in PyTorch (last: norm_type=inf)" in ortrain.explain(b)
    assert "clip_grad_norm_" not in ortrain.explain(never)


def test_a_dropped_model_is_freed_after_its_clips():
    """The per-model clip counts and the parameter cache hold accelerated models weakly."""
    import gc
    import weakref

    model = _model_with_grads(accelerated=True)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_single_tensors_generators_and_nonfinite_norms():
    model = _model_with_grads(accelerated=True)
    p = model.decoder.bias
    total = torch.nn.utils.clip_grad_norm_(p, 1e-3).item()  # one tensor, not a list
    assert total > 1e-3
    want = 1e-3 * total / (total + 1e-6)
    assert abs(p.grad.norm().item() - want) <= 1e-5 * want
    with warnings.catch_warnings(record=True) as seen:  # an empty generator warns as in torch
        warnings.simplefilter("always")
        assert torch.nn.utils.clip_grad_norm_((q for q in []), 1.0).item() == 0.0
    assert any("empty generator" in str(w.message) for w in seen)
    model.decoder.weight.grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).isnan()
