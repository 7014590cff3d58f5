"""`python -m bench.kernel_loops`: the flash attention kernels' main loops read from the SASS of
the sm_90 CUBINs the CI compile test keeps (target/cubins/sm_90), no GPU needed. One pass of the
forward's loop is one 64-key tile for a warp's 32 query rows: 2 row tiles x (8 key tiles x 4
head-dim steps for S = QKᵀ + 8 head-dim tiles x 4 key steps for O += PV) = 128 HMMA. The
dropout's share of that loop is held to a budget here, so that a change which makes the fused
dropout costlier shows without a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUBINS = os.path.join(REPO, "target", "cubins", "sm_90")
FORWARD = "attention_flash_fwd_d64r128_bf16"
FORWARD_DROPOUT = "attention_flash_fwd_d64r128_dp_bf16"
# The dropout forward's loop against the plain one: 2.67x at this commit (4.68x at stop 59,
# before the quads shared their Philox counters and the keep bits came as nibbles).
DROPOUT_BUDGET = 3.0


def _cubins() -> str:
    """The kept CUBINs, compiled by the CI compile test now if an earlier run has not."""
    if not os.path.isfile(os.path.join(CUBINS, "attention_flash_dropout.cubin")):
        cmd = ["cargo", "test", "--release", "-q", "-p", "ortrain-engine", "--features", "cuda", "--test", "cuda_kernels",
               "every_kernel_file"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return CUBINS


def _loops(tmp_path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "loops.json"
    cmd = [sys.executable, "-m", "bench.kernel_loops", "--cubins", _cubins(), "--kernel",
           "^attention_flash_fwd_d64r128_(dp_)?bf16$", "--json", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    print(proc.stdout, proc.stderr[-3000:], sep="\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_the_flash_forwards_main_loop_is_found_with_its_products(tmp_path):
    doc, text = _loops(tmp_path)
    kernels = doc["kernels"]
    assert sorted(kernels) == [FORWARD, FORWARD_DROPOUT], text
    for name in (FORWARD, FORWARD_DROPOUT):
        mains = [loop for loop in kernels[name]["loops"] if loop["HMMA"]]
        assert [loop["HMMA"] for loop in mains] == [128], (name, mains)
        assert mains[0]["STL"] == 0 and mains[0]["LDL"] == 0, f"{name} spills in its main loop: {mains[0]}"
        assert f"{name}: {kernels[name]['instructions']} instructions" in text
    plain, dropped = (next(loop for loop in kernels[k]["loops"] if loop["HMMA"]) for k in (FORWARD, FORWARD_DROPOUT))
    # the quads OR their keep bits: two 64-bit shuffles (4 SHFL) and two 32-bit ones a query row,
    # 4 rows a lane
    assert dropped["SHFL"] - plain["SHFL"] == 24, (plain, dropped)
    ratio = dropped["instructions"] / plain["instructions"]
    assert ratio <= DROPOUT_BUDGET, (
        f"the dropout makes the flash forward's main loop {ratio:.2f}x the plain one's ({dropped['instructions']} against "
        f"{plain['instructions']} instructions), over the budget of {DROPOUT_BUDGET}x")


def test_compare_sets_each_loop_against_another_folders(tmp_path):
    _, text = _loops(tmp_path, "--compare", _cubins())
    assert text.count("(was ") == 2 and text.count(": 1.00x)") == 2, text


def test_a_folder_without_cubins_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.kernel_loops", "--cubins", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and f"no CUBINs in {tmp_path}" in proc.stderr, proc.stderr
