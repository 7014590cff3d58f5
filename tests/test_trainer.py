"""ORTTrainer: the whole step (loss, backward, clipping, optimizer) in the engine matches the same
loop in PyTorch; options are validated; state_dict, eval_step and save_as_onnx work."""
import copy

import onnx
import pytest
import torch

import models
import ortrain
from ortrain import optim
from ortrain.errors import UnsupportedError

NTOK = 1000
DESC = {"inputs": [("src", ["seq", "batch"]), ("target", ["n"])],
        "outputs": [("loss", [], True), ("output", ["seq", "batch", NTOK])]}
CRIT = torch.nn.CrossEntropyLoss()


def loss_fn(out, target):
    return CRIT(out.view(-1, NTOK), target)


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, NTOK, (35, 20), generator=g), torch.randint(0, NTOK, (700,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("config,torch_opt", [
    (optim.AdamConfig(lr=1e-3), lambda p: torch.optim.Adam(p, lr=1e-3)),
    (optim.AdamConfig(lr=1e-3, lambda_coef=0.01, decoupled_weight_decay=True), lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01)),
    (optim.SGDConfig(lr=0.1, momentum=0.9, nesterov=True), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)),
])
def test_train_step_matches_pytorch_loop(config, torch_opt):
    ref, _, _ = models.tutorial_transformer(NTOK, dropout=0.0)
    trainer = ortrain.ORTTrainer(copy.deepcopy(ref), DESC, config, loss_fn=loss_fn, options={"utils": {"grad_norm_clip": 0.5}})
    opt = torch_opt(ref.parameters())
    for x, y in _data(6):
        loss, out = trainer.train_step(x, y)
        assert out.shape == (35, 20, NTOK)
        lr = loss_fn(ref(x), y)
        opt.zero_grad()
        lr.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        assert abs(loss.item() - lr.item()) <= 1e-4 * lr.item(), (loss.item(), lr.item())


def test_gradient_accumulation_and_scheduler_and_lamb_learn():
    model, _, _ = models.tutorial_transformer(NTOK, dropout=0.0)
    sched = optim.LinearWarmupLRScheduler(total_steps=20, warmup=0.2)
    trainer = ortrain.ORTTrainer(model, DESC, optim.LambConfig(lr=1e-2), loss_fn=loss_fn,
                                 options={"batch": {"gradient_accumulation_steps": 2}, "lr_scheduler": sched})
    x, y = _data(1)[0]
    losses = [trainer.train_step(x, y)[0].item() for _ in range(16)]
    assert trainer.step == 8
    assert losses[-1] < losses[0] - 0.5  # the same batch over and over: it must memorise


def test_options_are_validated():
    model, _, _ = models.tutorial_transformer(NTOK, dropout=0.0)
    make = lambda opts: ortrain.ORTTrainer(model, DESC, optim.AdamConfig(), loss_fn=loss_fn, options=opts)  # noqa: E731
    with pytest.raises(ValueError, match="unknown section 'batchh'.*valid: batch"):
        make({"batchh": {}})
    with pytest.raises(ValueError, match="unknown key 'grad_accum'.*gradient_accumulation_steps"):
        make({"batch": {"grad_accum": 2}})
    with pytest.raises(ValueError, match="mixed_precision.*dtype.*'fp16'.*runs on CUDA, through ortrain.accelerate"):
        make({"mixed_precision": {"enabled": True, "dtype": "fp16"}})
    with pytest.raises(ValueError, match="loss_scaler.*bf16 needs no loss scaling; fp16 .* runs on CUDA"):
        make({"mixed_precision": {"enabled": True, "loss_scaler": "dynamic"}})
    with pytest.raises(UnsupportedError, match="enable_adasum.*not supported yet"):
        make({"distributed": {"world_size": 4, "enable_adasum": True}})
    with pytest.raises(ValueError, match=r"frozen_weights'\] names unknown parameters"):
        make({"utils": {"frozen_weights": ["nope"]}})
    make({"distributed": {"world_size": 1}, "utils": {"grad_norm_clip": False}})  # neutral values are fine


def test_frozen_weights_do_not_move_and_state_round_trips(tmp_path):
    model, _, _ = models.tutorial_transformer(NTOK, dropout=0.0)
    frozen = "encoder.weight"
    before = model.state_dict()[frozen].clone()
    trainer = ortrain.ORTTrainer(model, DESC, optim.AdamConfig(lr=1e-3), loss_fn=loss_fn,
                                 options={"utils": {"frozen_weights": [frozen]}})
    data = _data(4)
    for x, y in data[:2]:
        trainer.train_step(x, y)
    assert torch.equal(model.state_dict()[frozen], before)
    state = trainer.state_dict()
    assert set(state["model"]) == set(model.state_dict())
    # a second trainer loaded from the state continues exactly like the first
    model2, _, _ = models.tutorial_transformer(NTOK, dropout=0.0, seed=123)
    trainer2 = ortrain.ORTTrainer(model2, DESC, optim.AdamConfig(lr=1e-3), loss_fn=loss_fn,
                                  options={"utils": {"frozen_weights": [frozen]}})
    trainer2.load_state_dict(state)
    for x, y in data[2:]:
        a = trainer.train_step(x, y)[0].item()
        b = trainer2.train_step(x, y)[0].item()
        assert a == pytest.approx(b, rel=1e-6)
    ev = trainer.eval_step(*data[0])
    assert ev[0].dim() == 0
    path = tmp_path / "trained.onnx"
    trainer.save_as_onnx(str(path))
    saved = onnx.load(str(path))
    onnx.checker.check_model(saved)
    init = {t.name: onnx.numpy_helper.to_array(t) for t in saved.graph.initializer}
    w = model.state_dict()["decoder.weight"].numpy()
    assert any(v.shape == w.shape and (v == w).all() for v in init.values())


def test_transformer_layer_recompute_trains_bit_for_bit_in_less_memory():
    """options['graph_transformer']['transformer_layer_recompute']: each TransformerEncoderLayer
    recomputed in the backward pass (as under torch.utils.checkpoint); with dropout on, the same
    masks and kernels: the same losses and weights bit for bit, a smaller planned arena;
    number_recompute_layers takes the first N."""
    def train(graph_transformer):
        torch.manual_seed(3)
        model, _, _ = models.tutorial_transformer(NTOK, dropout=0.2)
        torch.manual_seed(4)
        trainer = ortrain.ORTTrainer(model, DESC, optim.AdamConfig(lr=1e-3), loss_fn=loss_fn,
                                     options={"graph_transformer": graph_transformer})
        losses = [trainer.train_step(x, y)[0].item() for x, y in _data(3)]
        return trainer, losses

    plain, plain_losses = train({})
    every, every_losses = train({"transformer_layer_recompute": True})
    first, first_losses = train({"transformer_layer_recompute": True, "number_recompute_layers": 1})
    assert every_losses == plain_losses == first_losses
    for (name, p), q in zip(every.model.named_parameters(), plain.model.parameters()):
        assert torch.equal(p, q), name
    peak = {}
    for label, t in (("plain", plain), ("every", every), ("first", first)):
        text = t.summary()
        peak[label] = float(text.split("peak arena ")[1].split(" MiB")[0])
        assert ("layer(s) recomputed" in text) == (label != "plain"), text
    assert "2 layer(s) recomputed in the backward pass" in every.summary()
    assert "1 layer(s) recomputed in the backward pass" in first.summary()
    assert peak["every"] < peak["first"] < peak["plain"], peak
    no_layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.raises(ValueError, match="transformer_layer_recompute.*Sequential has no layers to recompute"):
        ortrain.ORTTrainer(no_layers, {"inputs": [("x", [2, 4]), ("y", [2])], "outputs": [("loss", [], True)]},
                           optim.SGDConfig(), loss_fn=lambda o, y: o.sum(),
                           options={"graph_transformer": {"transformer_layer_recompute": True}})
    with pytest.raises(UnsupportedError, match="gelu_recompute.*not supported yet"):
        train({"gelu_recompute": True})
