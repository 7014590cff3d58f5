"""`python -m bench.max_batch`: the largest batch within a peak-RSS budget. The search finds the
boundary of any monotone memory curve, and a real run (eager and ortrain, tutorial, batches 20 and
40) probes fresh workers, prints the table and writes every probe's peak RSS."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the bench package


def _fake_probe(mib_per_sample: float, base: float, fail_from: int | None = None):
    def run(batch):
        if fail_from is not None and batch >= fail_from:
            return {"batch": batch, "error": "failed: killed (out of memory)"}
        return {"batch": batch, "peak_rss_mib": base + mib_per_sample * batch, "growth_mib": mib_per_sample * batch,
                "step_ms": 1.0}
    return run


def test_search_finds_the_largest_fitting_batch_within_five_percent():
    from bench.max_batch import largest_fitting

    # peak = 500 + 10·batch: 1000 MiB holds batch 50 exactly
    best, probes = largest_fitting(_fake_probe(10, 500), 20, 1000, 4096, log=lambda m: None)
    assert 48 <= best["batch"] <= 50 and best["peak_rss_mib"] <= 1000
    assert all(p["peak_rss_mib"] > 1000 for p in probes if p["batch"] > best["batch"])
    # the workload's own batch already over budget: no answer
    best, probes = largest_fitting(_fake_probe(10, 500), 20, 600, 4096, log=lambda m: None)
    assert best is None and [p["batch"] for p in probes] == [20]
    # a failed probe (e.g. killed) counts as not fitting; the limit stops the doubling
    best, _ = largest_fitting(_fake_probe(1, 500, fail_from=70), 20, 10_000, 4096, log=lambda m: None)
    assert 64 <= best["batch"] < 70
    best, probes = largest_fitting(_fake_probe(1, 500), 20, 10_000, 100, log=lambda m: None)
    assert best["batch"] == 100 and max(p["batch"] for p in probes) == 100


def test_max_batch_probes_real_workers_and_reports_each_system(tmp_path):
    out = tmp_path / "mb.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "bench.max_batch", "--systems", "eager,ortrain", "--steps", "2",
                           "--max-batch", "40", "--budget-mib", "100000", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout[-4000:], proc.stderr[-3000:], sep="\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "largest batch within a peak RSS of 100000 MiB" in proc.stdout
    doc = json.loads(out.read_text())
    for system in ("eager", "ortrain"):
        r = doc["results"][system]
        assert [p["batch"] for p in r["probes"]] == [20, 40], r["probes"]
        assert all("error" not in p and p["peak_rss_mib"] > 300 for p in r["probes"]), r["probes"]
        assert r["best"]["batch"] == 40
        assert f"{system:8}     40" in proc.stdout
    # eager's logits and their gradient grow with the batch: the 40-sample probe needs more
    eager = doc["results"]["eager"]["probes"]
    assert eager[1]["peak_rss_mib"] > eager[0]["peak_rss_mib"] + 50
