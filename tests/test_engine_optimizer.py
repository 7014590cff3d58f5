"""The engine's Adam/AdamW step (ortrain/engine/optimizer.py): a parameter's first step creates
its moments uninitialised and the engine writes them as if they were zeros, bitwise the same as a
step from zeroed moments, whatever the memory held (NaN here); and it follows torch.optim."""
import copy

import pytest
import torch

import ortrain
from ortrain.engine import optimizer as engine_optimizer


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _step(model, opt, x):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam-l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam-maximize": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), maximize=True),
}


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_first_step_from_uninitialised_moments_is_bitwise_the_zero_start(kind, monkeypatch):
    x = torch.randn(5, 8)
    fresh_model = _model()
    zero_model = copy.deepcopy(fresh_model)
    eager_model = copy.deepcopy(fresh_model)
    fresh_opt = OPTIMIZERS[kind](fresh_model.parameters())
    zero_opt = OPTIMIZERS[kind](zero_model.parameters())
    eager_opt = OPTIMIZERS[kind](eager_model.parameters())
    ortrain.accelerate(fresh_model, fresh_opt)
    ortrain.accelerate(zero_model, zero_opt)
    # the zero start: moments already there (as after a state_dict load), so not created fresh
    for p in zero_model.parameters():
        zero_opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                             "exp_avg_sq": torch.zeros_like(p)}
    # fresh moments: whatever memory holds, here NaN, must not be read
    monkeypatch.setattr(engine_optimizer.torch, "empty_like",
                        lambda t, **kw: torch.full_like(t, float("nan"), **kw))
    for _ in range(2):
        _step(fresh_model, fresh_opt, x)
        _step(zero_model, zero_opt, x)
        _step(eager_model, eager_opt, x)
    for (name, a), b, c in zip(fresh_model.named_parameters(), zero_model.parameters(), eager_model.parameters()):
        assert torch.equal(a, b), name
        assert torch.allclose(a, c, rtol=1e-5, atol=1e-6), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(fresh_opt.state[a][key], zero_opt.state[b][key]), (name, key)
            assert not fresh_opt.state[a][key].isnan().any(), (name, key)
        assert float(fresh_opt.state[a]["step"]) == 2.0


def test_failed_first_step_leaves_zeroed_moments(monkeypatch):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ortrain.accelerate(model, opt)
    monkeypatch.setattr(engine_optimizer.torch, "empty_like",
                        lambda t, **kw: torch.full_like(t, float("nan"), **kw))

    def fail(*args, **kwargs):
        raise RuntimeError("engine step interrupted")

    monkeypatch.setattr(engine_optimizer._ortrain, "adam_step", fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        _step(model, opt, torch.randn(5, 8))
    moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and all(torch.count_nonzero(m) == 0 for m in moments)


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_one_pass_over_groups_follows_torch(kind):
    """All tensors of all groups are updated in one engine pass (chunks of every tensor together):
    per-group hyper-parameters, per-tensor step counts (a parameter without a gradient in some
    steps), odd sizes across several chunks; each step follows torch.optim on the same gradients."""
    torch.manual_seed(1)
    shapes = [(3,), (70001,), (17, 33), (40000,), (1,)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW

    def groups(ps):
        return [{"params": ps[:2], "lr": 1e-2, "weight_decay": 0.05},
                {"params": ps[2:4], "lr": 3e-3, "betas": (0.8, 0.95), "maximize": True},
                {"params": ps[4:], "lr": 1e-3, "betas": (0.3, 0.9)}]  # lerp weight 0.7: from the gradient

    opt, opt_ref = cls(groups(ours), eps=1e-6), cls(groups(ref))
    for g in opt_ref.param_groups:
        g["eps"] = 1e-6
    assert engine_optimizer.accelerate_optimizer(opt)
    for step in range(4):
        grads = [torch.randn(s) * 10 ** (-step) for s in shapes]
        for i, (p, q, g) in enumerate(zip(ours, ref, grads)):
            skip = i == 3 and step == 1  # no gradient this step: its step count falls behind
            p.grad = None if skip else g.clone()
            q.grad = None if skip else g.clone()
        opt.step()
        opt_ref.step()
        # the moments are bitwise torch's where torch runs its vectorised kernels (fused
        # multiply-adds in lerp_/addcmul_/add, the scalars from f64 hyper-parameters); the
        # parameters differ only where torch's vectorised sqrt is one ulp off (a last-bit change
        # of the update), and from then on Adam's L2 term (weight_decay * param) carries that
        # into the moments of group 0; a wrong group, step count or scalar is far outside either
        vectorised = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
        for i, (p, q) in enumerate(zip(ours, ref)):
            exact = vectorised and (step == 0 or i >= 2 or kind == "adamw")
            assert torch.allclose(p, q, rtol=2.4e-7, atol=1e-8), (step, i, (p - q).abs().max(), int((p != q).sum()))
            for key, atol in (("exp_avg", 1e-7), ("exp_avg_sq", 1e-10)):
                a, b = opt.state[p][key], opt_ref.state[q][key]
                if exact:
                    assert torch.equal(a, b), (step, i, key, int((a != b).sum()), (a - b).abs().max())
                else:
                    assert torch.allclose(a, b, rtol=1e-5, atol=atol), (step, i, key, (a - b).abs().max())
            assert float(opt.state[p]["step"]) == float(opt_ref.state[q]["step"])


@pytest.mark.parametrize("option", ["amsgrad"])
def test_adam_options_the_engine_lacks_keep_the_step_in_pytorch(option):
    """Adam(amsgrad=True) has a state the engine lacks (and capturable, and fused over GPU
    parameters, are torch's own kernels with their step counts on the device). accelerate() says
    so by the option's name, and the step stays torch's: the result equals plain PyTorch's."""
    x = torch.randn(4, 8)
    model, ref = _model(), _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **{option: True})
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, **{option: True})
    with pytest.warns(UserWarning, match=rf"Adam\({option}=True\) is not supported by the engine; step\(\) stays in PyTorch"):
        ortrain.accelerate(model, opt)
    assert not model.__dict__["_ortrain_state"].optimizer_in_engine
    for _ in range(3):
        _step(model, opt, x)
        _step(ref, ref_opt, x)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_group_added_later_with_amsgrad_is_stepped_by_pytorch():
    """A parameter group added after accelerate() with an option only PyTorch has (amsgrad) is
    updated by PyTorch's step with that option, not silently as plain Adam: the model ends
    where a plain PyTorch optimizer with the same two groups takes it."""
    x = torch.randn(4, 8)
    model, ref = _model(), _model()
    opt = torch.optim.Adam(model[0].parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref[0].parameters(), lr=1e-2)
    ortrain.accelerate(model, opt)
    assert model.__dict__["_ortrain_state"].optimizer_in_engine
    opt.add_param_group({"params": list(model[2].parameters()), "amsgrad": True, "lr": 5e-2})
    ref_opt.add_param_group({"params": list(ref[2].parameters()), "amsgrad": True, "lr": 5e-2})
    for _ in range(4):
        _step(model, opt, x)
        _step(ref, ref_opt, x)
    for p, q in zip(model[2].parameters(), ref[2].parameters()):
        assert "max_exp_avg_sq" in opt.state[p]
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["max_exp_avg_sq"], ref_opt.state[q]["max_exp_avg_sq"], rtol=1e-5, atol=1e-9)


def test_loaded_state_the_engine_cannot_address_goes_to_pytorchs_step():
    """Optimizer state from load_state_dict (or edited) that is not what the engine writes
    through addresses (here non-contiguous moments, a moment of the wrong shape) goes to
    PyTorch's own step, never to the engine's kernels: non-contiguous moments step as in plain
    PyTorch, and a wrong shape is PyTorch's own error, not a crash."""
    x = torch.randn(4, 8)
    model, ref = _model(), _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    ortrain.accelerate(model, opt)
    for o, m in ((opt, model), (ref_opt, ref)):
        w = m[0].weight
        o.state[w] = {"step": torch.tensor(3.0), "exp_avg": torch.full(w.shape[::-1], 0.01).t(),
                      "exp_avg_sq": torch.full(w.shape[::-1], 1e-4).t()}
    assert not opt.state[model[0].weight]["exp_avg"].is_contiguous()
    for _ in range(2):
        _step(model, opt, x)
        _step(ref, ref_opt, x)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[model[0].weight]["exp_avg"], ref_opt.state[ref[0].weight]["exp_avg"])
    b = model[2].bias
    opt.state[b]["exp_avg"] = torch.zeros(b.numel() + 5)
    with pytest.raises(RuntimeError):
        _step(model, opt, x)


def test_the_steps_plan_follows_torch_through_what_changes_between_steps(monkeypatch):
    """After a step that updated every parameter of a group, later steps take the group's plan
    (engine/adam_plan.py: no per-parameter checks, one add counts the steps) while it holds, and
    the general path wherever something it recorded changed: a new learning rate (read every
    step), a parameter without a gradient, the state loaded or a moment replaced. Each step
    follows torch.optim on the same gradients; the step counts stay float32 CPU tensors."""
    x = torch.randn(6, 8)
    model, ref = _model(), _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ortrain.accelerate(model, opt)
    general = []
    real = engine_optimizer._adam_group
    monkeypatch.setattr(engine_optimizer, "_adam_group", lambda *a: general.append(step) or real(*a))
    for step in range(9):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            if step == 3:
                o.param_groups[0]["lr"] = 3e-3
            if step == 4:
                m[2].bias.grad = None  # no gradient this step: its step count falls behind
            if step == 6:
                o.load_state_dict(copy.deepcopy(o.state_dict()))
            if step == 7:
                w = m[0].weight
                o.state[w]["exp_avg"] = o.state[w]["exp_avg"].clone()
        opt.step()
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            assert opt.state[p]["step"].dtype == torch.float32 and opt.state[p]["step"].device.type == "cpu"
            assert float(opt.state[p]["step"]) == float(ref_opt.state[q]["step"]), step
    # the general path: the first step, the step without a gradient and the one after it (a new
    # plan), the loaded state, the replaced moment
    assert general == [0, 4, 5, 6, 7], general
    for p, q in zip(model.parameters(), ref.parameters()):
        for key, atol in (("exp_avg", 1e-7), ("exp_avg_sq", 1e-9)):
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[q][key], rtol=1e-5, atol=atol)


@pytest.mark.parametrize("schedule", ["StepLR", "LambdaLR"])
def test_a_scheduler_made_before_accelerate_keeps_the_step_in_the_engine(schedule):
    """torch's LR schedulers wrap `opt.step` on the instance around the class's step of then:
    accelerating the optimizer after making its scheduler (the usual order) left every step in
    PyTorch. The engine steps, the scheduler's learning rates apply, the weights are torch's,
    and after deaccelerate PyTorch steps again."""
    x = torch.randn(5, 8)
    models, opts, scheds = [], [], []
    for _ in range(2):
        m = _model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        sched = (torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if schedule == "StepLR"
                 else torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)))
        models.append(m), opts.append(opt), scheds.append(sched)
    ortrain.accelerate(models[0], opts[0])
    n = len(list(models[0].parameters()))
    for _ in range(3):
        for m, opt, sched in zip(models, opts, scheds):
            _step(m, opt, x)
            sched.step()
    assert opts[0].__dict__.get("_ortrain_last_step") == (n, n)  # the engine's step ran
    assert opts[0].param_groups[0]["lr"] == opts[1].param_groups[0]["lr"] < 1e-2
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name
    ortrain.deaccelerate(models[0])
    del opts[0].__dict__["_ortrain_last_step"]
    _step(models[0], opts[0], x)
    assert "_ortrain_last_step" not in opts[0].__dict__  # PyTorch's step again


def test_an_optimizer_made_after_accelerate_is_taken_at_its_first_step():
    """accelerate(model) with no optimizer, then an AdamW and its scheduler made later (as
    Hugging Face's Trainer makes them inside train()): its first step runs in PyTorch, the later
    ones in the engine; the weights are those of the same loop in PyTorch. An optimizer of
    another model is left alone."""
    x = torch.randn(5, 8)
    model, ref, other = _model(), _model(), _model()
    ortrain.accelerate(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, ref, other)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in opts]
    for _ in range(3):
        for m, opt, sched in zip((model, ref, other), opts, scheds):
            _step(m, opt, x)
            sched.step()
    n = len(list(model.parameters()))
    assert opts[0].__dict__.get("_ortrain_last_step") == (n, n)  # the engine's step ran
    assert type(opts[2]) is torch.optim.AdamW and "_ortrain_last_step" not in opts[2].__dict__
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name
    head = ortrain.explain(model).splitlines()[0]
    assert "optimizer in the engine (AdamW made after accelerate(): its first step ran in PyTorch" in head, head


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_fused_adam_over_cpu_parameters_is_stepped_by_the_engine(kind):
    """fused=True over CPU parameters (Hugging Face's Trainer makes AdamW(fused=True)) is only
    torch's kernel choice for the same update, its step counts on the CPU: the engine steps it,
    and the weights and moments are those of torch's fused step."""
    x = torch.randn(4, 8)
    model, ref = _model(), _model()
    opt = getattr(torch.optim, kind)(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    ref_opt = getattr(torch.optim, kind)(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    ortrain.accelerate(model, opt, strict=True)
    assert model.__dict__["_ortrain_state"].optimizer_in_engine
    for _ in range(3):
        _step(model, opt, x)
        _step(ref, ref_opt, x)
    n = len(list(model.parameters()))
    assert opt.__dict__.get("_ortrain_last_step") == (n, n)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"], rtol=1e-5, atol=1e-9)
        assert float(opt.state[p]["step"]) == float(ref_opt.state[q]["step"]) == 3.0
