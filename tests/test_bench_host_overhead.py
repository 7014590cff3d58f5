"""bench.host_overhead (the step's host time phase by phase, eager and ortrain in one process)
runs end to end on the CPU and prints both rows, ortrain's ratios and (--profile) ortrain's
step by function. Checks the output only, never the timings."""
from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_host_overhead_prints_every_phase_for_both_systems():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "bench.host_overhead", "--steps", "6", "--warmup", "2", "--profile", "3"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = next(ln for ln in lines if ln.startswith("system"))
    assert header.split()[1:] == ["zero_grad", "model", "loss", "backward", "clip", "step", "host", "wall"]
    number = r"\s+\d+\.\d{3}"
    for system in ("eager", "ortrain"):
        row = next(ln for ln in lines if ln.startswith(system + " "))
        assert re.fullmatch(rf"{system}\s*(?:{number}){{8}}", row), row
    ratios = next(ln for ln in lines if ln.startswith("eager/ort"))
    assert len(re.findall(r"\d+\.\d\dx", ratios)) == 8, ratios
    # --profile: the functions with the most own time, the engine's forward pass among them
    start = lines.index(next(ln for ln in lines if ln.startswith("ortrain's step under cProfile (3 steps)")))
    profiled = lines[start + 2:]
    assert len(profiled) == 25 and all(re.fullmatch(r"\s*\d+\.\d\s+\d+\.\d  \S.*", ln) for ln in profiled), profiled
    assert any("'forward' of 'ortrain._ortrain.Session'" in ln for ln in profiled), profiled
