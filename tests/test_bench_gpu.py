"""`python -m bench.gpu`'s run control, on any machine: pass variants named in --systems, a
worker that does not answer in time, and the JSON file written row by row. (Its numbers need a
GPU: scripts/gpu_session.sh runs it there.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.gpu import pass_environment, split_system

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "bench.gpu", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_ortrain_systems_name_their_passes():
    assert split_system("ortrain+fuse_attention+autocast") == ("ortrain", ["fuse_attention", "autocast"])
    assert split_system("ortrain-nographs") == ("ortrain-nographs", [])
    assert pass_environment(["fuse_attention", "autocast", "no_recompute"]) == {
        "ORTRAIN_ENABLE_PASSES": "fuse_attention,autocast", "ORTRAIN_DISABLE_PASSES": "recompute"}
    assert pass_environment(["fuse_attention", "autocast", "no_flash_attention"]) == {
        "ORTRAIN_ENABLE_PASSES": "fuse_attention,autocast", "ORTRAIN_DISABLE_PASSES": "",
        "ORTRAIN_FLASH_ATTENTION": "0"}
    assert pass_environment(["fuse_attention", "flash_rows64"]) == {
        "ORTRAIN_ENABLE_PASSES": "fuse_attention", "ORTRAIN_DISABLE_PASSES": "", "ORTRAIN_FLASH_ROWS": "64"}


def test_unknown_systems_are_refused_by_name():
    proc = _bench("--systems", "eager,compile+autocast,ortrain+fuse_attention")
    assert proc.returncode == 2
    assert "--systems: compile+autocast not among" in proc.stderr
    assert "ortrain+fuse_attention" not in proc.stderr.split("not among")[0]


def test_workers_past_their_timeout_are_failed_rows_and_the_run_goes_on(tmp_path):
    """Half a second is less than a worker needs to import torch: each row's worker is killed,
    its row reads failed with the reason, and the next row still runs; both rows are in the
    table and in the JSON file."""
    out = tmp_path / "gpu.json"
    proc = _bench("--workloads", "tutorial", "--systems", "eager,ortrain+fuse_attention", "--steps", "1",
                  "--warmup", "1", "--worker-timeout", "0.5", "--json", str(out))
    print(proc.stdout, proc.stderr[-3000:], sep="\n")
    assert proc.returncode == 1
    rows = json.loads(out.read_text())["tutorial"]
    assert set(rows) == {"eager", "ortrain+fuse_attention"}
    for name, row in rows.items():
        assert row["status"] == "failed", (name, row)
        assert row["error"].startswith("no answer in 0 s (--worker-timeout)"), row
    assert "ortrain+fuse_attention failed" in proc.stdout
