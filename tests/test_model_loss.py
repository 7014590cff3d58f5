"""A model that computes its own loss (Hugging Face's `model(input_ids, labels=ids).loss`, how
its examples and its Trainer train) runs in training for the loss alone (engine/model_loss.py):
the LM head fuses into the loss and the logits are returned lazily, computed only when read,
with this step's dropout masks and parameters. A loop that reads them gets the whole graph from
then on. Losses, gradients and logits as PyTorch's."""
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

V = 200


def _gpt2(dropout=0.0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=V, n_layer=2, n_embd=64, n_head=4, n_positions=64, resid_pdrop=dropout,
                     embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=V - 1, eos_token_id=V - 1)
    return GPT2LMHeadModel(cfg).train()


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (4, 32), generator=g) for _ in range(n)]


def _state(model):
    return model._ortrain_state


def _loss_runner(model):
    (runner,) = [r for k, r in _state(model).loss_runners.items() if k[1] == "model loss"]
    return runner


def test_labels_loss_runs_alone_with_its_lm_head_fused_and_lazy_logits():
    model = _gpt2()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ortrain.accelerate(model, opt, strict=True)
    outs, ref_outs = [], []
    for ids in _batches(3):
        for m, o, kept in ((model, opt, outs), (ref, opt_ref, ref_outs)):
            out = m(input_ids=ids, labels=ids)
            o.zero_grad()
            out.loss.backward()
            o.step()
            kept.append(out)
    assert [o.loss.item() for o in outs] == pytest.approx([o.loss.item() for o in ref_outs], rel=1e-5)
    # perplexity logging recognises the loss as a cross-entropy by its grad_fn, as PyTorch's
    assert "CrossEntropy" in type(outs[-1].loss.grad_fn).__name__
    assert all(type(o.logits) is LazyOutput for o in outs)
    runner = _loss_runner(model)
    assert runner.session.output_names == ["loss"]
    assert dict(runner.session.passes)["fuse_linear_cross_entropy"] == 1
    assert _state(model).model_loss_calls == 3
    text = ortrain.explain(model)
    assert "the model's own loss computed alone, its LM head fused into the loss: 3 call(s)" in text, text
    assert "runs in PyTorch" not in text, text
    # the planned peak of the loss-only graph is below the whole graph's (logits never whole)
    (full,) = [r for r in _state(model).runners.values()]
    inputs = list(_state(model).last_inputs)
    assert runner.plan_info(inputs, True)["arena_bytes"] < full.plan_info(inputs, True)["arena_bytes"]
    # every step's logits, read after later optimizer steps: that step's, as PyTorch's
    for o, r in zip(outs, ref_outs):
        torch.testing.assert_close(o.logits.detach(), r.logits.detach(), rtol=1e-4, atol=1e-4)


def test_replayed_logits_carry_the_steps_dropout_masks():
    """With dropout, the logits read after the fused loss are those the loss was computed from:
    PyTorch's loss on them is the engine's loss."""
    model = _gpt2(dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ortrain.accelerate(model, opt, strict=True)
    for ids in _batches(2):
        out = model(input_ids=ids, labels=ids)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        logits = out.logits.detach()
        again = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
        assert again.item() == pytest.approx(out.loss.item(), rel=1e-5)


def test_a_term_on_the_logits_gets_its_gradient():
    """`out.loss + penalty(out.logits)`: the logits' gradient flows by a replay of the forward
    pass; the weights after two steps are PyTorch's."""
    model = _gpt2()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    ortrain.accelerate(model, opt, strict=True)
    for ids in _batches(2):
        for m, o in ((model, opt), (ref, opt_ref)):
            out = m(input_ids=ids, labels=ids)
            loss = out.loss + 0.01 * out.logits.pow(2).mean()
            o.zero_grad()
            loss.backward()
            o.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_a_loop_reading_the_logits_gets_the_whole_graph_from_then_on():
    """Reading the logits costs one replay of the forward pass: after the first read the call
    runs the whole graph, so a loop computing accuracy every step pays no replay per step."""
    model = _gpt2()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ortrain.accelerate(model, opt, strict=True)
    kinds = []
    for ids in _batches(3):
        accuracies = []
        for m, o in ((model, opt), (ref, opt_ref)):
            out = m(input_ids=ids, labels=ids)
            o.zero_grad()
            out.loss.backward()
            o.step()
            accuracies.append((out.logits[:, :-1].argmax(-1) == ids[:, 1:]).float().mean().item())
            if m is model:
                kinds.append(type(out.logits).__name__)
        assert accuracies[0] == pytest.approx(accuracies[1], abs=1e-6)
    assert kinds == ["LazyOutput", "Tensor", "Tensor"]
    assert _state(model).model_loss_calls == 1
    assert "the logits were read: from then on that call runs the whole graph" in ortrain.explain(model)


class _Regression(torch.nn.Module):
    """Returns its own loss and prediction, the loss not a cross-entropy."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))

    def forward(self, x, y):
        pred = self.net(x).view(2, -1, 4)
        return {"loss": F.mse_loss(pred, y), "pred": pred}


def test_a_loss_the_engine_cannot_fuse_runs_the_whole_graph_as_before():
    torch.manual_seed(0)
    model = _Regression()
    ref = copy.deepcopy(model)
    ortrain.accelerate(model, strict=True)
    x, y = torch.randn(6, 8), torch.randn(2, 3, 4)
    out, ref_out = model(x, y), ref(x, y)
    assert type(out["pred"]) is torch.Tensor
    assert _state(model).model_loss_calls == 0
    assert list(_state(model).loss_runners.values()) == [None]  # built once, not fused: not used
    out["loss"].backward()
    ref_out["loss"].backward()
    assert out["loss"].item() == pytest.approx(ref_out["loss"].item(), rel=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


class _ScaledLoss(torch.nn.Module):
    """A language model returning its own summed cross-entropy, scaled by `scale`: "tokens"
    (divided by the token count, as HF's sum / num_items_in_batch) or "learned" (times a
    trainable temperature)."""

    def __init__(self, scale: str):
        super().__init__()
        self.scale = scale
        self.emb, self.head = torch.nn.Embedding(V, 32), torch.nn.Linear(32, V)
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, ids, labels):
        logits = self.head(self.emb(ids))
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        loss = ce / labels.numel() if self.scale == "tokens" else ce * self.temperature
        return {"loss": loss, "logits": logits}


@pytest.mark.parametrize("scale, per_token", [("tokens", True), ("learned", False)])
def test_perplexity_is_logged_for_a_scaled_cross_entropy_as_in_pytorch(scale, per_token):
    """A cross-entropy divided by the token count is still a per-token loss in the engine as in
    PyTorch (its perplexity is logged in both runs); one that a trainable parameter scales is
    not, in either."""
    from ortrain._steps import is_cross_entropy, loss_kind

    torch.manual_seed(0)
    model = _ScaledLoss(scale)
    ref = copy.deepcopy(model)
    ortrain.accelerate(model, strict=True)
    ids = _batches(1)[0]
    out, ref_out = model(ids, ids), ref(ids, ids)
    assert out["loss"].item() == pytest.approx(ref_out["loss"].item(), rel=1e-5)
    assert is_cross_entropy(loss_kind(ref_out["loss"])) is per_token
    assert is_cross_entropy(loss_kind(out["loss"])) is per_token
    # either way the model's loss ran alone, its LM head fused
    assert _state(model).model_loss_calls == 1 and type(out["logits"]) is LazyOutput


def test_fuse_loss_false_keeps_the_whole_graph():
    model = _gpt2()
    ortrain.accelerate(model, strict=True, fuse_loss=False)
    ids = _batches(1)[0]
    out = model(input_ids=ids, labels=ids)
    assert type(out.logits) is torch.Tensor and not _state(model).loss_runners


@pytest.mark.gpu
def test_labels_loss_on_the_gpu_matches_pytorch():
    """The same on CUDA: the loss-only graph (fused LM head + loss on the GPU), the logits replayed
    when read; losses and logits as PyTorch's on the GPU (TF32 off on both sides)."""
    from conftest import require_cuda

    require_cuda()
    model = _gpt2().cuda()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ortrain.accelerate(model, opt, strict=True, device="cuda")
    losses, ref_losses = [], []
    for ids in _batches(3):
        ids = ids.cuda()
        for m, o, kept in ((model, opt, losses), (ref, opt_ref, ref_losses)):
            out = m(input_ids=ids, labels=ids)
            o.zero_grad()
            out.loss.backward()
            o.step()
            kept.append((out.loss.item(), out.logits))
    assert [a for a, _ in losses] == pytest.approx([a for a, _ in ref_losses], rel=1e-4)
    assert dict(_loss_runner(model).session.passes)["fuse_linear_cross_entropy"] == 1
    for (_, ours), (_, theirs) in zip(losses, ref_losses):
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-3, atol=1e-3)


_ZOO = {  # name -> (config class, model class, config keywords): small, dropout off
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(hidden_dropout=0.0, attention_dropout=0.0)),
    "bert_mlm": ("BertConfig", "BertForMaskedLM", dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
}


@pytest.mark.parametrize("name", list(_ZOO))
def test_hugging_face_models_own_losses_fuse_their_lm_heads(name):
    """The loss-only graph fuses the LM head of each family's `labels=` loss (causal LMs shift
    their labels, BERT's MLM loss does not): the loss and its weights' gradients as PyTorch's."""
    import transformers

    config_cls, model_cls, extra = _ZOO[name]
    cfg = getattr(transformers, config_cls)(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).train()
    ref = copy.deepcopy(model)
    ortrain.accelerate(model, strict=True)
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(2))
    out, ref_out = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    out.loss.backward()
    ref_out.loss.backward()
    assert type(out.logits) is LazyOutput and _state(model).model_loss_calls == 1
    assert dict(_loss_runner(model).session.passes)["fuse_linear_cross_entropy"] == 1
    assert out.loss.item() == pytest.approx(ref_out.loss.item(), rel=1e-5)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            scale = max(q.grad.abs().max().item(), 1e-6)
            assert (p.grad - q.grad).abs().max().item() <= 1e-3 * scale, n
