"""Helpers for parity tests: compare an accelerated model's losses and gradients with PyTorch's."""
from __future__ import annotations

import torch


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a-b| / max(max|b|, tiny): a relative difference per tensor."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def worst_grad(model_a, model_b) -> tuple[str, float]:
    """(name, relative difference) of the parameter gradient that differs most; names missing a
    gradient on one side only count as infinitely different."""
    worst = ("", 0.0)
    for (name, pa), (_, pb) in zip(model_a.named_parameters(), model_b.named_parameters()):
        if pa.grad is None and pb.grad is None:
            continue
        if pa.grad is None or pb.grad is None:
            return (name, float("inf"))
        d = rel_diff(pa.grad, pb.grad)
        if d > worst[1]:
            worst = (name, d)
    return worst


def grads_match_at_sizes(acc, ref, sizes, vocab: int, tol: float = 1e-4) -> None:
    """For each (seq, batch): random token ids, sum of the output, backward in both models; the
    gradients agree within `tol` (relative, per tensor)."""
    for seq, batch in sizes:
        x = torch.randint(0, vocab, (seq, batch))
        for m in (acc, ref):
            m.zero_grad()
            m(x).sum().backward()
        name, d = worst_grad(acc, ref)
        assert d <= tol, f"seq {seq} batch {batch}: {name} {d:.2e}"
