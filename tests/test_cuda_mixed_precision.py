"""Mixed precision on a GPU with `accelerate(model, opt, device="cuda", precision=...)`: bf16
tensor-core matmuls against PyTorch's bf16 autocast, fp16 with the engine's dynamic loss scaler
against autocast with a GradScaler, and the tutorial model's 200-step bf16 loss curve (issue 6).
Skipped (with the reason) where there is no usable GPU."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import ortrain
from conftest import require_cuda
from test_cuda_train import _max_rel, _mlp, _mlp_batches

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _gpu():
    require_cuda()
    yield


def test_bf16_matmuls_on_the_gpu_are_autocasts_matmuls():
    """precision="bf16" on CUDA runs the f32 matmuls on bf16 tensor cores (operands rounded to
    bf16, f32 accumulation and result): the outputs agree with
    PyTorch's bf16 autocast to bf16's precision and are not the exact f32 ones, the gradients
    are no further from the exact f32 gradients than autocast's, and explain() says so."""
    ref = _mlp()
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs fp32" warning any more
        ortrain.accelerate(model, device="cuda", strict=True, fuse_loss=False, precision="bf16")
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(64, 16, device="cuda", generator=g)
    y = torch.randint(0, 10, (64,), device="cuda", generator=g)
    out = model(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = ref(x)
    with torch.no_grad():
        exact = copy.deepcopy(ref)(x)
    assert out.dtype == torch.float32
    assert _max_rel(out, want.float()) < 2e-2, _max_rel(out, want.float())
    assert _max_rel(out, exact) > 1e-4, "the matmuls ran in f32"
    exact_model = copy.deepcopy(ref)
    nn.functional.cross_entropy(out, y).backward()
    nn.functional.cross_entropy(want.float(), y).backward()
    nn.functional.cross_entropy(exact_model(x), y).backward()
    for (name, p), q, e in zip(model.named_parameters(), ref.parameters(), exact_model.parameters()):
        ours, autocast = _max_rel(p.grad, e.grad), _max_rel(q.grad.float(), e.grad)
        print(f"{name}: ortrain bf16 {ours:.2e}, autocast {autocast:.2e} from the f32 gradient")
        assert ours < 2 * autocast + 1e-2, (name, ours, autocast)
    assert "matmuls bf16 on cuBLAS tensor cores" in ortrain.explain(model)


def test_fp16_trains_like_autocast_with_a_grad_scaler():
    """precision="fp16" on CUDA: fp16-or-better tensor-core matmuls with the engine's dynamic loss
    scaler (start 2^16). The loss curve follows PyTorch's fp16 autocast + GradScaler, no step is
    skipped, the gradients reaching .grad are unscaled, explain() names both."""
    ref = _mlp()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ortrain.accelerate(model, opt, device="cuda", strict=True, fuse_loss=False, precision="fp16")
    scaler = torch.amp.GradScaler("cuda")
    batches = _mlp_batches(4)
    ours, theirs = [], []
    for step in range(30):
        x, y = batches[step % 4]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if step == 0:
            exact = copy.deepcopy(ref)
            nn.functional.cross_entropy(exact(x), y).backward()
            for (name, p), e in zip(model.named_parameters(), exact.parameters()):
                assert _max_rel(p.grad, e.grad) < 1e-2, (name, _max_rel(p.grad, e.grad))  # unscaled
        opt.step()
        ours.append(loss.item())
        opt_ref.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            ref_loss = nn.functional.cross_entropy(ref(x), y)
        scaler.scale(ref_loss).backward()
        scaler.step(opt_ref)
        scaler.update()
        theirs.append(ref_loss.item())
    diffs = [abs(a - b) / abs(b) for a, b in zip(ours, theirs)]
    print("ortrain fp16", [f"{v:.4f}" for v in ours[::6]], "autocast", [f"{v:.4f}" for v in theirs[::6]])
    assert max(diffs) < 3e-2, (ours, theirs)
    assert ours[-1] < ours[0] * 0.8
    state = ortrain.loss_scale(model)
    assert state["steps"] == 30 and state["skipped_steps"] == 0 and state["scale"] == 2.0**16, state
    text = ortrain.explain(model)
    assert "matmuls fp16 on cuBLAS tensor cores" in text and "dynamic loss scale 65536" in text, text


def test_two_hundred_bf16_steps_follow_autocast_within_bf16_noise():
    """precision="bf16" on the GPU over 200 steps of the tutorial model on real prose (Adam, clip
    0.5, the loss fused, CUDA graphs on from the second step), against PyTorch's bf16 autocast:
    the mean relative loss difference stays within 3x the noise references (autocast against
    fp32, which is what bf16 rounding does; ortrain fp32 against PyTorch fp32, which is what the
    summation order does over 200 steps), and both end at the same loss within 1%."""
    from test_bf16 import NTOK, _curve, _mean_rel, _text_batches

    import models

    base = models.tutorial_transformer(NTOK, dropout=0.0, seed=0)[0].cuda()
    batches = [(x.cuda(), y.cuda()) for x, y in _text_batches(200)]
    c = {s: _curve(base, batches, s, device="cuda") for s in ("torch_fp32", "torch_bf16", "ort_fp32", "ort_bf16")}
    noise = _mean_rel(c["torch_bf16"], c["torch_fp32"])
    d32 = _mean_rel(c["ort_fp32"], c["torch_fp32"])
    d = _mean_rel(c["ort_bf16"], c["torch_bf16"])
    print(f"GPU, 200 steps, mean relative loss difference: ortrain bf16 vs autocast {d:.2e}; autocast vs "
          f"torch fp32 {noise:.2e}; ortrain fp32 vs torch fp32 {d32:.2e}; last losses "
          + ", ".join(f"{k} {v[-1]:.4f}" for k, v in c.items()))
    assert c["ort_bf16"][-1] < c["ort_bf16"][0] - 2.0, "the model did not learn"
    assert d < 3 * max(noise, d32), (d, noise, d32)
    assert abs(c["ort_bf16"][-1] - c["torch_bf16"][-1]) < 0.01 * c["torch_bf16"][-1]
