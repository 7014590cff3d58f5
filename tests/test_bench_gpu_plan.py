"""`python -m bench.gpu_plan`: the planned GPU memory of GPT-2's train step, computed without a
GPU (CUDA sessions are planned on any machine). On a 1-layer GPT-2 at 16 x 1024 (16368 loss
rows: two LM-head chunks on CUDA; a head of 64) the LM-head fusion and the attention fusion
each plan less memory than without them, and the table and JSON report all three variants."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_plan_reports_each_variant_without_a_gpu(tmp_path):
    out = tmp_path / "plan.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env.pop("ORTRAIN_ENABLE_PASSES", None)
    env.pop("ORTRAIN_DISABLE_PASSES", None)
    cmd = [sys.executable, "-m", "bench.gpu_plan", "--layers", "1", "--embd", "64", "--heads", "1", "--vocab", "500",
           "--batch", "16", "--seq", "1024", "--eager-peak-gib", "1.0", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout, proc.stderr[-3000:], sep="\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())["results"]
    default, plain, attention = r["default passes"], r["without the LM-head fusion"], r["with fuse_attention"]
    assert default["passes"].get("fuse_linear_cross_entropy") == 1 and "fuse_linear_cross_entropy" not in plain["passes"]
    assert attention["passes"].get("fuse_attention") == 1
    assert attention["arena"] < default["arena"] < plain["arena"], r
    for name in r:
        assert name in proc.stdout


def test_gpu_plan_of_the_tutorial_model(tmp_path):
    """`--workload tutorial` plans the tutorial model's fused loss graph ([seq, batch] ids, the
    targets flattened): the LM-head fusion plans less memory than without it."""
    out = tmp_path / "plan.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env.pop("ORTRAIN_ENABLE_PASSES", None)
    env.pop("ORTRAIN_DISABLE_PASSES", None)
    cmd = [sys.executable, "-m", "bench.gpu_plan", "--workload", "tutorial", "--vocab", "2000", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout, proc.stderr[-3000:], sep="\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["config"]["batch"] == 20 and data["config"]["seq"] == 35 and data["eager_peak_gib"] == 0.44
    r = data["results"]
    default, plain = r["default passes"], r["without the LM-head fusion"]
    assert default["passes"].get("fuse_linear_cross_entropy") == 1
    assert default["arena"] < plain["arena"], r
    assert "the tutorial model" in proc.stdout
