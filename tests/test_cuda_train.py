"""Training on a GPU with `accelerate(model, opt, device="cuda")`, against PyTorch eager on the
same GPU from the same initial weights: outputs, every parameter gradient, and the loss curve of
a few optimizer steps. Skipped (with the reason) where there is no usable GPU."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ortrain

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here (torch.cuda.is_available() is False)")
    ok, why = ortrain.cuda_available()
    if not ok:
        pytest.fail(f"PyTorch sees a GPU but ortrain's CUDA backend does not load: {why}")
    torch.backends.cuda.matmul.allow_tf32 = False
    yield


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)).cuda()


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def test_mlp_outputs_and_gradients_match_eager_on_the_gpu():
    ref = _mlp()
    model = copy.deepcopy(ref)
    ortrain.accelerate(model, device="cuda", strict=True, fuse_loss=False)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(32, 16, device="cuda", generator=g)
    y = torch.randint(0, 10, (32,), device="cuda", generator=g)
    out, want = model(x), ref(x)
    assert out.is_cuda and out.shape == want.shape
    assert _max_rel(out, want) < 1e-5
    nn.functional.cross_entropy(out, y).backward()
    nn.functional.cross_entropy(want, y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.is_cuda, name
        assert _max_rel(p.grad, q.grad) < 1e-5, f"{name}: {_max_rel(p.grad, q.grad)}"
    state = model.__dict__["_ortrain_state"]
    assert state.engine_calls == state.calls == 1


def test_mlp_trains_like_eager_on_the_gpu():
    ref = _mlp()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ortrain.accelerate(model, opt, device="cuda", strict=True, fuse_loss=False)
    g = torch.Generator(device="cuda").manual_seed(2)
    batches = [(torch.randn(32, 16, device="cuda", generator=g), torch.randint(0, 10, (32,), device="cuda", generator=g))
               for _ in range(4)]
    losses, ref_losses = [], []
    for step in range(20):
        x, y = batches[step % 4]
        for m, o, acc in ((model, opt, losses), (ref, opt_ref, ref_losses)):
            o.zero_grad()
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            acc.append(loss.item())
    assert losses[-1] < losses[0] * 0.8, losses
    diffs = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
    assert max(diffs) < 1e-4, (losses, ref_losses)
    print("ortrain", [f"{v:.5f}" for v in losses[::5]], "eager", [f"{v:.5f}" for v in ref_losses[::5]],
          f"max relative difference {max(diffs):.2e}")
