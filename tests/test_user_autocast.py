"""A training loop that keeps its own `torch.autocast` around an accelerated model: with the
session's precision of the same 16-bit type (accelerate(..., precision="bf16") and
`torch.autocast("cpu", dtype=torch.bfloat16)`) the engine runs the graph it runs without the
autocast (the session's bf16 matmuls are what the autocast asks for), so the two loops train
alike; with fp32 the autocast's casts are exported into the graph, with one warning saying how
to get the faster graph, and calls with and without the autocast get graphs of their own."""
import copy
import re

import pytest
import torch

import models
import ortrain

NTOK = 500


def _batches(n: int = 4):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, NTOK, (35, 8), generator=g), torch.randint(0, NTOK, (280,), generator=g)) for _ in range(n)]


def _train(model, opt, batches, autocast: bool):
    crit = torch.nn.CrossEntropyLoss()
    losses = []
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = crit(model(x).view(-1, NTOK), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _accelerated(base, precision):
    model = copy.deepcopy(base)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ortrain.accelerate(model, opt, strict=True, precision=precision)
    return model, opt


def test_an_autocast_of_the_session_precision_runs_the_graph_without_it():
    base, _, _ = models.tutorial_transformer(NTOK, dropout=0.0)
    plain, plain_opt = _accelerated(base, "bf16")
    wrapped, wrapped_opt = _accelerated(base, "bf16")
    batches = _batches()
    want = _train(plain, plain_opt, batches, autocast=False)
    got = _train(wrapped, wrapped_opt, batches, autocast=True)
    assert got == want, (got, want)
    state = wrapped.__dict__["_ortrain_state"]
    assert len(state.runners) == 1 and state.fused_loss_calls == len(batches)
    nodes = lambda m: re.search(r"(\d+) forward \+ (\d+) gradient nodes", ortrain.explain(m)).groups()  # noqa: E731
    assert nodes(wrapped) == nodes(plain)
    assert "under autocast" not in ortrain.explain(wrapped)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = wrapped(batches[0][0])
    assert out.dtype == torch.float32


def test_an_autocast_over_an_fp32_session_is_exported_with_a_warning_once():
    base, _, _ = models.tutorial_transformer(NTOK, dropout=0.0)
    model, opt = _accelerated(base, "fp32")
    batches = _batches(3)
    with pytest.warns(UserWarning, match=r"runs under torch.autocast\(cpu, bfloat16\).*precision='bf16'") as caught:
        losses = _train(model, opt, batches, autocast=True)
    assert sum("torch.autocast" in str(w.message) for w in caught) == 1
    assert all(l == l and l < 10 for l in losses)
    _train(model, opt, batches[:1], autocast=False)
    state = model.__dict__["_ortrain_state"]
    assert len(state.runners) == 2, "calls with and without the autocast have graphs of their own"
    assert "[train, under autocast bfloat16]" in ortrain.explain(model)
    assert state.engine_calls == state.calls == 4
