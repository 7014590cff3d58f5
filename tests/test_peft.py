"""LoRA fine-tuning (peft's `get_peft_model`), the usual way to fine-tune a Llama-style model in
a notebook: the base weights frozen, adapters on the attention projections. The accelerated
PeftModel trains as PyTorch trains it: the same losses and adapter weights, the frozen weights
untouched and without gradients, the `labels=` loss fused with the LM head, the optimizer
(over the adapters only) in the engine."""
from __future__ import annotations

import copy

import pytest
import torch

import ortrain

peft = pytest.importorskip("peft", reason="LoRA needs the peft package (requirements.txt)")

V = 256


def _lora_llama(seed: int = 0):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(cfg)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                           task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, lora)
    with torch.no_grad():  # peft starts B at zero (A's gradient zero at step 1): start both moving
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return model.train()


def test_lora_adapters_train_in_the_engine_as_in_pytorch():
    model = _lora_llama()
    ref = copy.deepcopy(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    ortrain.accelerate(model, opt, strict=True)
    losses, ref_losses = [], []
    for step in range(3):
        ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(step))
        for m, o, kept in ((model, opt, losses), (ref, ref_opt, ref_losses)):
            out = m(input_ids=ids, labels=ids)
            o.zero_grad()
            out.loss.backward()
            o.step()
            kept.append(out.loss.item())
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-6, msg=name)
        else:
            assert p.grad is None and torch.equal(p, frozen[name]), name
    state = model._ortrain_state
    assert state.optimizer_in_engine and state.model_loss_calls == 3
    text = ortrain.explain(model)
    assert "] runs in PyTorch" not in text and "fuse_linear_cross_entropy ×1" in text, text
    n_all = sum(p.numel() for p in model.parameters())
    n_lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert f"{n_all:,} parameters ({n_lora:,} trainable)" in text, text
