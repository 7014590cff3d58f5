"""GPT-2's and BERT's fused attention on a GPU at 16-bit precision (`accelerate(..., precision="bf16" |
"fp16")` with the opt-in attention fusion), against PyTorch's autocast on the same GPU from the
same initial weights: the loss curves, and explain()'s line on which attention kernels ran (the
flash kernels, the tensor-core ones, key padding from an attention_mask). Skipped (with the
reason) where there is no usable GPU."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ortrain
from conftest import require_cuda
from test_cuda_train import _fused_attentions

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _gpu():
    require_cuda()
    yield


def _curves_against_autocast(model, opt, ref, opt_ref, loss_of, batches, half, scaler, steps=10):
    """10 steps of `model` (accelerated) and of `ref` under PyTorch's autocast to `half` (with
    `scaler`, a GradScaler enabled at fp16) over `batches` in turn: both loss curves."""
    ours, theirs = [], []
    for step in range(steps):
        ids = batches[step % len(batches)]
        opt.zero_grad()
        loss = loss_of(model, ids)
        loss.backward()
        opt.step()
        ours.append(loss.item())
        opt_ref.zero_grad()
        with torch.autocast("cuda", dtype=half):
            ref_loss = loss_of(ref, ids)
        scaler.scale(ref_loss).backward()
        scaler.step(opt_ref)
        scaler.update()
        theirs.append(ref_loss.item())
    return ours, theirs


def _bf16_padded_curve_follows_autocast(what, model, opt, ref, opt_ref, loss_of, vocab, shape, seed):
    """10 bf16 steps on 3 random batches of `shape`: both attentions fused, the loss curve within
    2e-2 of PyTorch's autocast."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    batches = [torch.randint(0, vocab, shape, device="cuda", generator=g) for _ in range(3)]
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    ours, theirs = _curves_against_autocast(model, opt, ref, opt_ref, loss_of, batches, torch.bfloat16, scaler)
    diffs = [abs(a - b) / abs(b) for a, b in zip(ours, theirs)]
    print(f"{what} bf16 padded", ours, theirs, f"max relative difference {max(diffs):.2e}")
    assert _fused_attentions(model) == 2
    assert max(diffs) < 2e-2, (ours, theirs)


@pytest.mark.parametrize("precision,passes", [("bf16", "fuse_attention"), ("bf16", "fuse_attention,autocast"),
                                              ("fp16", "fuse_attention"), ("fp16", "fuse_attention,autocast")])
def test_gpt2_sixteen_bit_fused_attention_trains_like_autocast(precision, passes, monkeypatch):
    """precision="bf16" or "fp16" with the opt-in attention fusion and heads of 64: both layers'
    attention runs fused, on f32 tensors as the tensor-core kernels with products in the 16-bit
    type (kernels/attention_mma.cu, seq 128: two 64-row tiles, the causal mask's upper tile
    skipped), or with the autocast pass on 16-bit tensors as the flash kernels
    (kernels/attention_flash.cuh, bf16 or f16 instances), and the loss curve follows PyTorch's
    autocast (with a GradScaler at fp16) within 2e-2."""
    import models

    monkeypatch.setenv("ORTRAIN_ENABLE_PASSES", passes)
    vocab, seq, batch = 1000, 128, 4
    ref = models.gpt2_small(vocab=vocab, n_layer=2, n_embd=128, n_head=2, n_positions=seq, dropout=0.0,
                            batch=batch, seq=seq, seed=0, attn_implementation="sdpa")[0].cuda()
    model = copy.deepcopy(ref)
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=1e-3), torch.optim.AdamW(model.parameters(), lr=1e-3)
    ortrain.accelerate(model, opt, device="cuda", strict=True, precision=precision)
    half = torch.float16 if precision == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")

    def loss_of(m, ids):
        logits = m(ids).logits
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), ids[:, 1:].reshape(-1))

    g = torch.Generator(device="cuda").manual_seed(7)
    batches = [torch.randint(0, vocab, (batch, seq), device="cuda", generator=g) for _ in range(3)]
    ours, theirs = _curves_against_autocast(model, opt, ref, opt_ref, loss_of, batches, half, scaler)
    diffs = [abs(a - b) / abs(b) for a, b in zip(ours, theirs)]
    print(f"gpt2 {precision} {passes}", ours, theirs, f"max relative difference {max(diffs):.2e}")
    assert _fused_attentions(model) == 2
    assert max(diffs) < 2e-2, (ours, theirs)
    assert ours[-1] < ours[0], ours
    # explain() names the kernels: with the autocast pass the 16-bit tensors take the flash kernels,
    # without it the f32 tensors the tensor-core ones; both compute the folded causal mask
    kernels = "flash kernels" if "autocast" in passes else "tensor-core kernels"
    assert f"fused attention ×2: {kernels}, causal mask computed ×2" in ortrain.explain(model)


def test_gpt2_with_a_padded_attention_mask_takes_it_as_key_padding(monkeypatch):
    """GPT-2 called with Hugging Face's attention_mask (row 0 padded on the left, so its first
    queries see no key; row 1 on the right; the loss counting every position) at bf16 with the
    opt-in attention fusion and autocast: the mask reaches the flash kernels as key padding
    (passes/attention_key_padding.rs), explain() says so, and the loss curve follows PyTorch's
    autocast within 2e-2."""
    import models

    monkeypatch.setenv("ORTRAIN_ENABLE_PASSES", "fuse_attention,autocast")
    vocab, seq, batch = 1000, 128, 4
    ref = models.gpt2_small(vocab=vocab, n_layer=2, n_embd=128, n_head=2, n_positions=seq, dropout=0.0,
                            batch=batch, seq=seq, seed=0, attn_implementation="sdpa")[0].cuda()
    model = copy.deepcopy(ref)
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=1e-3), torch.optim.AdamW(model.parameters(), lr=1e-3)
    ortrain.accelerate(model, opt, device="cuda", strict=True, precision="bf16")
    mask = torch.ones(batch, seq, dtype=torch.int64, device="cuda")
    mask[0, :70] = 0
    mask[1, -30:] = 0

    def loss_of(m, ids):
        logits = m(ids, attention_mask=mask).logits
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), ids[:, 1:].reshape(-1))

    _bf16_padded_curve_follows_autocast("gpt2", model, opt, ref, opt_ref, loss_of, vocab, (batch, seq), seed=11)
    assert "fused attention ×2: flash kernels, causal mask computed, key padding from the input ×2" in ortrain.explain(model)


def test_bert_with_a_padded_attention_mask_takes_it_as_key_padding(monkeypatch):
    """BERT (masked-language model, heads of 64) called with Hugging Face's attention_mask (row 0
    padded on the right, row 1 on the left, row 2 not at all; the loss counting every
    position, padding too) at bf16 with the opt-in attention fusion and autocast: the
    mask, no causal one, reaches the flash kernels as key padding (passes/attention_key_padding.rs
    leaves a mask of zeros, which hides nothing), explain() says so, and the loss curve follows
    PyTorch's autocast within 2e-2."""
    import models

    monkeypatch.setenv("ORTRAIN_ENABLE_PASSES", "fuse_attention,autocast")
    vocab, seq, batch = 1000, 128, 3
    ref, _, _ = models.bert_small(vocab=vocab, layers=2, hidden=128, heads=2, intermediate=512, dropout=0.0,
                                  batch=batch, seq=seq, seed=0, attn_implementation="sdpa")
    ref = ref.cuda()
    model = copy.deepcopy(ref)
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=1e-3), torch.optim.AdamW(model.parameters(), lr=1e-3)
    ortrain.accelerate(model, opt, device="cuda", strict=True, precision="bf16")
    mask = torch.ones(batch, seq, dtype=torch.int64, device="cuda")
    mask[0, -40:] = 0
    mask[1, :25] = 0

    def loss_of(m, ids):
        logits = m(input_ids=ids, attention_mask=mask).logits
        return nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), ids.reshape(-1))

    _bf16_padded_curve_follows_autocast("bert", model, opt, ref, opt_ref, loss_of, vocab, (batch, seq), seed=13)
    assert "fused attention ×2: flash kernels, key padding from the input ×2" in ortrain.explain(model)
