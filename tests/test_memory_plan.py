"""The memory plan's peak, printed by explain() before the first step, is what the executor
really allocates; the arena is reused across steps (no allocation per step)."""
import copy
import re

import torch

import models
import ortrain
from ortrain.engine.tensors import triple


def test_planned_peak_is_what_the_executor_allocates():
    model, (x,), _ = models.tutorial_transformer(1000, dropout=0.0)
    ortrain.accelerate(model)
    model(x).sum().backward()
    runner = next(iter(model._ortrain_state.runners.values()))
    info = runner.plan_info([x], True)
    planned = info["arena_bytes"]
    pending = runner.session.forward([triple(x, "src")], runner.weight_addresses(), True, 0)
    # the arena is the planned bytes plus alignment slack (one cache line and a word)
    assert planned <= pending.arena_capacity <= planned + 64 + 16
    assert pending.arena_bytes == planned
    pending.release()
    text = ortrain.explain(model)
    mib = float(re.search(r"peak arena ([0-9.]+) MiB", text).group(1))
    assert abs(mib - planned / 2**20) < 0.06
    # each step's inputs by name (tools follow values from producer to readers): one name per
    # input, and a value a step computes is read only after it
    names, inputs = info["step_input_names"], info["step_inputs"]
    assert [len(n) for n in names] == [len(ins) for ins, _ in inputs]
    made_at = {out[0]: i for i, (_, _, outs) in enumerate(info["steps"]) for out in outs}
    for i, step_names in enumerate(names):
        assert all(made_at.get(n, -1) < i for n in step_names if n), (info["steps"][i], step_names)


def test_arena_is_reused_between_steps():
    model, (x,), _ = models.tutorial_transformer(1000, dropout=0.0)
    ortrain.accelerate(model)
    runner = None
    addrs = set()
    for _ in range(3):
        model(x).sum().backward()
        runner = runner or next(iter(model._ortrain_state.runners.values()))
        p = runner.session.forward([triple(x, "src")], runner.weight_addresses(), True, 0)
        addrs.add(p.output(0)[0])
        p.release()
    assert len(addrs) == 1


_TRAIN_AND_MEASURE = r"""
import re, sys
import torch, torch._dynamo  # noqa: F401 (imported before the baseline, as any torch.optim user has it)
import torch.nn.functional as F
import models, ortrain

def status_mib(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) / 1024 for l in f if l.startswith(field + ":"))

def rss_mib():
    return status_mib("VmRSS")

torch.set_num_threads(2)
base = rss_mib()
model, (x,), _ = models.tutorial_transformer(28782, dropout=0.2)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
ortrain.accelerate(model, opt)
text = ortrain.explain(model, x)
line = next(l for l in text.splitlines() if "training memory" in l)
planned = float(re.search(r"= ([0-9.]+) MiB", line).group(1))
g = torch.Generator().manual_seed(1)
for _ in range(4):
    y = torch.randint(0, 28782, (x.numel(),), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x).view(-1, 28782), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
# VmHWM, not ru_maxrss: ru_maxrss keeps the peak of the forking process (pytest's, GBs by then)
grown = status_mib("VmHWM") - base
print(planned, grown)
print(line)
"""


def test_training_memory_printed_before_the_first_step_matches_measured_growth():
    """Issue 5: the memory estimate explain() prints before step 1 is within 10% of the process's
    measured peak growth (VmHWM minus the resident size before the model was built) over
    the first steps, on the full-size tutorial model with Adam and the loss fused. A fresh
    process, so that nothing earlier in the session shares the numbers."""
    import os
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        import pytest
        pytest.skip("RSS from /proc (Linux)")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", _TRAIN_AND_MEASURE], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, line = proc.stdout.strip().splitlines()[-2:]
    planned, grown = (float(v) for v in first.split())
    assert "optimizer state" in line and "peak arena" in line and "export and engine build" in line, line
    assert abs(planned - grown) <= 0.1 * grown, f"planned {planned:.0f} MiB, measured {grown:.0f} MiB: {line}"


def test_fused_lm_head_gradients_are_written_into_the_gradient_tensors():
    """The fused LM head + loss makes dW and db in the forward pass: with the gradient tensors
    bound from the forward pass on (what the CPU runner does), they are written straight there
    and take no arena space; the plan explain() prints is that one."""
    import torch.nn.functional as F

    from ortrain.engine.tensors import engine_dtype

    model, (x,), _ = models.tutorial_transformer(1000, dropout=0.0)
    ortrain.accelerate(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    y = torch.randint(0, 1000, (x.numel(),), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(model(x).view(-1, 1000), y).backward()
    runner = next(iter(model._ortrain_state.loss_runners.values()))
    assert runner.grads_at_forward
    sigs = [(engine_dtype(t, n), list(t.shape)) for t, n in zip([x, y], runner.input_names)]
    early = runner.session.plan_info(sigs, True, True)["arena_bytes"]
    plain = runner.session.plan_info(sigs, True, False)["arena_bytes"]
    assert early < plain, (early, plain)  # (on the full tutorial: 41.6 vs 63.7 MiB)
    assert runner.plan_info([x, y], True)["arena_bytes"] == early
    text = ortrain.explain(model)
    assert f"peak arena {early / 2**20:.1f} MiB" in text, text


def test_gpt2_split_heads_and_full_slices_copy_no_more_than_needed():
    """GPT-2's q/k/v split (torch.split under the dynamo exporter: SplitToSequence) runs as one
    Split whose gradient is one Concat, not three zero-padded slice gradients and their sums;
    HF's `hidden_states[:, slice(0, None)]` shares its input's memory, forward and backward.
    Training still follows eager."""
    torch.manual_seed(0)
    model, (ids,), _ = models.gpt2_small(vocab=200, dropout=0.0)
    reference = copy.deepcopy(model)
    ortrain.accelerate(model, strict=True)

    def lm_loss(m):
        logits = m(ids).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 200), ids[:, 1:].reshape(-1))

    loss = lm_loss(model)
    loss.backward()
    want = lm_loss(reference)
    want.backward()
    assert abs(loss.item() - want.item()) < 1e-5
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), name
    (runner,) = model._ortrain_state.loss_runners.values()
    info = runner.session.plan_info([("int64", list(ids.shape)), ("int64", [ids.numel() - ids.shape[0]])], True)
    ops = [op for op, _, _ in info["steps"]]
    assert len(ops) == info["forward_steps"] + info["backward_steps"]
    layers = model.config.n_layer
    assert (ops.count("Split"), ops.count("Concat")) == (layers, layers), dict(info["ops"])
    # left: the shifted loss's own slice (logits[:, :-1], moved before the LM head) and its gradient
    assert (ops.count("Slice"), ops.count("SliceGrad")) == (1, 1), dict(info["ops"])
