"""The dynamic loss scaler (`accelerate(..., loss_scale="dynamic")`, on by default with
precision="fp16"): ONNX Runtime's rules (start 2^16, halve and skip the step on an inf/NaN
gradient, double after 2000 finite steps), training that matches the unscaled run exactly (the
scale is a power of two), an overflow that skips the optimizer step and leaves the parameters as
they were, and the options' errors. The scaler itself is device-agnostic, so these run on the
CPU; fp16 itself is CUDA-only (tests/test_cuda_mixed_precision.py)."""
import copy

import pytest
import torch
from torch import nn

import models
import ortrain
from ortrain.engine.loss_scale import DynamicLossScaler

NTOK = 200


def _model():
    model, (data,), _ = models.tutorial_transformer(NTOK, emsize=32, nhid=32, nlayers=1, nhead=2, seq=12, batch=4)
    return model, data


def _train(model, opt, data, steps, clip=True):
    """The tutorial's loop (the loss fused into the engine); the losses."""
    g = torch.Generator().manual_seed(3)
    targets = [torch.randint(0, NTOK, (data.numel(),), generator=g) for _ in range(steps)]
    losses = []
    for t in targets:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(data).view(-1, NTOK), t)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append(loss.item())
    return losses


def test_scaler_rules_follow_onnx_runtime():
    s = DynamicLossScaler("cpu")
    assert s.state()["scale"] == 2.0**16
    ran = []
    s.found_inf.fill_(1.0)
    assert s.step(lambda: ran.append(1)) is None and not ran  # skipped
    assert s.state() == {"scale": 2.0**15, "steps": 1, "skipped_steps": 1, "growth_interval": 2000}
    for _ in range(1999):
        s.step(lambda: ran.append(1))
    assert len(ran) == 1999 and s.state()["scale"] == 2.0**15
    s.step(lambda: ran.append(1))
    assert s.state()["scale"] == 2.0**16  # doubled after 2000 finite steps in a row
    # unscale_ divides in place and notes non-finite values
    g = [torch.full((3,), 2.0**16), torch.tensor([1.0, float("inf")])]
    s.unscale_(g)
    assert g[0].tolist() == [1.0, 1.0, 1.0] and s.found_inf.item() == 1.0


def test_a_float16_seed_is_scaled_in_float32():
    """2^16, the starting scale, is inf in float16: a float16 engine output's seed is scaled in
    float32 and then rounded, so a small gradient stays finite (GradScaler keeps its scale in f32)."""
    s = DynamicLossScaler("cpu")
    g = torch.tensor([1e-3, -2e-4, 0.0], dtype=torch.float16)
    scaled = s.scale_seed(g)
    assert scaled.dtype == torch.float16
    assert torch.isfinite(scaled).all(), scaled
    assert torch.equal(scaled, (g.float() * 65536.0).half())
    assert s.scale_seed(torch.tensor([1e-3])).item() == pytest.approx(1e-3 * 65536.0)


@pytest.mark.parametrize("fuse_loss", [True, False], ids=["fused_loss", "unfused"])
def test_scaled_training_matches_unscaled_training_exactly(fuse_loss):
    base, data = _model()
    scaled = copy.deepcopy(base)
    opt_b = torch.optim.Adam(base.parameters(), lr=1e-3)
    opt_s = torch.optim.Adam(scaled.parameters(), lr=1e-3)
    ortrain.accelerate(base, opt_b, strict=True, fuse_loss=fuse_loss)
    ortrain.accelerate(scaled, opt_s, strict=True, fuse_loss=fuse_loss, loss_scale="dynamic")
    want = _train(base, opt_b, data, 5)
    got = _train(scaled, opt_s, data, 5)
    assert got == want
    for (name, p), q in zip(scaled.named_parameters(), base.parameters()):
        assert torch.equal(p, q), name
    assert ortrain.loss_scale(scaled) == {"scale": 2.0**16, "steps": 5, "skipped_steps": 0, "growth_interval": 2000}
    assert ortrain.loss_scale(base) is None
    assert "dynamic loss scale 65536: 0 of 5 optimizer steps skipped" in ortrain.explain(scaled)


def test_an_overflow_skips_the_step_and_halves_the_scale():
    model, data = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ortrain.accelerate(model, opt, strict=True, loss_scale="dynamic")
    _train(model, opt, data, 1)
    scaler = model.__dict__["_ortrain_state"].loss_scaler
    scaler.scale.fill_(float("inf"))  # every scaled gradient overflows
    before = [p.detach().clone() for p in model.parameters()]
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    _train(model, opt, data, 1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), "a parameter moved"
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(opt.state.values(), moments)), "a moment moved"
    assert ortrain.loss_scale(model)["skipped_steps"] == 1 and ortrain.loss_scale(model)["steps"] == 2
    scaler.scale.fill_(2.0**10)
    _train(model, opt, data, 1)  # finite again: the step runs
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert ortrain.loss_scale(model)["skipped_steps"] == 1


def test_gradient_accumulation_sees_each_backward_unscaled():
    base, data = _model()
    scaled = copy.deepcopy(base)
    opt_b = torch.optim.SGD(base.parameters(), lr=0.1)
    opt_s = torch.optim.SGD(scaled.parameters(), lr=0.1)
    ortrain.accelerate(base, opt_b, strict=True)
    ortrain.accelerate(scaled, opt_s, strict=True, loss_scale="dynamic")
    t = torch.randint(0, NTOK, (data.numel(),), generator=torch.Generator().manual_seed(9))
    for m in (base, scaled):
        for _ in range(2):  # two backward passes into the same .grad
            nn.functional.cross_entropy(m(data).view(-1, NTOK), t).backward()
    for (name, p), q in zip(scaled.named_parameters(), base.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_options_are_checked_before_anything_changes():
    model, _ = _model()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match="precision='fp16' needs device='cuda'.*use precision='bf16'"):
        ortrain.accelerate(model, opt, precision="fp16")
    with pytest.raises(ValueError, match="loss_scale='always' is not one of 'dynamic', False, None"):
        ortrain.accelerate(model, opt, loss_scale="always")
    with pytest.raises(ValueError, match="needs the optimizer"):
        ortrain.accelerate(model, loss_scale="dynamic")
    assert not ortrain.is_accelerated(model)
    with pytest.raises(ValueError, match="matmul_precision='fp16' needs device='cuda'"):
        ortrain._ortrain.Session(b"", [], [], matmul_precision="fp16")


def test_deaccelerate_and_turning_it_off_restore_the_optimizers_step():
    model, data = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    plain_step = type(opt).step
    ortrain.accelerate(model, opt, loss_scale="dynamic")
    assert "step" in opt.__dict__
    ortrain.accelerate(model, loss_scale=False)
    assert "step" not in opt.__dict__ and ortrain.loss_scale(model) is None
    _train(model, opt, data, 1)
    ortrain.accelerate(model, opt, loss_scale="dynamic")
    ortrain.deaccelerate(model)
    assert "step" not in opt.__dict__ and type(opt).step is plain_step


def test_the_per_batch_metrics_carry_the_loss_scale():
    """The metrics %%ort logs to MLflow per batch include the scale (halved after a skipped step)."""
    from ortrain._steps import StepRecorder, step_metrics

    model, data = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ortrain.accelerate(model, opt, strict=True, loss_scale="dynamic")
    seen = []
    with StepRecorder([model], lambda s: seen.append(step_metrics(s)), optimizers=[opt]):
        _train(model, opt, data, 2)
        model.__dict__["_ortrain_state"].loss_scaler.scale.fill_(float("inf"))
        _train(model, opt, data, 1)  # overflows: skipped, still one batch
    assert [m.get("loss_scale") for m in seen[:2]] == [2.0**16, 2.0**16]
    assert len(seen) == 3 and "loss" in seen[2]
    plain, _ = _model()
    opt2 = torch.optim.Adam(plain.parameters(), lr=1e-3)
    ortrain.accelerate(plain, opt2, strict=True)
    seen.clear()
    with StepRecorder([plain], lambda s: seen.append(step_metrics(s)), optimizers=[opt2]):
        _train(plain, opt2, data, 1)
    assert "loss_scale" not in seen[0]
