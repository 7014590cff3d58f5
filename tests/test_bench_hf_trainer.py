"""bench.hf_trainer (Hugging Face's Trainer side by side, each system in its own process) runs
end to end on the CPU: both rows, ortrain's ratio against eager, the engine stepping the
Trainer's own AdamW, the JSON with the per-step times. Checks the output only, never the
timings (torch.compile's row is left out: compiling takes 30-50 s)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("accelerate", reason="Hugging Face's Trainer needs the accelerate package (requirements.txt)")


def test_trainer_bench_prints_both_systems_and_writes_raw_times(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    out = tmp_path / "trainer.json"
    proc = subprocess.run([sys.executable, "-m", "bench.hf_trainer", "--steps", "2", "--warmup", "1",
                           "--systems", "eager,ortrain", "--json", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("== Hugging Face Trainer: GPT2LMHeadModel")
    eager = next(ln for ln in lines if ln.startswith("eager "))
    ours = next(ln for ln in lines if ln.startswith("ortrain "))
    assert re.match(r"eager\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+1\.00\s+-", eager), eager
    assert re.match(r"ortrain\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+\.\d\d\s+-", ours), ours
    assert "optimizer in the engine (AdamW made after accelerate()" in proc.stdout
    raw = json.loads(out.read_text())
    for system in ("eager", "ortrain"):
        assert len(raw[system]["step_ms"]) == 2 and len(raw[system]["losses"]) == 3, system
    # the same data and initial weights: the first step's losses agree (dropout aside)
    assert abs(raw["eager"]["losses"][0] - raw["ortrain"]["losses"][0]) < 0.1 * raw["eager"]["losses"][0]
