"""CUDA graphs of the engine's GPU steps (engine/cuda_graphs.py, `accelerate(cuda_graphs=...)`).

On a GPU (marked `gpu`): training with graphs gives the losses and weights of training without
them, bit for bit (dropout included: the masks come from the same seeds), also when the sequence
length changes, with gradient accumulation and with two forward passes before one backward; the
steps really replay graphs. Everywhere: the cache's policy (when a step may use a graph, the
memory budget, failures), and the reuse rules of its gradient and seed memory, on CPU tensors."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import ortrain
from conftest import require_cuda
from ortrain.engine.cuda_graphs import GraphCache


def _cache(budget: int = 1 << 20) -> GraphCache:
    return GraphCache(torch.device("cpu"), budget=budget)


def test_a_step_shape_runs_without_a_graph_until_it_has_run_once():
    cache = _cache()
    key = ("sizes", True)
    assert cache.entry(key, 1000) is None  # never run: the first step warms the runtime
    cache.ran_without_graph(key, "forward")
    e = cache.entry(key, 1000)
    assert e is not None and e.arena.numel() == 1000
    assert cache.entry(key, 1000) is e
    assert not cache.backward_ready(key)
    cache.ran_without_graph(key, "backward")
    assert cache.backward_ready(key)
    e.busy = True  # a forward pass holds the arena: a second one runs without the graph
    assert cache.entry(key, 1000) is None
    e.busy = False
    assert cache.entry(key, 1000) is e


def test_entries_stay_within_the_budget_least_recently_used_first_out():
    cache = _cache(budget=3000)
    keys = ["a", "b", "c"]
    for k in keys:
        cache.ran_without_graph(k, "forward")
    a, b = cache.entry("a", 1000), cache.entry("b", 1000)
    assert cache.entry("a", 1000) is a  # "a" is now the most recently used
    c = cache.entry("c", 1500)  # over the budget with both: "b" goes
    assert c is not None and list(cache.entries) == ["a", "c"]
    a.busy = c.busy = True  # nothing idle to evict: no entry, the step runs without a graph
    cache.ran_without_graph("d", "forward")
    assert cache.entry("d", 1000) is None
    cache.ran_without_graph("big", "forward")
    assert cache.entry("big", 4000) is None  # over the budget alone: never graphed, and said so
    assert "over the graph budget" in cache.describe()


def test_a_failed_recording_warns_once_and_that_shape_runs_without_graphs():
    cache = _cache()
    for k in ("x", "y"):
        cache.ran_without_graph(k, "forward")
        cache.entry(k, 10)
    with pytest.warns(UserWarning, match="runs without a CUDA graph.*could not be recorded"):
        cache.fail("x", RuntimeError("CUDA graph: the step could not be recorded (boom)"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.fail("y", RuntimeError("other"))  # the second failure is not warned again
    assert cache.entry("x", 10) is None and cache.entry("y", 10) is None and not cache.entries
    assert "could not be recorded" in cache.describe()


def test_gradient_memory_is_reused_only_when_nothing_else_holds_it():
    cache = _cache()
    weights = [torch.zeros(3, 4), torch.zeros(5), torch.zeros(2)]
    grads = cache.static_grads(weights, [True, True, False])
    if grads is None:
        pytest.skip("this torch has no torch._C._storage_Use_Count: gradients always get fresh memory")
    assert grads[2] is None and grads[0].shape == (3, 4) and grads[1].shape == (5,)
    ptrs = [g.data_ptr() for g in grads[:2]]
    kept = grads[0]  # a `.grad` kept from the last step (accumulation): the memory is not free
    del grads
    assert cache.static_grads(weights, [True, True, False]) is None
    assert "1 backward pass(es) without their graph: the gradients' memory was still referenced" in cache.describe()
    del kept
    again = cache.static_grads(weights, [True, True, False])
    assert [g.data_ptr() for g in again[:2]] == ptrs
    assert cache.held() == (12 + 5) * 4  # counted in the budget once, shared by the entries


def test_gradient_seeds_are_copied_into_the_entrys_memory():
    cache = _cache()
    cache.ran_without_graph("k", "forward")
    e = cache.entry("k", 64)
    s1 = e.static_seeds([torch.tensor(1.5), None])
    assert s1[1] is None and float(s1[0]) == 1.5
    s2 = e.static_seeds([torch.tensor(2.5), None])
    assert s2[0].data_ptr() == s1[0].data_ptr() and float(s2[0]) == 2.5
    assert e.static_seeds([torch.tensor([1.0, 2.0]), None]) is None  # another shape: not the graph's
    assert e.static_seeds([None, torch.tensor(1.0)]) is None


def test_cuda_graphs_option_is_checked():
    with pytest.raises(ValueError, match="cuda_graphs='yes' is not one of True, False, None"):
        ortrain.accelerate(nn.Linear(2, 2), cuda_graphs="yes")


# --- on a GPU -------------------------------------------------------------------------------


def _mlp(classes: int):
    """Two dropouts and the loss fused into the engine."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 128), nn.Tanh(),
                         nn.Dropout(0.2), nn.Linear(128, classes)).cuda()


def _train(model, graphs: bool, batches: list, accumulate: int = 1, two_forwards: bool = False,
           loss_of=nn.functional.cross_entropy, clip: float | None = None):
    """Losses, final weights and the trained copy of `model` on `batches` (x, labels), with the
    dropout seeds fixed per step."""
    model = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    ortrain.accelerate(model, opt, device="cuda", strict=True, cuda_graphs=graphs)
    losses = []
    for step, (x, y) in enumerate(batches):
        torch.manual_seed(100 + step)
        if step % accumulate == 0:
            opt.zero_grad()
        if two_forwards:
            h = x.shape[0] // 2
            loss = (loss_of(model(x[:h]), y[:h]) + loss_of(model(x[h:]), y[h:])) / 2
        else:
            loss = loss_of(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if (step + 1) % accumulate == 0:
            opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()], model


def _batches(classes: int, n: int, sizes=(64,)) -> list:
    g = torch.Generator(device="cuda").manual_seed(7)
    return [(torch.randn(sizes[i % len(sizes)], 32, device="cuda", generator=g),
             torch.randint(0, classes, (sizes[i % len(sizes)],), device="cuda", generator=g)) for i in range(n)]


def _replays(model) -> tuple:
    state = model.__dict__["_ortrain_state"]
    assert state.engine_calls == state.calls
    caches = [r.graphs for r in (*state.runners.values(), *state.loss_runners.values()) if getattr(r, "graphs", None)]
    return sum(c.replays for c in caches), sum(len(c.entries) for c in caches), [c.describe() for c in caches]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["steady", "two_shapes", "accumulation", "two_forwards"])
def test_training_with_cuda_graphs_is_training_without_them(case):
    """An MLP with two dropouts and its loss fused: the same losses and weights bit for bit
    (the same kernels in the same order, the masks from the same seeds) while the steps replay
    graphs: a steady shape; two batch sizes alternating (each recorded for itself); gradients
    accumulated over two steps (every other backward pass runs without its graph: the gradient
    memory is held by `.grad`); two forward passes before one backward (the second runs
    without the graph: the arena is held)."""
    require_cuda()
    classes = 50
    base = _mlp(classes)
    kw = {"steady": {}, "two_shapes": {}, "accumulation": {"accumulate": 2}, "two_forwards": {"two_forwards": True}}[case]
    batches = _batches(classes, 10, sizes=(64, 48) if case == "two_shapes" else (64,))
    (la, wa, model), (lb, wb, _) = _train(base, True, batches, **kw), _train(base, False, batches, **kw)
    replays, entries, described = _replays(model)
    print(case, la[:3], f"{replays} phases replayed;", described)
    assert la == lb, f"losses with graphs {la} differ from without {lb}"
    for i, (p, q) in enumerate(zip(wa, wb)):
        assert torch.equal(p, q), f"parameter {i} differs after training (max {float((p - q).abs().max()):.3g})"
    assert replays >= 8, described
    assert entries >= (2 if case == "two_shapes" else 1), described
    text = ortrain.explain(model)
    assert "CUDA graphs on:" in text and "recorded" in text, text


@pytest.mark.gpu
def test_the_tutorial_trains_the_same_with_cuda_graphs():
    """The tutorial model (dropout 0.2, the LM head's loss fused, an embedding): every loss bit
    for bit with and without graphs (the embedding's gradient sums in position order, not with
    float atomics), every step from the second on replayed."""
    require_cuda()
    import models

    vocab = 500
    torch.manual_seed(0)
    base = models.tutorial_transformer(vocab, dropout=0.2, seed=0)[0].cuda()
    g = torch.Generator(device="cuda").manual_seed(7)
    batches = [(torch.randint(0, vocab, (35, 20), device="cuda", generator=g),
                torch.randint(0, vocab, (700,), device="cuda", generator=g)) for _ in range(8)]

    def loss_of(out, tgt):
        return nn.functional.cross_entropy(out.view(-1, vocab), tgt)

    (a, _, model), (b, _, _) = (_train(base, graphs, batches, loss_of=loss_of, clip=0.5) for graphs in (True, False))
    replays, _, described = _replays(model)
    print("tutorial", a, b, described)
    assert a == b, (a, b)
    assert replays >= 2 * (len(batches) - 1) - 1, described


@pytest.mark.gpu
def test_cuda_graphs_off_launches_every_kernel():
    require_cuda()
    _, _, model = _train(_mlp(10), False, _batches(10, 3))
    assert "CUDA graphs off (accelerate(..., cuda_graphs=False))" in ortrain.explain(model)
