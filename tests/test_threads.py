"""The engine's workers: pinned one per core when ORTRAIN_PIN_THREADS says so (default `auto`:
when the pool takes every core the process may use), reported by `explain`, and a bad value of
the variable is an error that names it. Each case runs in its own process (the pool is built
once per process)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import os, sys, torch
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import models, ortrain
from ortrain import _ortrain
torch.set_num_threads(2)
model, args, _ = models.tutorial_transformer(50, dropout=0.0)
ortrain.accelerate(model, torch.optim.SGD(model.parameters(), lr=0.1))
model(*args).sum().backward()
print("PINNED", _ortrain.pinned_cores())
threads = {}
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/status") as f:
        threads[tid] = [l.split(":")[1].strip() for l in f if l.startswith("Cpus_allowed_list")][0]
print("AFFINITIES", sorted(threads.values()))
print(ortrain.explain(model))
"""


def _run(pin: str | None, cores: list[int]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ORTRAIN_PIN_THREADS", "RAYON_NUM_THREADS")}
    if pin is not None:
        env["ORTRAIN_PIN_THREADS"] = pin
    return subprocess.run(["taskset", "-c", ",".join(map(str, cores)), sys.executable, "-c", SCRIPT, REPO],
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def two_cores():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 usable cores")
    return cores[:2]


def test_workers_are_pinned_one_per_core_when_they_take_every_core(two_cores):
    proc = _run(None, two_cores)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"PINNED {two_cores}" in proc.stdout, proc.stdout
    # one thread pinned to each core (the workers); the others keep both
    affinities = eval(proc.stdout.split("AFFINITIES ")[1].splitlines()[0])
    for c in two_cores:
        assert str(c) in affinities, affinities
    assert f"2 engine threads, pinned to cores {two_cores[0]}, {two_cores[1]}" in proc.stdout, proc.stdout


def test_off_leaves_the_workers_floating(two_cores):
    proc = _run("off", two_cores)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PINNED []" in proc.stdout and "2 engine threads, not pinned" in proc.stdout, proc.stdout


def test_a_bad_value_is_an_error_naming_the_variable(two_cores):
    proc = _run("sometimes", two_cores)
    assert "ORTRAIN_PIN_THREADS" in proc.stdout + proc.stderr and "auto, on or off" in proc.stdout + proc.stderr, \
        proc.stdout[-2000:] + proc.stderr[-2000:]
