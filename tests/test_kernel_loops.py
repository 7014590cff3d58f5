"""`python -m bench.kernel_loops`: the flash attention kernels' main loops read from the SASS of
the sm_90 CUBINs the CI compile test keeps (target/cubins/sm_90), no GPU needed. One pass of the
forward's loop is one 64-key tile for a warp's 32 query rows: 2 row tiles x (8 key tiles x 4
head-dim steps for S = QKᵀ + 8 head-dim tiles x 4 key steps for O += PV) = 128 HMMA. The
dropout's share of the forward's, dQ's and dK/dV's loops is held to a budget here, and so is
the key padding's (an attention_mask's flags), so that a change which makes the fused dropout
or the padding costlier shows without a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUBINS = os.path.join(REPO, "target", "cubins", "sm_90")
KERNELS = "^attention_flash_(fwd|bwd_dq|bwd_dkv)_d64r128_(dp_)?bf16$"
FORWARD = "attention_flash_fwd_d64r128_bf16"
# Each dropout kernel's innermost main loop against the plain kernel's, in instructions. At
# this commit: forward 2.67x, dQ 2.56x, dK/dV 2.53x; at stop 59, before the lanes shared their
# Philox counters and the keep bits came as nibbles: 4.68x, 4.32x, 4.05x.
DROPOUT_BUDGET = 3.0
# The key-padding kernels' (`_kp`) innermost main loops against the plain kernels'. At this
# commit: forward 1.16x, dQ 1.15x, dK/dV 1.33x (a tile's flags gathered by two ballots a warp,
# the mask skipped where the tile hides no key); at stop 60, which read every element's flag from
# global memory on every tile: 3.12x, 3.06x, 2.13x.
KEY_PADDING_BUDGET = 1.5


def _cubins() -> str:
    """The kept CUBINs, compiled by the CI compile test now if an earlier run has not."""
    if not all(os.path.isfile(os.path.join(CUBINS, f"attention_flash_{f}.cubin")) for f in ("dropout", "padded")):
        cmd = ["cargo", "test", "--release", "-q", "-p", "ortrain-engine", "--features", "cuda", "--test", "cuda_kernels",
               "every_kernel_file"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return CUBINS


def _loops(tmp_path, *extra: str, kernels: str = KERNELS) -> tuple[dict, str]:
    out = tmp_path / "loops.json"
    cmd = [sys.executable, "-m", "bench.kernel_loops", "--cubins", _cubins(), "--kernel", kernels, "--json", str(out),
           *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    print(proc.stdout, proc.stderr[-3000:], sep="\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def _main_loop(kernel: dict) -> dict:
    """The innermost loop with tensor-core products (the fewest instructions)."""
    return min((loop for loop in kernel["loops"] if loop["HMMA"]), key=lambda loop: loop["instructions"])


def test_the_flash_kernels_main_loops_are_found_with_their_products(tmp_path):
    doc, text = _loops(tmp_path)
    kernels = doc["kernels"]
    names = sorted(f"attention_flash_{k}_d64r128_{dp}bf16" for k in ("fwd", "bwd_dq", "bwd_dkv") for dp in ("", "dp_"))
    assert sorted(kernels) == names, text
    hmma = {"fwd": 128, "bwd_dq": 192, "bwd_dkv": 256}
    for name in names:
        main = _main_loop(kernels[name])
        kind = next(k for k in hmma if f"_{k}_" in name)
        assert main["HMMA"] == hmma[kind], (name, main)
        assert f"{name}: {kernels[name]['instructions']} instructions" in text
    plain, dropped = _main_loop(kernels[FORWARD]), _main_loop(kernels[FORWARD.replace("_bf16", "_dp_bf16")])
    assert plain["STL"] == 0 and plain["LDL"] == 0 and dropped["STL"] == 0, f"the forward spills in its main loop: {plain} {dropped}"
    # the quads OR their keep bits: two 64-bit shuffles (4 SHFL) and two 32-bit ones a query row,
    # 4 rows a lane
    assert dropped["SHFL"] - plain["SHFL"] == 24, (plain, dropped)


def _overruns(kernels: dict, variant: str, budget: float, what: str) -> list[str]:
    """The d64r128 kernels whose `variant` (dp_, kp_) main loop is over `budget` times the plain
    kernel's, in instructions; the variant's loop holds the plain one's products."""
    over = []
    for kind in ("fwd", "bwd_dq", "bwd_dkv"):
        plain = _main_loop(kernels[f"attention_flash_{kind}_d64r128_bf16"])
        other = _main_loop(kernels[f"attention_flash_{kind}_d64r128_{variant}bf16"])
        ratio = other["instructions"] / plain["instructions"]
        print(f"{kind}: {other['instructions']} / {plain['instructions']} instructions = {ratio:.2f}x")
        assert other["HMMA"] == plain["HMMA"], other
        if ratio > budget:
            over.append(f"{kind}: {what} makes the main loop {ratio:.2f}x the plain one's ({other['instructions']} against "
                        f"{plain['instructions']})")
    return over


def test_the_dropout_stays_within_its_share_of_each_main_loop(tmp_path):
    over = _overruns(_loops(tmp_path)[0]["kernels"], "dp_", DROPOUT_BUDGET, "the dropout")
    assert not over, f"over the budget of {DROPOUT_BUDGET}x: {over}"


def test_the_key_padding_stays_within_its_share_of_each_main_loop(tmp_path):
    kernels = _loops(tmp_path, kernels="^attention_flash_(fwd|bwd_dq|bwd_dkv)_d64r128_(kp_)?bf16$")[0]["kernels"]
    over = _overruns(kernels, "kp_", KEY_PADDING_BUDGET, "the key padding")
    assert not over, f"over the budget of {KEY_PADDING_BUDGET}x: {over}"


def test_compare_sets_each_loop_against_another_folders(tmp_path):
    _, text = _loops(tmp_path, "--compare", _cubins(), kernels="^attention_flash_fwd_d64r128_(dp_)?bf16$")
    assert text.count("(was ") == 2 and text.count(": 1.00x)") == 2, text


def test_a_folder_without_cubins_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.kernel_loops", "--cubins", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and f"no CUBINs in {tmp_path}" in proc.stderr, proc.stderr
