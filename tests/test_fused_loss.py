"""The user's own cross-entropy fused into the engine graph (accelerate(..., fuse_loss=True), the
default): the tutorial loop `criterion(output.view(-1, ntokens), targets)` computes the loss and
its gradient inside the engine, and every other use of the output still behaves as in PyTorch
(reading it after the optimizer step, a second differentiable term, unsupported loss options,
printing it)."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

import ortrain  # noqa: E402
from ortrain.engine.lazy import LazyOutput  # noqa: E402

V = 300


def _pair(fuse_loss=True):
    # GELU, not the tutorial's ReLU: these tests compare gradients element by element with
    # PyTorch's, and a ReLU input within rounding of zero (2.98e-8 against a largest 2.37, at step
    # 2 of the loop test on an AVX-512 CPU) takes a different side in PyTorch's and the engine's
    # summation orders, which changes a whole row of the next weight's gradient
    torch.manual_seed(0)
    model, (x,), _ = models.tutorial_transformer(V, dropout=0.0, activation="gelu")
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-3)
    ortrain.accelerate(model, opt, strict=True, fuse_loss=fuse_loss)
    y = torch.randint(0, V, (x.numel(),), generator=torch.Generator().manual_seed(3))
    return model, opt, ref, opt_ref, x, y


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _close_grads(a, b, rtol=1e-4):
    assert a.keys() == b.keys()
    for n in a:
        scale = max(b[n].abs().max().item(), 1e-6)
        assert (a[n] - b[n]).abs().max().item() <= rtol * scale, n


def test_tutorial_loop_fuses_the_loss_and_matches_pytorch():
    model, opt, ref, opt_ref, x, y = _pair()
    crit = torch.nn.CrossEntropyLoss()
    for step in range(5):
        # each step from the same weights: Adam turns rounding-level differences in near-zero
        # gradients into weight differences of 2e-5..4e-5 after one step (measured, with any
        # summation order), which then compound chaotically from step to step; per-step parity
        # is what this test asserts
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters()):
                q.copy_(p)
        results = []
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            out = m(x)
            loss = crit(out.view(-1, V), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            grads = _grads(m)
            o.step()
            # read after the step, as accuracy code does: the values of this step's forward
            acc = (out.argmax(-1).reshape(-1) == y).float().mean().item()
            results.append((loss.item(), grads, acc, out.detach().clone()))
        (l, g, a, o1), (lr, gr, ar, o2) = results
        assert abs(l - lr) <= 1e-5 * abs(lr)
        _close_grads(g, gr)
        assert a == ar
        torch.testing.assert_close(o1, o2, rtol=1e-4, atol=1e-5)
    state = model._ortrain_state
    assert state.fused_loss_calls == 5
    assert "loss fused into the engine graph" in ortrain.explain(model)


def test_output_is_lazy_only_in_training_with_grad():
    model, _, _, _, x, _ = _pair()
    assert isinstance(model(x), LazyOutput)
    with torch.no_grad():
        assert type(model(x)) is torch.Tensor
    model.eval()
    assert type(model(x)) is torch.Tensor
    model2, _, _, _, _, _ = _pair(fuse_loss=False)
    assert type(model2(x)) is torch.Tensor


def test_second_differentiable_use_of_the_output_gets_its_gradient():
    model, opt, ref, opt_ref, x, y = _pair()
    grads = []
    for m in (model, ref):
        out = m(x)
        loss = F.cross_entropy(out.view(-1, V), y) + 1e-2 * out.pow(2).mean()
        loss.backward()
        grads.append(_grads(m))
    assert model._ortrain_state.fused_loss_calls == 1
    _close_grads(grads[0], grads[1])


def test_unsupported_loss_options_run_in_pytorch_with_the_same_result():
    model, opt, ref, opt_ref, x, y = _pair()
    w = torch.rand(V)
    for kwargs in (dict(label_smoothing=0.1), dict(weight=w), dict(reduction="none")):
        model.zero_grad(), ref.zero_grad()
        losses = []
        for m in (model, ref):
            out = m(x)
            loss = F.cross_entropy(out.view(-1, V), y, **kwargs)
            loss.sum().backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
        _close_grads(_grads(model), _grads(ref))
    assert model._ortrain_state.fused_loss_calls == 0


def test_ignore_index_and_sum_reduction_are_fused():
    model, opt, ref, opt_ref, x, y = _pair()
    y = y.clone()
    y[::7] = -100
    losses = []
    for m in (model, ref):
        out = m(x)
        loss = F.cross_entropy(out.reshape(-1, V), y, reduction="sum", ignore_index=-100)
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1])
    _close_grads(_grads(model), _grads(ref))
    assert model._ortrain_state.fused_loss_calls == 1
    # the LM head and the loss run as one chunked op (GPT-2: after the shift's slice moved onto
    # the head's input)
    (runner,) = model._ortrain_state.loss_runners.values()
    assert dict(runner.session.passes)["fuse_linear_cross_entropy"] == 1


def test_using_the_output_first_works_like_a_tensor():
    model, opt, ref, opt_ref, x, y = _pair()
    out, out_ref = model(x), ref(x)
    assert out.shape == out_ref.shape and out.dtype == torch.float32 and out.requires_grad
    assert "tensor(" in repr(out)
    torch.testing.assert_close(out.sum(), out_ref.sum(), rtol=1e-4, atol=1e-3)
    loss = F.cross_entropy(out.view(-1, V), y)  # already materialised: PyTorch computes it
    loss.backward()
    loss_ref = F.cross_entropy(out_ref.view(-1, V), y)
    loss_ref.backward()
    assert abs(loss.item() - loss_ref.item()) <= 1e-5 * loss_ref.item()
    _close_grads(_grads(model), _grads(ref))


def test_backward_through_the_output_after_the_step_is_refused():
    model, opt, _, _, x, y = _pair()
    out = model(x)
    F.cross_entropy(out.view(-1, V), y).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="parameters changed"):
        out.sum().backward()


@pytest.mark.parametrize("case", ["gpt2", "bert"])
def test_hugging_face_lm_losses_are_fused(case):
    """GPT-2's shifted loss slices the logits (`logits[:, :-1, :]`), BERT's MLM loss reshapes
    them with -100 labels; both return a ModelOutput around the lazy logits."""
    build = models.gpt2_small if case == "gpt2" else models.bert_small
    torch.manual_seed(0)
    model, inputs, loss_fn = build(vocab=200, dropout=0.0)
    ref = copy.deepcopy(model)
    ortrain.accelerate(model, strict=True)
    losses = []
    for m in (model, ref):
        loss = loss_fn(m(*inputs), *inputs)
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1])
    _close_grads(_grads(model), _grads(ref))
    assert model._ortrain_state.fused_loss_calls == 1
    # the LM head and the loss run as one chunked op (GPT-2: after the shift's slice moved onto
    # the head's input)
    (runner,) = model._ortrain_state.loss_runners.values()
    assert dict(runner.session.passes)["fuse_linear_cross_entropy"] == 1


def test_logits_are_computed_only_when_read():
    """The fused graph outputs only the loss (its LM head and loss run chunked): the
    logits are replayed when read, and kept readable across optimizer.step() by a parameter copy
    taken only for outputs still referenced."""
    model, opt, ref, opt_ref, x, y = _pair()
    out = model(x)
    loss = F.cross_entropy(out.view(-1, V), y)
    loss.backward()
    (runner,) = model._ortrain_state.loss_runners.values()
    assert runner.session.output_names == ["ortrain_ce_loss"]
    assert dict(runner.session.passes)["fuse_linear_cross_entropy"] == 1
    call = out._call
    assert call.fused and call.fused_logits is None and call.snapshot is None
    opt.step()
    assert call.snapshot is not None  # the output is referenced: the parameters were copied
    expected = ref(x)
    torch.testing.assert_close(out.detach(), expected.detach(), rtol=1e-4, atol=1e-5)  # before ref's step
    assert call.fused_logits is not None and call.snapshot is None


def test_engine_adam_writes_the_kept_parameters_in_its_pass():
    """The parameter copy for unread logits is written by the engine's Adam in its own pass, from
    the values before the update: exactly the parameters of the forward pass, also for a
    parameter the step does not update (no gradient), and the replayed logits are those."""
    model, opt, _, _, x, y = _pair()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = model(x)
    F.cross_entropy(out.view(-1, V), y).backward()
    frozen = next(p for n, p in model.named_parameters() if n.endswith("bias"))
    frozen.grad = None  # not updated by this step: its copy is made outside the engine pass
    runner = out._call.runner
    copies = []
    real = runner.snapshot_params
    runner.snapshot_params = lambda copy=True: copies.append(copy) or real(copy=copy)
    opt.step()
    assert copies == [False]  # deferred to the engine pass
    snap = dict(zip([n for n, p in model.named_parameters() if p.requires_grad], out._call.snapshot))
    for n, p in model.named_parameters():
        assert torch.equal(snap[n], before[n]), n
    assert not torch.equal(next(model.parameters()), before[next(iter(before))])
    changed = out.detach().clone()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(before[n])
    model.eval()
    torch.testing.assert_close(changed, model(x).detach(), rtol=1e-5, atol=1e-6)


def test_a_deferred_copy_no_step_took_is_dropped():
    """The optimizer pre-hook ran but its step never did (another hook failed): at the next hook
    the deferred copy is dropped and reading those logits after the parameters changed refuses."""
    from ortrain.engine import lazy

    model, opt, _, _, x, y = _pair()
    out = model(x)
    F.cross_entropy(out.view(-1, V), y).backward()
    lazy._before_optimizer_step(opt, (), {})  # as torch would, then no step
    assert out._call.snapshot is not None
    lazy._before_optimizer_step(opt, (), {})  # the next step's hook
    assert out._call.snapshot is None
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(RuntimeError, match="outside an optimizer step"):
        out.sum()


def test_reading_logits_after_a_manual_parameter_change_is_refused():
    model, opt, _, _, x, y = _pair()
    out = model(x)
    F.cross_entropy(out.view(-1, V), y).backward()
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(RuntimeError, match="outside an optimizer step"):
        out.sum()


def test_gradient_memory_is_reused_once_nothing_holds_it():
    """On the CPU a step's gradients land in the previous step's gradient memory once the
    user's zero_grad() dropped it (no fresh mapping and page faults every step); gradients the
    user still holds are never written over, and the numbers stay PyTorch's."""
    import weakref

    model, _, ref, _, x, y = _pair()

    def step(m):
        m.zero_grad()
        F.cross_entropy(m(x).view(-1, V), y).backward()

    step(model), step(ref)
    held = {n: p.grad for n, p in model.named_parameters()}
    copies = {n: g.clone() for n, g in held.items()}
    (runner,) = model._ortrain_state.loss_runners.values()
    step(model), step(ref)  # the user still holds the first step's gradients
    for n, g in held.items():
        assert torch.equal(g, copies[n]), f"{n}: a held gradient was written over"
        assert model.get_parameter(n).grad.data_ptr() != g.data_ptr(), n
    _close_grads(_grads(model), _grads(ref))
    pooled = [weakref.ref(kept[1]) for kept in runner._grad_storage if kept is not None]
    assert len(pooled) == len(held)
    step(model), step(ref)  # zero_grad() dropped the second step's gradients: their memory serves
    live = [w() for w in pooled]
    assert all(s is not None for s in live)
    assert {p.grad.untyped_storage()._cdata for p in model.parameters()} == {s._cdata for s in live}
    _close_grads(_grads(model), _grads(ref))
