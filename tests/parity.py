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
