"""Models that draw random numbers in their forward pass train in the engine: timm's DropPath /
torchvision's stochastic depth (`x.new_empty(...).bernoulli_(keep)`: a RandomUniformLike and a
compare in ONNX), `torch.rand_like`, `torch.randn_like` and `torch.bernoulli`. The engine draws
its own numbers (as its Dropout does), so the checks are the laws' statistics, fresh draws
every step, reproducibility under torch.manual_seed, and gradients equal to eager PyTorch's for
the draw the engine made. The CUDA variants need a GPU (marked gpu)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ortrain
from conftest import require_cuda

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _device(device: str) -> torch.device:
    if device == "cuda":
        require_cuda()
    return torch.device(device)


class DropPath(nn.Module):
    """timm's DropPath: each sample's branch kept with probability `keep`, scaled by 1 / keep."""

    def __init__(self, keep: float):
        super().__init__()
        self.keep = keep

    def forward(self, x):
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(self.keep)
        return x * mask / self.keep


class Draws(nn.Module):
    """Returns uniform, normal and Bernoulli draws shaped like its hidden layer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 64)

    def forward(self, x):
        h = self.lin(x)
        return torch.stack([torch.rand_like(h), torch.randn_like(h), torch.bernoulli(torch.full_like(h, 0.25))])


@pytest.mark.parametrize("device", DEVICES)
def test_drop_path_trains_and_its_gradients_are_eagers_for_the_drawn_mask(device):
    dev = _device(device)
    torch.manual_seed(0)
    keep = 0.7
    ref = nn.Sequential(nn.Linear(16, 32), DropPath(keep), nn.Linear(32, 4)).to(dev)
    model = copy.deepcopy(ref)
    ortrain.accelerate(model, device=device, strict=True, fuse_loss=False)
    kept_rows, rows = 0, 0
    for step in range(4):
        x = torch.randn(256, 16, device=dev)
        y = model(x)
        loss = (y * y).sum()
        loss.backward()
        # a dropped sample's output is the last layer's bias exactly; a kept one's is not
        kept = ~(y.detach() == ref[2].bias.detach()).all(dim=1)
        kept_rows, rows = kept_rows + int(kept.sum()), rows + len(kept)
        h = ref[0](x) * kept[:, None].to(x.dtype) / keep
        y_ref = ref[2](h)
        (y_ref * y_ref).sum().backward()
        torch.testing.assert_close(y.detach(), y_ref.detach(), rtol=1e-5, atol=1e-5)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step}, {name}: {m}")
            p.grad, q.grad = None, None
    assert abs(kept_rows / rows - keep) < 0.06, f"kept {kept_rows} of {rows} samples, not about {keep}"


@pytest.mark.parametrize("device", DEVICES)
def test_rand_like_randn_like_and_bernoulli_follow_their_laws_and_draw_afresh(device):
    dev = _device(device)
    torch.manual_seed(0)
    model = Draws().to(dev)
    ortrain.accelerate(model, device=device, strict=True)
    x = torch.randn(512, 16, device=dev)
    first = model(x).detach()
    u, z, b = first[0].flatten().double(), first[1].flatten().double(), first[2].flatten().double()
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.005
    assert abs(z.mean()) < 0.02 and abs(z.std() - 1.0) < 0.02
    assert set(b.unique().tolist()) <= {0.0, 1.0} and abs(b.mean() - 0.25) < 0.01
    second = model(x).detach()
    assert not torch.equal(first, second), "two steps drew the same numbers"
    # the engine's draws come from torch's generator: the same seed, the same numbers
    torch.manual_seed(5)
    a = model(x).detach()
    torch.manual_seed(5)
    assert torch.equal(model(x).detach(), a), "the same torch seed drew different numbers"
