"""The side-by-side benchmark (`python -m bench --quick`, bench/) runs end to end: every workload on
every system (torch.compile on the tutorial only: --quick's default, compiling takes 20-70 s a
model), each in its own worker process, a table per workload printed and a JSON file with
per-step times. Checks the output only, never the timings: PyTorch eager and torch.compile never
fail, ortrain never fails (nor falls back to PyTorch) on the fp32 workloads."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the bench package


def test_quick_bench_prints_tables_and_writes_raw_times(tmp_path):
    from bench.workloads import WORKLOADS

    out_json = tmp_path / "bench.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--json", str(out_json)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1200)
    print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n")
    assert proc.returncode == 0, proc.stderr[-3000:]

    doc = json.loads(out_json.read_text())
    assert doc["config"]["quick"] is True
    assert doc["machine"]["cpu_model"] and "avx512f" in doc["machine"]["cpu_flags"]
    assert set(doc["workloads"]) == set(WORKLOADS)
    for name, w in WORKLOADS.items():
        assert f"== {name}: " in proc.stdout, f"no table for {name}"
        systems = doc["workloads"][name]["systems"]
        assert set(systems) == {"eager", "compile", "ortrain"}
        for system, r in systems.items():
            if system == "compile" and name not in doc["config"]["compile_workloads"]:
                assert r["status"] == "skipped" and "SKIPPED: " in proc.stdout, (name, r["status"])
            elif system in ("eager", "compile") or (system == "ortrain" and w.precision == "fp32"):
                assert r["status"] == "ok", f"{name}/{system}: {r['error']}\n{r['error_detail']}"
            if r["status"] != "ok":
                assert r["error"], f"{name}/{system}: {r['status']} without a reason"
                assert f"{r['status'].upper()}: " in proc.stdout
                continue
            steps = doc["config"]["steps"]
            assert len(r["step_ms"]) == steps and all(t > 0 for t in r["step_ms"]), (name, system)
            assert len(r["losses"]) == steps and r["first_step_ms"] > 0
            s = r["summary"]
            assert s["p10_ms"] <= s["median_ms"] <= s["p90_ms"]
            assert s["peak_rss_mib"] > s["rss_after_import_mib"] > 0
            assert s["speedup_vs_eager"] > 0
            assert s.get("speedup_vs_compile", 1) > 0
        # same data and initial weights: the first losses agree across systems (dropout aside)
        firsts = [r["warmup_losses"][0] for r in systems.values() if r["status"] == "ok"]
        assert max(firsts) - min(firsts) < 0.2 * max(firsts), (name, firsts)


class _Det(torch.nn.Module):
    """A model the engine cannot take (no Det kernel): ortrain.accelerate falls back to PyTorch."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        return torch.linalg.det(self.lin(x))


def test_ortrain_fallback_to_pytorch_is_a_failure_not_a_measurement():
    from bench import systems

    model = _Det()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared = systems.prepare("ortrain", model, opt, "fp32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        prepared.model(torch.randn(2, 3, 3)).sum().backward()
        with pytest.raises(systems.FellBack, match="fell back to PyTorch: .*Det"):
            prepared.check(caught)


def test_busy_core_pins_a_spinning_process_for_the_run_and_stops_it():
    import argparse
    import time

    from bench import busy_core

    core = sorted(os.sched_getaffinity(0))[-1]
    assert busy_core.parse(f"{core}:0.5") == (core, 0.5)
    for bad, says in ((f"{core}", "CORE:DUTY"), (f"{core}:x", "CORE:DUTY"), ("4096:0.5", "core 4096"),
                      (f"{core}:0", "(0, 1]"), (f"{core}:1.5", "(0, 1]")):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(says)):
            busy_core.parse(bad)
    with busy_core.busy(core, 0.5) as proc:
        deadline = time.time() + 20
        while os.sched_getaffinity(proc.pid) != {core} and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None and os.sched_getaffinity(proc.pid) == {core}
        used_before = _cpu_seconds(proc.pid)
        time.sleep(0.5)
        assert _cpu_seconds(proc.pid) - used_before > 0.1, "it spins"
    assert proc.poll() is not None, "stopped when the block ends"


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_ddp_bench_trains_each_system_on_two_ranks(tmp_path, wrap):
    """`python -m bench.ddp` (torchrun, two gloo ranks), under DistributedDataParallel and under
    FSDP2: eager and ortrain rows with a time and a loss each, ortrain without falling back
    (accelerate(strict=True) inside DDP), the raw times of every rank in the JSON. No timing is
    asserted."""
    out_json = tmp_path / "ddp.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "bench.ddp", "--steps", "2", "--warmup", "1", "--systems", "eager,ortrain",
                           "--wrap", wrap, "--json", str(out_json)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("FSDP2 (fully_shard)" if wrap == "fsdp" else "DistributedDataParallel"), proc.stdout
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.split()[:1] in (["eager"], ["ortrain"])}
    assert set(rows) == {"eager", "ortrain"}, proc.stdout
    for system, line in rows.items():
        assert "Error" not in line and re.search(r"\d+\.\d+x", line), line
    doc = json.loads(out_json.read_text())
    assert len(doc["ranks"]) == 2
    for rank in doc["ranks"]:
        assert len(rank["ortrain"]["times"]) == 2 and len(rank["ortrain"]["losses"]) == 3
