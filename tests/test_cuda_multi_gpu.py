"""A model on another GPU than cuda:0 (a data-parallel rank k on a multi-GPU machine trains on
cuda:k): it trains there as on cuda:0, PyTorch's current device is left as the caller had it,
and a model spread over two GPUs is refused by name. Needs two GPUs (skipped with that reason
where there is one)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ortrain
from conftest import require_cuda

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _two_gpus():
    require_cuda()
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs, this machine has {torch.cuda.device_count()}")
    yield


def _train(model, device: torch.device, steps: int = 3) -> list:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ortrain.accelerate(model, opt, device="cuda", strict=True)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g).to(device)
        y = torch.randint(0, 10, (16,), generator=g).to(device)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_model_on_the_second_gpu_trains_there_as_on_the_first():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    on0, on1 = copy.deepcopy(base).to("cuda:0"), copy.deepcopy(base).to("cuda:1")
    torch.cuda.set_device(0)
    before = torch.cuda.memory_allocated(0)
    losses1 = _train(on1, torch.device("cuda:1"))
    assert torch.cuda.current_device() == 0, "the engine's calls left PyTorch's current device as it was"
    assert torch.cuda.memory_allocated(0) == before, "training on cuda:1 allocated nothing on cuda:0"
    losses0 = _train(on0, torch.device("cuda:0"))
    assert losses1 == pytest.approx(losses0, rel=1e-5)
    for p, q in zip(on1.parameters(), on0.parameters()):
        assert p.device == torch.device("cuda:1")
        torch.testing.assert_close(p.cpu(), q.cpu(), rtol=1e-5, atol=1e-6)
    state = on1.__dict__["_ortrain_state"]
    assert state.engine_calls == state.calls == 3


def test_a_model_on_two_gpus_is_refused_naming_them():
    model = nn.Sequential(nn.Linear(4, 4).to("cuda:0"), nn.Linear(4, 4).to("cuda:1"))
    with pytest.raises(ortrain.OrtrainError, match=r"on cuda:0, cuda:1; ortrain runs a model on one GPU"):
        ortrain.accelerate(model, device="cuda")
