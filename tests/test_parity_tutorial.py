"""The nn.Transformer tutorial model trained in the engine matches PyTorch eager: step-1 loss and
every gradient, 50 Adam steps with clipping, dropout statistics, a shorter last batch."""
import copy

import pytest
import torch

import models
import ortrain
from parity import grads_match_at_sizes, rel_diff, worst_grad

NTOK = 1000


def _batches(n, seq=35, batch=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, NTOK, (seq, batch), generator=g), torch.randint(0, NTOK, (seq * batch,), generator=g))
            for _ in range(n)]


def _train(model, opt, batches, clip=0.5):
    crit = torch.nn.CrossEntropyLoss()
    losses = []
    for x, y in batches:
        out = model(x)
        loss = crit(out.view(-1, NTOK), y[: out.shape[0] * out.shape[1]])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


def test_first_step_loss_and_every_gradient_match():
    ref, (x,), _ = models.tutorial_transformer(NTOK, dropout=0.0)
    acc = ortrain.accelerate(copy.deepcopy(ref))
    y = torch.randint(0, NTOK, (x.numel(),), generator=torch.Generator().manual_seed(5))
    crit = torch.nn.CrossEntropyLoss()
    la = crit(acc(x).view(-1, NTOK), y)
    lr = crit(ref(x).view(-1, NTOK), y)
    la.backward()
    lr.backward()
    assert "runs in PyTorch" not in ortrain.explain(acc), ortrain.explain(acc)
    assert abs(la.item() - lr.item()) <= 1e-6 * abs(lr.item())
    name, d = worst_grad(acc, ref)
    print(f"worst gradient: {name} rel {d:.2e}")
    assert d <= 1e-4, f"{name}: relative gradient difference {d:.2e}"


def _nudged(model, seed):
    """A copy of `model` with every weight moved by one f32 ulp up or down at random: a PyTorch
    run from it differs from the plain one by rounding-level noise only."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1 + 2.0 ** -23 * (torch.randint(0, 2, p.shape, generator=g) * 2 - 1))
    return m


def test_fifty_adam_steps_follow_pytorch():
    ref, _, _ = models.tutorial_transformer(NTOK, dropout=0.0)
    acc = copy.deepcopy(ref)
    exact = copy.deepcopy(ref).double()
    noisy = [_nudged(ref, seed) for seed in (0, 1)]
    opt_r = torch.optim.Adam(ref.parameters(), lr=1e-3)
    opt_a = torch.optim.Adam(acc.parameters(), lr=1e-3)
    opt_e = torch.optim.Adam(exact.parameters(), lr=1e-3)
    ortrain.accelerate(acc, opt_a)
    batches = _batches(50)
    lr = _train(ref, opt_r, batches)
    la = _train(acc, opt_a, batches)
    _train(exact, opt_e, batches)
    for m in noisy:
        _train(m, torch.optim.Adam(m.parameters(), lr=1e-3), batches)
    worst = max(abs(a - b) / abs(b) for a, b in zip(la, lr))
    print(f"50 Adam steps: worst relative loss difference {worst:.2e}; last {la[-1]:.5f} vs {lr[-1]:.5f}")
    assert worst <= 1e-4
    assert la[-1] < la[0] - 0.2, "the model did not learn"
    # Adam turns rounding noise into full-size steps (the attention key bias has an exactly zero
    # gradient in exact arithmetic), and a ReLU unit whose input sits near 0 flips on rounding: so
    # after 50 steps PyTorch's own fp32 run is up to ~2% from the same run in fp64 on some
    # parameters, by how much depending on the machine's kernels and on luck (from weights one ulp
    # apart: 0.4% to 1.7% on layer 1's linear1.bias on an AMD EPYC, where the plain run is 0.23%
    # and the engine's 0.69%). Each parameter is held to the fp64 run: no further from it than
    # twice the furthest of three PyTorch fp32 runs that differ by rounding only, plus 0.2%.
    runs = [ref.named_parameters()] + [m.named_parameters() for m in noisy]
    for (n, pa), (_, pe), *torch_runs in zip(acc.named_parameters(), exact.named_parameters(), *runs):
        pe = pe.detach().float()
        d_acc = float((pa.detach() - pe).norm() / pe.norm())
        d_ref = max(float((p.detach() - pe).norm() / pe.norm()) for _, p in torch_runs)
        assert d_acc <= 2 * d_ref + 2e-3, f"{n}: {d_acc:.4f} from the fp64 run, PyTorch's fp32 runs up to {d_ref:.4f}"


def test_dropout_trains_like_pytorch_and_drops_at_the_rate():
    torch.manual_seed(0)
    ref, _, _ = models.tutorial_transformer(NTOK, dropout=0.2)
    acc = copy.deepcopy(ref)
    opt_r = torch.optim.Adam(ref.parameters(), lr=1e-3)
    opt_a = torch.optim.Adam(acc.parameters(), lr=1e-3)
    ortrain.accelerate(acc, opt_a)
    batches = _batches(50, seed=1)
    lr = _train(ref, opt_r, batches)
    la = _train(acc, opt_a, batches)
    mean_rel = sum(abs(a - b) / b for a, b in zip(la, lr)) / len(lr)
    print(f"dropout 0.2: mean relative loss difference over 50 steps {mean_rel:.4f}")
    assert mean_rel < 0.02
    # empirical drop rate of the first dropout: the positional-encoding output
    x = batches[0][0]
    acc.train()
    emb = acc.encoder(x) * (acc.ninp ** 0.5)
    dropped = (acc.pos_encoder(emb) == 0).float().mean().item()
    assert 0.17 < dropped < 0.23


def test_last_shorter_batch_and_eval_mode():
    ref, _, _ = models.tutorial_transformer(NTOK, dropout=0.0)
    acc = ortrain.accelerate(copy.deepcopy(ref))
    grads_match_at_sizes(acc, ref, [(35, 20), (17, 20), (35, 7)], NTOK)
    acc.eval()
    ref.eval()
    with torch.no_grad():
        x = torch.randint(0, NTOK, (12, 3))
        assert rel_diff(acc(x), ref(x)) < 1e-5
    assert "[eval]" in ortrain.explain(acc)
