"""Fused vs unfused: every graph pass (engine/src/passes/) is checked by training the same model
with the pass on and with all passes off (ORTRAIN_DISABLE_PASSES=all), from the same start on
the same batches: the loss and every parameter gradient of the first step, and the loss after a
few Adam steps, agree to fp32 rounding. Each case also asserts that the pass really rewrote
something in that model, so a pattern that silently stops matching fails here."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

import ortrain  # noqa: E402

STEPS = 5


def _tutorial():
    model, inputs, _ = models.tutorial_transformer(500, dropout=0.0)
    ntok = 500

    def loss_fn(out, x):
        return torch.nn.functional.cross_entropy(out.view(-1, ntok), x.reshape(-1))
    return model, inputs, loss_fn


def _tutorial_dropout():
    """The tutorial with its dropout of 0.2: the masks come from the engine's random stream,
    the same with the pass on and off."""
    model, inputs, _ = models.tutorial_transformer(500, dropout=0.2)

    def loss_fn(out, x):
        return torch.nn.functional.cross_entropy(out.view(-1, 500), x.reshape(-1))
    return model, inputs, loss_fn


# model builder; the pass; how many rewrites it must at least make in that model
def _llama_padded():
    """llama_small called with an attention_mask as a tokenizer pads a batch: row 0 padded on
    the left by 5 (its first queries see no key), row 1 on the right by 3."""
    model, (ids,), loss_fn = models.llama_small()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[1, -3:] = 0
    return model, (ids, mask), lambda out, ids, mask: loss_fn(out, ids)


def _checkpointed(built):
    model, inputs, loss_fn = built
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, inputs, loss_fn


CASES = {
    "tutorial-fuse_linear": (_tutorial, "fuse_linear", 5),
    "gpt2-fuse_linear": (lambda: models.gpt2_small(vocab=200, dropout=0.0), "fuse_linear", 1),
    "bert-fuse_linear": (lambda: models.bert_small(vocab=200, dropout=0.0), "fuse_linear", 5),
    "tutorial-fuse_linear_cross_entropy": (_tutorial, "fuse_linear_cross_entropy", 1),
    # GPT-2's shifted loss (`logits[:, :-1]`): the slice moves onto the LM head's input, then
    # the head and the loss fuse
    "gpt2-slice_before_linear": (lambda: models.gpt2_small(vocab=200, dropout=0.0), "slice_before_linear", 1),
    "gpt2-fuse_linear_cross_entropy": (lambda: models.gpt2_small(vocab=200, dropout=0.0), "fuse_linear_cross_entropy", 1),
    "bert-fuse_linear_cross_entropy": (lambda: models.bert_small(vocab=200, dropout=0.0), "fuse_linear_cross_entropy", 1),
    # the exporters repeat constants and per-layer work (GPT-2's causal mask): computed once
    "gpt2-cse": (lambda: models.gpt2_small(vocab=200, dropout=0.0), "cse", 10),
    "tutorial-cse": (_tutorial, "cse", 3),
    # GPT-2's NewGELUActivation, written out as Pow/Mul/Add/Tanh, becomes Gelu(approximate="tanh")
    "gpt2-fuse_gelu_tanh": (lambda: models.gpt2_small(vocab=200, dropout=0.0), "fuse_gelu_tanh", 2),
    # a residual branch's dropout and its add: the encoder layers' dropout1/dropout2, GPT-2's
    # resid_dropout and MLP dropout, BERT's hidden dropouts before each LayerNorm
    "tutorial-fuse_dropout_add": (_tutorial_dropout, "fuse_dropout_add", 4),
    "gpt2-fuse_dropout_add": (lambda: models.gpt2_small(vocab=200, dropout=0.1), "fuse_dropout_add", 2),
    "bert-fuse_dropout_add": (lambda: models.bert_small(vocab=200, dropout=0.1), "fuse_dropout_add", 2),
    # nn.MultiheadAttention's `q, k, v = proj[0], proj[1], proj[2]`: one Split a layer
    "tutorial-selects_to_split": (_tutorial_dropout, "selects_to_split", 2),
    # an unfused attention's q·kᵀ with its scalings (torchlib's decomposition, the scale computed
    # from q's declared head size, kᵀ as a merge-transpose-split of k; HF's k.transpose(-1, -2)):
    # one FusedMatMul reading q and k (with fuse_attention off, as CUDA sessions have it by default)
    "tutorial-fold_matmul_transpose": (_tutorial_dropout, "fold_matmul_transpose", 2, "fuse_attention"),
    "gpt2-fold_matmul_transpose": (lambda: models.gpt2_small(vocab=200, dropout=0.1), "fold_matmul_transpose", 2,
                                   "fuse_attention"),
    "bert-fold_matmul_transpose": (lambda: models.bert_small(vocab=200, dropout=0.1), "fold_matmul_transpose", 2,
                                   "fuse_attention"),
    # an attention without dropout: one Attention node (the CPU's blocked f32 kernels), reading
    # Q, K, V in the projections' layout; BERT's attention_mask as one flag per key
    "tutorial-fuse_attention": (_tutorial, "fuse_attention", 2),
    "gpt2-fuse_attention": (lambda: models.gpt2_small(vocab=200, dropout=0.0), "fuse_attention", 2),
    "gpt2-attention_layout": (lambda: models.gpt2_small(vocab=200, dropout=0.0), "attention_layout", 2),
    "bert-attention_key_padding": (lambda: models.bert_small(vocab=200, dropout=0.0), "attention_key_padding", 2),
    # an attention with dropout on its probabilities (nn.MultiheadAttention's, HF's attn_pdrop and
    # attention_probs_dropout_prob): the Dropout becomes the fused node's, its mask regenerated
    # from the stream key the Dropout would have drawn (the same masks as the unfused graph's)
    "tutorial-fuse_attention-dropout": (_tutorial_dropout, "fuse_attention", 2),
    "gpt2-fuse_attention-dropout": (lambda: models.gpt2_small(vocab=200, dropout=0.1), "fuse_attention", 2),
    "gpt2-sdpa-fuse_attention-dropout": (lambda: models.gpt2_small(vocab=200, dropout=0.1, attn_implementation="sdpa"),
                                         "fuse_attention", 2),
    # Hugging Face's gradient checkpointing: the attention recomputed in the backward pass keeps
    # the key drawn in the forward, so it drops what the forward dropped
    "gpt2-checkpointed-fuse_attention-dropout": (lambda: _checkpointed(models.gpt2_small(vocab=200, dropout=0.1)),
                                                 "fuse_attention", 2),
    "bert-fuse_attention-dropout": (lambda: models.bert_small(vocab=200, dropout=0.1), "fuse_attention", 2),
    # Llama's RMSNorm, written out as Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul and its weight's Mul:
    # one RmsNorm a norm (2 a layer, and the final one)
    "llama-fuse_rms_norm": (lambda: models.llama_small(), "fuse_rms_norm", 5),
    "llama-fuse_attention": (lambda: models.llama_small(), "fuse_attention", 2),
    # Llama's Kᵀ (rotary K, repeated for its grouped-query heads) read as K; K and V read before
    # their repeat, Q and O viewed in groups, the mask and the key padding given the groups' axis
    "llama-attention_keys": (lambda: models.llama_small(), "attention_keys", 2),
    "llama-attention_grouped_kv": (lambda: models.llama_small(), "attention_grouped_kv", 2),
    "llama-padded-attention_grouped_kv": (_llama_padded, "attention_grouped_kv", 2),
}


def _train(model, inputs, loss_fn, disable: str | None, monkeypatch, precision: str = "fp32"):
    if disable is None:
        monkeypatch.delenv("ORTRAIN_DISABLE_PASSES", raising=False)
    else:
        monkeypatch.setenv("ORTRAIN_DISABLE_PASSES", disable)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ortrain.accelerate(model, opt, strict=True, precision=precision)
    # the steps' dropout seeds come from torch's generator: both runs draw the same ones
    torch.manual_seed(1234)
    losses, grads = [], None
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model(*inputs), *inputs)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    state = model._ortrain_state
    rewrites: dict = {}
    for runner in list(state.runners.values()) + list(state.loss_runners.values()):
        for name, n in dict(runner.session.passes).items():
            rewrites[name] = rewrites.get(name, 0) + n
    return losses, grads, {k: v for k, v in rewrites.items() if v}


@pytest.mark.parametrize("case", list(CASES))
def test_pass_matches_unfused(case, monkeypatch):
    build, name, min_rewrites, *also_off = CASES[case]
    torch.manual_seed(0)
    model, inputs, loss_fn = build()
    fused_model, plain_model = copy.deepcopy(model), copy.deepcopy(model)
    fused, fused_grads, rewrites = _train(fused_model, inputs, loss_fn, ",".join(also_off) or None, monkeypatch)
    plain, plain_grads, plain_rewrites = _train(plain_model, inputs, loss_fn, "all", monkeypatch)
    assert rewrites.get(name, 0) >= min_rewrites, f"{name} rewrote {rewrites.get(name, 0)} sites, expected ≥ {min_rewrites}"
    assert not plain_rewrites, f"ORTRAIN_DISABLE_PASSES=all still ran {plain_rewrites}"
    print(f"\n{case}: {rewrites}; losses fused {fused[-1]:.6f} unfused {plain[-1]:.6f}")
    assert abs(fused[0] - plain[0]) <= 1e-6 * abs(plain[0])
    for n, g in plain_grads.items():
        scale = max(g.abs().max().item(), 1e-6)
        diff = (fused_grads[n] - g).abs().max().item() / scale
        assert diff <= 1e-4, f"{n}: fused gradient differs by {diff:.2e} (relative to its max)"
    for a, b in zip(fused, plain):
        assert abs(a - b) <= 1e-4 * abs(b), f"loss curves diverge: {fused} vs {plain}"


def test_a_bf16_branch_dropout_fuses_into_the_f32_stream_with_its_cast(monkeypatch):
    """GPT-2 in bf16 with autocast keeps its residual stream in f32 while each block's branch
    (attention and MLP outputs, their dropouts) is bf16, joined to the stream by a Cast:
    fuse_dropout_add takes the Cast too, and the steps are the unfused ones bit for bit (the
    dropped value rounded to bf16 before the f32 add, as the Dropout stored it)."""
    monkeypatch.setenv("ORTRAIN_ENABLE_PASSES", "autocast")
    torch.manual_seed(0)
    model, inputs, loss_fn = models.gpt2_small(vocab=200, dropout=0.1)
    fused, fused_grads, rewrites = _train(copy.deepcopy(model), inputs, loss_fn, None, monkeypatch, "bf16")
    plain, plain_grads, plain_rewrites = _train(copy.deepcopy(model), inputs, loss_fn, "fuse_dropout_add", monkeypatch, "bf16")
    layers = sum(1 for m in model.modules() if type(m).__name__ == "GPT2Block")
    assert layers and rewrites.get("fuse_dropout_add", 0) >= 2 * layers, rewrites
    assert "fuse_dropout_add" not in plain_rewrites and plain_rewrites.get("autocast"), plain_rewrites
    print(f"\nbf16 GPT-2, dropout 0.1: {rewrites}; losses {fused}")
    assert fused == plain, f"the fused bf16 steps differ: {fused} vs {plain}"
    for n, g in plain_grads.items():
        assert torch.equal(fused_grads[n], g), f"{n}: the fused bf16 gradient differs"


def test_packed_projection_selects_give_the_gather_steps_exactly(monkeypatch):
    """The tutorial's attention takes q, k, v from its packed projection by three Gathers a
    layer; selects_to_split makes them one Split, whose gradient is one Concat instead of three
    scatters into zeros and their sum: the same losses and gradients, bit for bit (a zero's sign
    aside, which torch.equal ignores)."""
    torch.manual_seed(0)
    model, inputs, loss_fn = _tutorial_dropout()
    split, split_grads, rewrites = _train(copy.deepcopy(model), inputs, loss_fn, None, monkeypatch)
    gathers, gather_grads, plain_rewrites = _train(copy.deepcopy(model), inputs, loss_fn, "selects_to_split", monkeypatch)
    assert rewrites.get("selects_to_split", 0) >= 2, rewrites
    assert "selects_to_split" not in plain_rewrites, plain_rewrites
    assert split == gathers, f"the steps differ: {split} vs {gathers}"
    for n, g in gather_grads.items():
        assert torch.equal(split_grads[n], g), f"{n}: the gradient through the Split differs"


def test_unknown_pass_name_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("ORTRAIN_DISABLE_PASSES", "fuse_everything")
    model, inputs, _ = models.tutorial_transformer(50, dropout=0.0)
    ortrain.accelerate(model, strict=True)
    with pytest.raises(ortrain.OrtrainError, match="unknown pass 'fuse_everything'.*fuse_linear"):
        model(*inputs)


def _lm_head_step(disable, monkeypatch, precision="fp32", ntok=500, dropout=0.0, loss_kwargs=None):
    """One tutorial step with the fused loss: (loss, gradients, logits read after the step,
    rewrites of the loss graph's passes)."""
    if disable is None:
        monkeypatch.delenv("ORTRAIN_DISABLE_PASSES", raising=False)
    else:
        monkeypatch.setenv("ORTRAIN_DISABLE_PASSES", disable)
    model, (x,), _ = models.tutorial_transformer(ntok, dropout=dropout)
    y = torch.randint(0, ntok, (x.numel(),), generator=torch.Generator().manual_seed(3))
    y[::9] = -100
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if precision != "eager":
        ortrain.accelerate(model, opt, strict=True, precision=precision)
    torch.manual_seed(11)  # the dropout seed
    out = model(x)
    loss = torch.nn.functional.cross_entropy(out.view(-1, ntok), y, **(loss_kwargs or {}))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    logits = out.detach().clone()  # read after the step: this step's logits
    rewrites = {}
    if precision != "eager":
        assert model._ortrain_state.fused_loss_calls == 1
        (runner,) = model._ortrain_state.loss_runners.values()
        rewrites = dict(runner.session.passes)
    return loss.item(), grads, logits, rewrites


def _max_rel(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


@pytest.mark.parametrize("loss_kwargs", [{}, {"reduction": "sum"}], ids=["mean", "sum"])
def test_linear_cross_entropy_matches_unfused_and_pytorch(loss_kwargs, monkeypatch):
    """The LM head + loss fused (chunked) against the same graph with only that pass off, and
    against PyTorch: loss, every gradient, and the logits read after optimizer.step()."""
    fused = _lm_head_step(None, monkeypatch, loss_kwargs=loss_kwargs)
    plain = _lm_head_step("fuse_linear_cross_entropy", monkeypatch, loss_kwargs=loss_kwargs)
    torch_ = _lm_head_step(None, monkeypatch, precision="eager", loss_kwargs=loss_kwargs)
    assert fused[3].get("fuse_linear_cross_entropy") == 1 and plain[3].get("fuse_linear_cross_entropy", 0) == 0
    for name, other, tol in (("unfused", plain, 1e-4), ("pytorch", torch_, 1e-4)):
        dloss = abs(fused[0] - other[0]) / abs(other[0])
        dgrad = max(_max_rel(fused[1][n], other[1][n]) for n in other[1])
        dlogits = _max_rel(fused[2], other[2])
        print(f"\nfused vs {name}: loss {dloss:.2e}, gradients max {dgrad:.2e}, logits {dlogits:.2e}")
        assert dloss <= 1e-5 and dgrad <= tol and dlogits <= 1e-5


def test_lazy_logits_replay_the_dropout_masks(monkeypatch):
    """With dropout, the logits read after the step are the fused run's (same masks): the
    loss PyTorch computes from them equals the engine's fused loss."""
    monkeypatch.delenv("ORTRAIN_DISABLE_PASSES", raising=False)
    model, (x,), _ = models.tutorial_transformer(300, dropout=0.2)
    y = torch.randint(0, 300, (x.numel(),), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ortrain.accelerate(model, opt, strict=True)
    for _ in range(2):
        opt.zero_grad()
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out.view(-1, 300), y)
        loss.backward()
        opt.step()
        again = torch.nn.functional.cross_entropy(out.detach().view(-1, 300), y)
        assert abs(again.item() - loss.item()) <= 1e-5 * loss.item()
    assert model._ortrain_state.fused_loss_calls == 2


def test_linear_cross_entropy_bf16_matches_unfused_bf16(monkeypatch):
    from ortrain import _ortrain

    if _ortrain.cpu_bf16() is None:
        pytest.skip("this CPU has neither avx512_bf16 nor AMX")
    fused = _lm_head_step(None, monkeypatch, precision="bf16")
    plain = _lm_head_step("fuse_linear_cross_entropy", monkeypatch, precision="bf16")
    assert fused[3].get("fuse_linear_cross_entropy") == 1
    dgrad = max(_max_rel(fused[1][n], plain[1][n]) for n in plain[1])
    print(f"\nbf16 fused vs unfused: loss {abs(fused[0] - plain[0]) / abs(plain[0]):.2e}, gradients max {dgrad:.2e}")
    assert abs(fused[0] - plain[0]) <= 1e-5 * abs(plain[0])
    fp32 = _lm_head_step(None, monkeypatch)
    d_fp32 = max(_max_rel(fused[1][n], fp32[1][n]) for n in fp32[1])
    print(f"bf16 fused vs fp32 fused: gradients max {d_fp32:.2e} (the bf16 products ran)")
    assert d_fp32 > 1e-5
    # the fused kernel's softmax gradient equals the unfused one up to f32 rounding (per-tile
    # shifts, as on the fp32 path), so a few of its elements round to the neighbouring bf16: the
    # fusion must move the gradients far less than the bf16 products themselves do
    assert dgrad <= 0.25 * d_fp32 and dgrad <= 5e-3, (dgrad, d_fp32)
