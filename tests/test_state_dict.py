"""An accelerated model and its engine-run optimizer keep PyTorch's state_dict: save in ortrain,
continue in plain PyTorch (and the reverse) with the same losses."""
import copy

import torch

import models
import ortrain

NTOK = 1000


def _steps(model, opt, batches):
    crit = torch.nn.CrossEntropyLoss()
    out = []
    for x, y in batches:
        loss = crit(model(x).view(-1, NTOK), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, NTOK, (20, 8), generator=g), torch.randint(0, NTOK, (160,), generator=g)) for _ in range(n)]


def test_keys_unchanged():
    ref, _, _ = models.tutorial_transformer(NTOK, dropout=0.0)
    acc = ortrain.accelerate(copy.deepcopy(ref))
    acc(torch.randint(0, NTOK, (5, 2)))
    assert list(acc.state_dict()) == list(ref.state_dict())


def test_ortrain_to_torch_and_back():
    base, _, _ = models.tutorial_transformer(NTOK, dropout=0.0)
    first, second = _batches(3, 1), _batches(3, 2)

    # ortrain for 3 steps, then save
    acc = copy.deepcopy(base)
    opt = torch.optim.AdamW(acc.parameters(), lr=1e-3, weight_decay=0.01)
    ortrain.accelerate(acc, opt)
    _steps(acc, opt, first)
    saved_model, saved_opt = copy.deepcopy(acc.state_dict()), copy.deepcopy(opt.state_dict())
    assert {"step", "exp_avg", "exp_avg_sq"} <= set(saved_opt["state"][0])

    # continue in ortrain and, from the saved state, in plain PyTorch
    cont_acc = _steps(acc, opt, second)
    plain = copy.deepcopy(base)
    plain.load_state_dict(saved_model)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.01)
    popt.load_state_dict(saved_opt)
    cont_torch = _steps(plain, popt, second)
    assert max(abs(a - b) / b for a, b in zip(cont_acc, cont_torch)) < 1e-4

    # and torch -> ortrain: the plain model's state continues in the engine
    again = copy.deepcopy(base)
    again.load_state_dict(copy.deepcopy(plain.state_dict()))
    aopt = torch.optim.AdamW(again.parameters(), lr=1e-3, weight_decay=0.01)
    aopt.load_state_dict(copy.deepcopy(popt.state_dict()))  # torch shares state tensors otherwise
    ortrain.accelerate(again, aopt)
    third = _batches(2, 3)
    a = _steps(again, aopt, third)
    b = _steps(plain, popt, third)
    assert max(abs(x - y) / y for x, y in zip(a, b)) < 1e-4


def test_deaccelerate_restores_plain_pytorch():
    model, _, _ = models.tutorial_transformer(NTOK, dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ortrain.accelerate(model, opt)
    _steps(model, opt, _batches(1, 0))
    assert ortrain.is_accelerated(model) and type(opt).__name__ == "OrtrainSGD"
    ortrain.deaccelerate(model)
    assert not ortrain.is_accelerated(model) and type(opt) is torch.optim.SGD
    assert "momentum_buffer" in opt.state[next(model.parameters())]
    _steps(model, opt, _batches(1, 1))
