"""Training on a GPU with `accelerate(model, opt, device="cuda")`, against PyTorch eager on the
same GPU from the same initial weights: outputs, every parameter gradient, and the loss curve of
a few optimizer steps. Skipped (with the reason) where there is no usable GPU."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

import ortrain
from conftest import require_cuda

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _gpu():
    require_cuda()
    yield


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)).cuda()


def _mlp_batches(seed: int) -> list:
    """Four (x [32, 16], labels of 10 classes) batches on the GPU for _mlp."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(32, 16, device="cuda", generator=g), torch.randint(0, 10, (32,), device="cuda", generator=g))
            for _ in range(4)]


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def test_mlp_outputs_and_gradients_match_eager_on_the_gpu():
    ref = _mlp()
    model = copy.deepcopy(ref)
    ortrain.accelerate(model, device="cuda", strict=True, fuse_loss=False)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(32, 16, device="cuda", generator=g)
    y = torch.randint(0, 10, (32,), device="cuda", generator=g)
    out, want = model(x), ref(x)
    assert out.is_cuda and out.shape == want.shape
    assert _max_rel(out, want) < 1e-5
    nn.functional.cross_entropy(out, y).backward()
    nn.functional.cross_entropy(want, y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.is_cuda, name
        assert _max_rel(p.grad, q.grad) < 1e-5, f"{name}: {_max_rel(p.grad, q.grad)}"
    state = model.__dict__["_ortrain_state"]
    assert state.engine_calls == state.calls == 1


def test_mlp_trains_like_eager_on_the_gpu():
    ref = _mlp()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ortrain.accelerate(model, opt, device="cuda", strict=True, fuse_loss=False)
    batches = _mlp_batches(2)
    losses, ref_losses = [], []
    for step in range(20):
        x, y = batches[step % 4]
        for m, o, acc in ((model, opt, losses), (ref, opt_ref, ref_losses)):
            o.zero_grad()
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            acc.append(loss.item())
    assert losses[-1] < losses[0] * 0.8, losses
    diffs = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
    assert max(diffs) < 1e-4, (losses, ref_losses)
    print("ortrain", [f"{v:.5f}" for v in losses[::5]], "eager", [f"{v:.5f}" for v in ref_losses[::5]],
          f"max relative difference {max(diffs):.2e}")


def _curves(make, batches, steps, lr=1e-3, **accel):
    """Loss curves of `make()` trained by PyTorch eager and by ortrain on the GPU, from the same
    initial weights on the same batches (Adam)."""
    ref = make()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=lr)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    ortrain.accelerate(model, opt, device="cuda", strict=True, **accel)
    out = {"ortrain": [], "eager": []}
    for step in range(steps):
        x, forward_loss = batches[step % len(batches)]
        for name, m, o in (("ortrain", model, opt), ("eager", ref, opt_ref)):
            o.zero_grad()
            loss = forward_loss(m, x)
            loss.backward()
            o.step()
            out[name].append(loss.item())
    return out, model


def _lm_head_fusions(model) -> int:
    """LinearCrossEntropy nodes the engine's fuse_linear_cross_entropy pass made in the model's
    loss graphs (the LM head and its loss, chunked)."""
    runners = model.__dict__["_ortrain_state"].loss_runners.values()
    return max((dict(r.session.passes).get("fuse_linear_cross_entropy", 0) for r in runners if hasattr(r, "session")),
               default=0)


def _fused_attentions(model) -> int:
    """Attention nodes the engine's fuse_attention pass made in the model's sessions."""
    runners = model.__dict__["_ortrain_state"].runners.values()
    return max((dict(r.session.passes).get("fuse_attention", 0) for r in runners if hasattr(r, "session")), default=0)


class _SmallCnn(nn.Module):
    """Conv2d (strided, padded), BatchNorm2d in training mode, MaxPool2d, a grouped 1×1 Conv2d,
    AvgPool2d and AdaptiveAvgPool2d, then a Linear classifier: every CNN op family on CUDA."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False)  # BatchNorm follows
        self.bn = nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(16, 16, 1, groups=4)
        self.avg = nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        h = self.pool(torch.relu(self.bn(self.conv1(x))))
        h = self.avg(torch.relu(self.conv2(h)))
        return self.head(nn.functional.adaptive_avg_pool2d(h, 1).flatten(1))


def test_small_cnn_trains_like_eager_on_the_gpu():
    """Conv, BatchNorm, the pools and their gradients run in the engine on CUDA (strict: no
    fallback) and train like eager, BatchNorm's running statistics included."""
    torch.manual_seed(0)
    ref = _SmallCnn().cuda()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ortrain.accelerate(model, opt, device="cuda", strict=True, fuse_loss=False)
    g = torch.Generator(device="cuda").manual_seed(5)
    batches = [(torch.randn(8, 3, 32, 32, device="cuda", generator=g), torch.randint(0, 10, (8,), device="cuda", generator=g))
               for _ in range(3)]
    losses = {"ortrain": [], "eager": []}
    for step in range(12):
        x, y = batches[step % 3]
        for name, m, o in (("ortrain", model, opt), ("eager", ref, opt_ref)):
            o.zero_grad()
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            losses[name].append(loss.item())
    diffs = [abs(a - b) / abs(b) for a, b in zip(losses["ortrain"], losses["eager"])]
    assert max(diffs) < 1e-3, losses
    assert losses["ortrain"][9] < losses["ortrain"][0], losses  # the same batch, 9 steps later
    assert model.bn.num_batches_tracked.item() == 12
    for buf in ("running_mean", "running_var"):
        assert _max_rel(getattr(model.bn, buf), getattr(ref.bn, buf)) < 1e-3, buf
    state = model.__dict__["_ortrain_state"]
    assert state.engine_calls == state.calls == 12


def test_tutorial_transformer_trains_like_eager_on_the_gpu():
    """The PyTorch tutorial's model (embedding, positional encoding, two encoder layers with
    attention, LayerNorm and the LM head) with the loss fused into the engine graph."""
    import models

    vocab, seq, batch = 1000, 35, 20

    def make():
        return models.tutorial_transformer(vocab, dropout=0.0, seed=0)[0].cuda()

    g = torch.Generator(device="cuda").manual_seed(3)
    crit = nn.CrossEntropyLoss()

    def forward_loss(m, x):
        src, tgt = x
        return crit(m(src).view(-1, vocab), tgt)

    batches = [((torch.randint(0, vocab, (seq, batch), device="cuda", generator=g),
                 torch.randint(0, vocab, (seq * batch,), device="cuda", generator=g)), forward_loss) for _ in range(3)]
    curves, model = _curves(make, batches, 12)
    diffs = [abs(a - b) / abs(b) for a, b in zip(curves["ortrain"], curves["eager"])]
    print("tutorial", curves, f"max relative difference {max(diffs):.2e}, fused attentions {_fused_attentions(model)}")
    assert max(diffs) < 1e-3, curves
    assert model.__dict__["_ortrain_state"].fused_loss_calls == 12
    assert _lm_head_fusions(model) == 1


@pytest.mark.parametrize("fused_attention", [False, True], ids=["unfused", "fused_attention"])
def test_gpt2_trains_like_eager_on_the_gpu(fused_attention, monkeypatch):
    """A 2-layer GPT-2 (Hugging Face, sdpa attention) with the shifted LM loss fused; with the
    opt-in attention fusion, both layers' attention runs as the engine's fused kernels (seq 64:
    two query tiles, the causal mask's upper tile skipped)."""
    import models

    if fused_attention:
        monkeypatch.setenv("ORTRAIN_ENABLE_PASSES", "fuse_attention")
    else:
        monkeypatch.delenv("ORTRAIN_ENABLE_PASSES", raising=False)

    vocab, seq, batch = 1000, 64, 4

    def make():
        return models.gpt2_small(vocab=vocab, n_layer=2, n_embd=128, n_head=4, n_positions=seq, dropout=0.0,
                                 batch=batch, seq=seq, seed=0, attn_implementation="sdpa")[0].cuda()

    def forward_loss(m, ids):
        logits = m(ids).logits
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))

    g = torch.Generator(device="cuda").manual_seed(4)
    batches = [(torch.randint(0, vocab, (batch, seq), device="cuda", generator=g), forward_loss) for _ in range(3)]
    curves, model = _curves(make, batches, 10)
    diffs = [abs(a - b) / abs(b) for a, b in zip(curves["ortrain"], curves["eager"])]
    print("gpt2", curves, f"max relative difference {max(diffs):.2e}")
    assert max(diffs) < 1e-3, curves
    assert _fused_attentions(model) == (2 if fused_attention else 0)
    assert _lm_head_fusions(model) == 1


def test_llama_trains_like_eager_on_the_gpu():
    """A 2-layer Llama (Hugging Face: RMSNorm, rotary embeddings, grouped-query sdpa attention,
    SwiGLU) with the `labels=` loss: its RMSNorms (two a layer and the final one) run as the
    engine's fused RmsNorm kernels, and the loss curve follows eager's."""
    import models

    vocab, seq, batch = 1000, 64, 4

    def make():
        return models.llama_small(vocab=vocab, n_layer=2, hidden=128, batch=batch, seq=seq, seed=0)[0].cuda()

    def forward_loss(m, ids):
        return m(input_ids=ids, labels=ids).loss

    g = torch.Generator(device="cuda").manual_seed(5)
    batches = [(torch.randint(0, vocab, (batch, seq), device="cuda", generator=g), forward_loss) for _ in range(3)]
    curves, model = _curves(make, batches, 10)
    diffs = [abs(a - b) / abs(b) for a, b in zip(curves["ortrain"], curves["eager"])]
    state = model.__dict__["_ortrain_state"]
    runners = [r for r in list(state.runners.values()) + list(state.loss_runners.values()) if hasattr(r, "session")]
    norms = max(dict(r.session.passes).get("fuse_rms_norm", 0) for r in runners)
    print("llama", curves, f"max relative difference {max(diffs):.2e}, fused RMSNorms {norms}")
    assert max(diffs) < 1e-3, curves
    assert norms == 5, f"fuse_rms_norm rewrote {norms} norms, expected 2 a layer and the final one"


def test_fused_loss_logits_are_replayed_on_the_gpu():
    """With the loss fused, the logits are never whole on the GPU either: the fused graph's only
    output is the loss, and logits read afterwards (here after optimizer.step(), from the
    parameter copy taken before it) are the forward's, as eager computes them."""
    import models

    vocab, seq, batch = 1000, 35, 20
    ref = models.tutorial_transformer(vocab, dropout=0.0, seed=0)[0].cuda()
    model = copy.deepcopy(ref)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ortrain.accelerate(model, opt, device="cuda", strict=True)
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randint(0, vocab, (seq, batch), device="cuda", generator=g)
    y = torch.randint(0, vocab, (seq * batch,), device="cuda", generator=g)
    out = model(x)
    loss = nn.functional.cross_entropy(out.view(-1, vocab), y)
    loss.backward()
    (runner,) = model.__dict__["_ortrain_state"].loss_runners.values()
    assert runner.session.output_names == ["ortrain_ce_loss"]
    opt.step()
    want = ref(x)
    assert _max_rel(nn.functional.cross_entropy(want.view(-1, vocab), y), loss) < 1e-5
    assert _max_rel(out, want) < 1e-5


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_engine_adam_on_the_gpu_follows_torch(cls):
    """accelerate's optimizer on the GPU: Adam/AdamW run as the engine's one multi-tensor launch
    (tensors of several 65536-element chunks, the last partial, and tiny ones) and follow
    torch's own step: parameters and both moments after 6 steps, weight decay, and a parameter
    without a gradient in one step left alone; the state loads back into plain torch."""
    from ortrain.engine.optimizer import accelerate_optimizer

    g = torch.Generator(device="cuda").manual_seed(6)
    shapes = [(300, 500), (7,), (1000,), (65536,)]
    ref = [torch.randn(s, device="cuda", generator=g).requires_grad_() for s in shapes]
    ours = [p.detach().clone().requires_grad_() for p in ref]
    kw = {"lr": 1e-2, "betas": (0.8, 0.99), "weight_decay": 0.1}
    opt_ref, opt = cls(ref, **kw), cls(ours, **kw)
    assert accelerate_optimizer(opt, strict=True)
    for step in range(6):
        for i, (a, b) in enumerate(zip(ref, ours)):
            skip = step == 2 and i == 1
            grad = None if skip else torch.randn(a.shape, device="cuda", generator=g)
            a.grad, b.grad = grad, None if grad is None else grad.clone()
        opt_ref.step()
        opt.step()
    assert "_ortrain_gpu_chunks" in opt.__dict__  # the engine's launch ran, not torch's fallback
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, rtol=2e-6, atol=1e-7)
        # torch's CUDA foreach update is p + s·(m/d), the engine's (as torch's CPU) p + (s·m)/d: a
        # parameter an ulp apart, which Adam's L2 decay feeds into the next gradient, so exp_avg
        # near 0 moves by ~1e-8 (an f32 emulation of the 6 steps: at most 0.65 of 1e-7)
        for key, atol in (("exp_avg", 2e-7), ("exp_avg_sq", 1e-9)):
            torch.testing.assert_close(opt.state[b][key], opt_ref.state[a][key], rtol=2e-6, atol=atol)
        assert float(opt.state[b]["step"]) == float(opt_ref.state[a]["step"])
    plain = cls([p.detach().clone() for p in ours], **kw)
    plain.load_state_dict(opt.state_dict())


def test_a_failing_gpu_update_falls_back_to_torchs_step(monkeypatch):
    """If the engine's GPU Adam launch fails, the step is PyTorch's (with one warning), counted
    once, and later steps stay in PyTorch: the parameters follow torch's own optimizer."""
    from ortrain import _ortrain
    from ortrain.engine import optimizer as engine_optimizer

    def broken(*args, **kwargs):
        raise _ortrain.EngineError("no kernel named adam_f32 (simulated)")

    monkeypatch.setattr(_ortrain, "cuda_adam_step", broken)
    monkeypatch.setattr(engine_optimizer, "_GPU_UPDATE_WORKS", [True])
    g = torch.Generator(device="cuda").manual_seed(8)
    ref = [torch.randn(s, device="cuda", generator=g).requires_grad_() for s in [(50, 3), (7,)]]
    ours = [p.detach().clone().requires_grad_() for p in ref]
    opt_ref, opt = torch.optim.Adam(ref, lr=1e-2), torch.optim.Adam(ours, lr=1e-2)
    assert engine_optimizer.accelerate_optimizer(opt, strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for a, b in zip(ref, ours):
                a.grad = torch.randn(a.shape, device="cuda", generator=g)
                b.grad = a.grad.clone()
            opt_ref.step()
            opt.step()
    failed = [w for w in caught if "GPU Adam update failed" in str(w.message)]
    assert len(failed) == 1, [str(w.message) for w in caught]
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a)
        assert float(opt.state[b]["step"]) == float(opt_ref.state[a]["step"]) == 3.0


def _tutorial_dropout_losses(steps: int):
    """(losses, model) of `steps` Adam steps of the tutorial model with dropout 0.2 (its
    attentions' probabilities too) under ortrain on the GPU, from torch seed 0."""
    import models

    vocab = 500
    torch.manual_seed(0)
    m = models.tutorial_transformer(vocab, dropout=0.2, seed=0)[0].cuda()
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    ortrain.accelerate(m, opt, device="cuda", strict=True)
    g = torch.Generator(device="cuda").manual_seed(5)
    src = torch.randint(0, vocab, (35, 20), device="cuda", generator=g)
    tgt = torch.randint(0, vocab, (700,), device="cuda", generator=g)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(m(src).view(-1, vocab), tgt)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, m


def test_attention_dropout_fuses_on_the_gpu_and_drops_what_the_unfused_step_drops(monkeypatch):
    """With the opt-in attention fusion, the tutorial model's two attentions fuse with their
    dropout (ratio 0.2): the fused kernels regenerate the Philox mask the unfused Dropout draws
    under the same node name, so the losses are the unfused run's to float rounding (the online
    softmax sums in another order), where other masks would move them by far more."""
    monkeypatch.delenv("ORTRAIN_ENABLE_PASSES", raising=False)
    plain, _ = _tutorial_dropout_losses(5)
    monkeypatch.setenv("ORTRAIN_ENABLE_PASSES", "fuse_attention")
    fused, model = _tutorial_dropout_losses(5)
    print("tutorial, dropout 0.2: unfused", plain, "fused", fused)
    assert _fused_attentions(model) == 2
    diffs = [abs(a - b) / abs(b) for a, b in zip(fused, plain)]
    assert max(diffs) < 1e-4, (fused, plain)


def test_dropout_on_the_gpu_is_seeded_and_trains():
    """Dropout masks come from the engine's Philox stream: they differ from PyTorch's (as
    PyTorch's own CPU and CUDA masks differ), so the check is statistical: the model trains,
    and the same torch seed gives the same masks, hence the same losses bit for bit: no kernel
    of the step sums in a varying order (the embedding's gradient sums its repeated rows in
    position order; with float atomics two runs once differed by 4e-5 relative after 15
    steps on an H100)."""
    a, b = _tutorial_dropout_losses(15)[0], _tutorial_dropout_losses(15)[0]
    # the first loss depends only on the forward pass: the same seed, the same masks, bit for bit
    assert a[0] == b[0], (a, b)
    # a difference from the second step on is a kernel summing in a varying order
    assert a == b, (a, b)
    assert a[-1] < a[0] * 0.9, a


def test_explain_on_the_gpu():
    """explain() says the model runs on the GPU and how its matmuls run."""
    model = _mlp()
    ortrain.accelerate(model, device="cuda", strict=True, fuse_loss=False)
    x = torch.randn(8, 16, device="cuda")
    model(x).sum().backward()
    text = ortrain.explain(model)
    assert "device cuda" in text and "matmuls fp32 on cuBLAS (TF32 off)" in text, text


def test_an_out_of_range_index_is_reported_by_the_next_step():
    """GPU kernels cannot stop on a bad embedding id or label: they write 0 and set a flag per
    node, which the next step reads (without waiting for the GPU) and reports as an IndexError
    naming the node; after that, steps run again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Flatten(), nn.Linear(8 * 4, 3)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ortrain.accelerate(model, opt, device="cuda", strict=True, fuse_loss=False)
    good = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], device="cuda")
    bad = torch.tensor([[1, 2, 3, 4], [5, 6, 12, 8]], device="cuda")
    y = torch.tensor([0, 2], device="cuda")

    def step(x):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    step(good)
    step(bad)  # queued; the flag lands with it
    torch.cuda.synchronize()
    with pytest.raises(IndexError, match=r"out of range in a recent step on the GPU, in Gather node '[^']+'"):
        step(good)
    assert math.isfinite(step(good))  # reported once, then cleared
    torch.cuda.synchronize()
    step(good)


def test_tf32_follows_pytorchs_flag():
    """With torch.backends.cuda.matmul.allow_tf32 set, the engine's f32 matmuls may use TF32
    too: ortrain and eager then agree to TF32's precision, not f32's."""
    ref = _mlp()
    model = copy.deepcopy(ref)
    ortrain.accelerate(model, device="cuda", strict=True, fuse_loss=False)
    x = torch.randn(64, 16, device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        out, want = model(x), ref(x)
        assert "TF32 allowed" in ortrain.explain(model)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    assert _max_rel(out, want) < 5e-3


def test_explain_prints_the_planned_gpu_memory_before_step_one():
    """explain(model, x) before the first step prints the planned GPU memory (parameters,
    gradients, Adam's state, the fused loss graph's arena); torch.cuda's peak during the second
    and third steps (all four alive; the second records the CUDA graphs, the third replays
    them), over what this process held before the model was made, is within 10% of it."""
    import gc
    import re

    import models

    # earlier tests of this process may still hold memory: in a whole `pytest -m gpu` run on an
    # H200 the plain peak read 106.9 MiB against 41.4 planned, where the same steps in a fresh
    # process peaked 41.5 MiB over what it held before
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    vocab, seq, batch = 2000, 35, 20
    model, _, _ = models.tutorial_transformer(vocab, dropout=0.0, seed=0)
    model = model.cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ortrain.accelerate(model, opt, device="cuda", strict=True)
    x = torch.randint(0, vocab, (seq, batch), device="cuda")
    y = torch.randint(0, vocab, (seq * batch,), device="cuda")
    text = ortrain.explain(model, x)
    m = re.search(r"with the loss fused .*GPU memory planned: .* = ([0-9.]+) MiB", text)
    assert m, text
    # the runtime exists once accelerate() has checked CUDA, with cuBLAS's 32 MiB workspace at least
    assert re.search(r"ortrain's runtime holds [0-9.]+ MiB more outside PyTorch's allocator", text), text
    planned = float(m.group(1)) * 2**20

    def step():
        opt.zero_grad()  # .grad None: autograd keeps the engine's gradient tensors, no second copy
        nn.functional.cross_entropy(model(x).view(-1, vocab), y).backward()
        opt.step()

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    print(f"planned {planned / 2**20:.1f} MiB, torch.cuda peak during steps 2-3 {peak / 2**20:.1f} MiB")
    assert abs(peak - planned) <= 0.1 * planned, (peak, planned, text)


def test_planned_arena_is_what_torch_cuda_allocates():
    """The memory plan's arena is the step's device memory: during a forward pass, torch.cuda's
    allocation grows by the planned arena plus the output, within 10% of the arena."""
    import models

    vocab, seq, batch = 1000, 35, 20
    model = models.tutorial_transformer(vocab, dropout=0.0, seed=0)[0].cuda()
    ortrain.accelerate(model, device="cuda", strict=True, fuse_loss=False)
    x = torch.randint(0, vocab, (seq, batch), device="cuda")
    model(x).sum().backward()  # plans the step
    runner = next(iter(model.__dict__["_ortrain_state"].runners.values()))
    planned = max(runner.arena_sizes.values())
    assert planned > 1 << 20
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = model(x)
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_allocated() - base
    expected = planned + out.numel() * out.element_size()
    print(f"planned arena {planned / 2**20:.2f} MiB, forward allocation growth {growth / 2**20:.2f} MiB")
    assert abs(growth - expected) <= 0.1 * planned, (growth, expected)


@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["clipped", "under-the-limit"])
def test_clip_grad_norm_of_gpu_gradients_runs_in_the_engine(max_norm, monkeypatch):
    """clip_grad_norm_ over an accelerated model's GPU gradients runs as the engine's three
    launches (kernels/optim.cu, no host synchronisation): the same total norm as torch's within
    f32 rounding, returned as a 0-dim CUDA tensor, and the same clipped gradients; a coefficient
    of 1 leaves them unchanged."""
    import models
    from ortrain import _ortrain
    from ortrain.engine import clip

    model, (x,), loss_fn = models.tutorial_transformer(300, dropout=0.0)
    model, x = model.cuda(), x.cuda()
    ortrain.accelerate(model, torch.optim.Adam(model.parameters(), lr=1e-3), device="cuda", strict=True)
    loss_fn(model(x), x).backward()
    ref_params = []
    for p in model.parameters():
        q = nn.Parameter(p.detach().clone())
        q.grad = p.grad.clone()
        ref_params.append(q)
    calls = []
    real = _ortrain.cuda_clip_grad_norm
    monkeypatch.setattr(_ortrain, "cuda_clip_grad_norm", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    want = clip._ORIGINAL[0](ref_params, max_norm)
    assert len(calls) == 1, "the engine did not clip"
    assert total.device.type == "cuda" and total.dtype == torch.float32 and total.shape == ()
    assert abs(total.item() - want.item()) <= 2e-6 * want.item(), (total.item(), want.item())
    for (n, p), q in zip(model.named_parameters(), ref_params):
        scale = max(q.grad.abs().max().item(), 1e-12)
        assert (p.grad - q.grad).abs().max().item() <= 2e-6 * scale, n
    if max_norm > total.item():
        for p, q in zip(model.parameters(), ref_params):
            assert torch.equal(p.grad, q.grad)
    assert "call(s) in the engine" in ortrain.explain(model)
