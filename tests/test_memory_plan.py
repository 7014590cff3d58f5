"""The memory plan's peak, printed by explain() before the first step, is what the executor
really allocates; the arena is reused across steps (no allocation per step)."""
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
