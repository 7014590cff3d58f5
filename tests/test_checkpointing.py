"""torch.utils.checkpoint in an accelerated model: the engine recomputes the checkpointed
modules in the backward pass as PyTorch does, so a user who checkpoints to fit a bigger batch
keeps that memory under ortrain, with the same numbers."""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import models
import ortrain
from ortrain.engine.tensors import engine_dtype

VOCAB = 100


class Encoder(torch.nn.Module):
    """Embedding, Transformer encoder layers (dropout inside), an LM head; `how` says how each
    layer is called: "plain", "module" (checkpoint(layer, h)), "method" (checkpoint(layer.__call__)
    through functools.partial, as Hugging Face does), "closure" (the create_custom_forward(layer)
    idiom), "default-arg" (a lambda holding the layer as a default), "root-closure" (a lambda
    reaching the layer through the model itself) or "sequential" (checkpoint_sequential over
    the layers in 2 segments: the first half checkpointed as one part)."""

    def __init__(self, how: str, dropout: float, reentrant: bool = False, layers: int = 3):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 64)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(64, 4, 128, dropout, batch_first=True) for _ in range(layers))
        self.head = torch.nn.Linear(64, VOCAB)
        self.how, self.reentrant = how, reentrant

    def forward(self, x):
        h = self.emb(x)
        if self.how == "sequential":
            return self.head(checkpoint_sequential(list(self.layers), 2, h, use_reentrant=self.reentrant))
        for i, layer in enumerate(self.layers):
            if self.how == "plain":
                h = layer(h)
            elif self.how == "module":
                h = checkpoint(layer, h, use_reentrant=self.reentrant)
            elif self.how == "method":
                h = functools.partial(checkpoint, use_reentrant=self.reentrant)(layer.__call__, h)
            elif self.how == "closure":
                h = checkpoint(_custom_forward(layer), h, use_reentrant=self.reentrant)
            elif self.how == "default-arg":
                h = checkpoint(lambda t, layer=layer: layer(t), h, use_reentrant=self.reentrant)
            else:
                h = checkpoint(lambda t, i=i: self.layers[i](t), h, use_reentrant=self.reentrant)
        return self.head(h)


def _custom_forward(module):
    def custom_forward(*inputs):
        return module(*inputs)
    return custom_forward


def _train(how: str, dropout: float, *, reentrant=False, accelerated=True, steps=4, exporter="auto", device="cpu",
           layers=3):
    torch.manual_seed(0)
    model = Encoder(how, dropout, reentrant, layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if accelerated:
        ortrain.accelerate(model, opt, strict=True, exporter=exporter, device=device)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = (torch.randint(0, VOCAB, (8, 32), generator=g).to(device) for _ in range(2))
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses, (x, y)


def _peak_arena(model, x, y) -> int:
    runner = next(iter(model._ortrain_state.loss_runners.values()))
    sigs = [(engine_dtype(t, n), list(t.shape)) for t, n in zip([x, y.reshape(-1)], runner.input_names)]
    return runner.session.plan_info(sigs, True, True)["arena_bytes"]


@pytest.mark.parametrize("how,reentrant,exporter", [("module", False, "auto"), ("method", False, "auto"),
                                                    ("module", True, "auto"), ("module", False, "legacy"),
                                                    ("closure", False, "auto"), ("default-arg", True, "auto")])
def test_checkpointed_layers_train_bit_for_bit_as_without_in_less_memory(how, reentrant, exporter):
    plain, plain_losses, (x, y) = _train("plain", 0.1, exporter=exporter)
    ckpt, ckpt_losses, _ = _train(how, 0.1, reentrant=reentrant, exporter=exporter)
    # the same dropout masks (drawn once, in the forward pass) and the same kernels on the same
    # inputs: bit for bit
    assert ckpt_losses == plain_losses
    for (name, p), q in zip(ckpt.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    text = ortrain.explain(ckpt)
    assert ("torch.utils.checkpoint: 3 of 3 checkpointed module(s) recomputed in the backward pass "
            "(layers.0, layers.1, layers.2)") in text, text
    assert "checkpoint" not in ortrain.explain(plain)
    with_ckpt, without = _peak_arena(ckpt, x, y), _peak_arena(plain, x, y)
    assert with_ckpt < 0.6 * without, (with_ckpt, without)


@pytest.mark.gpu
def test_checkpointed_layers_train_on_the_gpu_as_without():
    """On CUDA: the copies are launches of the forward's kernels in the backward phase, the
    Dropout's copy reads the Philox mask drawn in the forward pass."""
    from conftest import require_cuda

    require_cuda()
    plain, plain_losses, _ = _train("plain", 0.1, device="cuda")
    ckpt, ckpt_losses, _ = _train("module", 0.1, device="cuda")
    assert ckpt_losses == pytest.approx(plain_losses, rel=1e-6)
    for (name, p), q in zip(ckpt.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert "3 of 3 checkpointed module(s) recomputed in the backward pass" in ortrain.explain(ckpt)


def test_checkpointed_layers_match_pytorch_checkpointing():
    ours, our_losses, _ = _train("module", 0.0)
    eager, eager_losses, _ = _train("module", 0.0, accelerated=False)
    assert our_losses == pytest.approx(eager_losses, rel=1e-5, abs=1e-6)
    for (name, p), q in zip(ours.named_parameters(), eager.parameters()):
        if name.endswith("in_proj_bias"):
            # its key third has a gradient of rounding noise only (softmax ignores a shift of
            # the scores), which AdamW turns into full-size steps either way
            p, q = p[:64], q[:64]
        p, q = p.detach(), q.detach()
        # AdamW moves a weight by about lr a step whatever its gradient's size: an element whose
        # gradient is rounding noise (the engine's and PyTorch's kernels sum in different orders,
        # differently on each CPU) can move differently; any other must not
        off = ~torch.isclose(p, q, rtol=1e-4, atol=1e-5)
        assert int(off.sum()) <= max(1, p.numel() // 1000), (name, int(off.sum()), p.numel())
        assert float((p - q).abs().max()) <= 2 * 1e-3 * len(our_losses), name


def test_a_checkpointed_closure_over_the_whole_model_is_kept_and_explain_says_so():
    plain, plain_losses, _ = _train("plain", 0.1)
    closure, closure_losses, _ = _train("root-closure", 0.1)
    assert closure_losses == plain_losses
    text = ortrain.explain(closure)
    assert ("torch.utils.checkpoint: no checkpointed module's nodes found in the graph; checkpointed calls of "
            "functions that hold no module of the model (or the whole model): their values are kept") in text, text
    assert "recomputed in the backward pass" not in text


def test_checkpoint_sequential_recomputes_its_segment_as_one_part():
    plain, plain_losses, (x, y) = _train("plain", 0.1, layers=4)
    seq, seq_losses, _ = _train("sequential", 0.1, layers=4)
    assert seq_losses == plain_losses
    text = ortrain.explain(seq)
    assert ("torch.utils.checkpoint: 1 of 1 checkpointed module(s) recomputed in the backward pass "
            "(layers.0..layers.1)") in text, text
    assert _peak_arena(seq, x, y) < _peak_arena(plain, x, y)


def test_hugging_face_gradient_checkpointing_is_recomputed():
    pytest.importorskip("transformers")
    plain, plain_losses, _ = models.train_gpt2_with_labels(checkpointing=False, accelerated=True)
    ckpt, ckpt_losses, _ = models.train_gpt2_with_labels(checkpointing=True, accelerated=True)
    eager, eager_losses, _ = models.train_gpt2_with_labels(checkpointing=True, accelerated=False)
    assert ckpt_losses == plain_losses
    assert ckpt_losses == pytest.approx(eager_losses, rel=1e-5)
    for (name, p), q in zip(ckpt.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    text = ortrain.explain(ckpt)
    assert ("torch.utils.checkpoint: 2 of 2 checkpointed module(s) recomputed in the backward pass "
            "(transformer.h.0, transformer.h.1)") in text, text
    peak = [float(line.split("peak arena ")[1].split(" MiB")[0]) for line in (text, ortrain.explain(plain))
            for line in line.splitlines() if "plan for inputs" in line]
    # neither run keeps the attention's scores (the engine fuses the attention): what is left to
    # save is each block's other activations
    assert peak[0] < 0.8 * peak[1], peak
