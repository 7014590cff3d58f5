"""`python -m bench.gpu_roofline`: the roofline model of a CUDA train step, built from the
engine's plan without a GPU. On a 1-layer GPT-2 (width 64, one head of 64, vocab 500, 4 x 128
tokens) its FLOPs are the textbook counts: 6 per weight per token for the block's matmuls, the
LM head's three products, and the attention's score products (unfused) or the fused kernels'
4·B·H·T·S·D forward and 2.5 times that backward over the tiles a causal mask leaves live."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, T, E, V = 4, 128, 64, 500
BLOCK_WEIGHTS = E * 3 * E + E * E + 2 * E * 4 * E  # c_attn, attn c_proj, mlp c_fc and c_proj
# MatMulGeluGrad: the MLP's dX product with the GELU's gradient in its epilogue (CUDA train graphs)
MATMULS = ("MatMul", "FusedMatMul", "Gemm", "Linear", "MatMulGeluGrad")


def _roofline(tmp_path, passes: str, batch: int = B, seq: int = T) -> tuple[dict, str]:
    out = tmp_path / f"roofline-{passes or 'default'}-{batch}x{seq}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env.pop("ORTRAIN_DISABLE_PASSES", None)
    cmd = [sys.executable, "-m", "bench.gpu_roofline", "--layers", "1", "--embd", str(E), "--heads", "1",
           "--vocab", str(V), "--batch", str(batch), "--seq", str(seq), "--passes", passes, "--compile-ms", "1.0",
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout, proc.stderr[-3000:], sep="\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def _flops(doc: dict, pick) -> float:
    return sum(k["flops"] for k in doc["kernels"] if pick(k["op"]))


def test_unfused_plan_counts_the_textbook_flops(tmp_path):
    doc, text = _roofline(tmp_path, "")
    tokens, rows = B * T, B * (T - 1)
    scores = 2 * 2 * B * T * T * E * 3  # Q·Kᵀ and P·V, forward and two backward products each
    assert _flops(doc, lambda op: op in MATMULS) == 6 * BLOCK_WEIGHTS * tokens + scores
    assert _flops(doc, lambda op: op.startswith("LinearCrossEntropy")) == 6 * V * E * rows
    assert "modelled step:" in text and "the model is" in text
    assert all(k["s"] >= max(k["mem_s"], k["math_s"]) > 0 for k in doc["kernels"])


def test_fused_attention_counts_its_live_tiles_and_is_modelled_faster(tmp_path):
    plain, _ = _roofline(tmp_path, "")
    fused, text = _roofline(tmp_path, "fuse_attention")
    assert "fuse_attention x1" in text
    tokens = B * T
    assert _flops(fused, lambda op: op in MATMULS) == 6 * BLOCK_WEIGHTS * tokens
    live = (2 * 3 / 2) / 4  # 128 rows: 2 tiles of 64 a side, 3 of 4 live under the causal mask
    forward = 4 * B * 1 * T * T * E * live
    assert _flops(fused, lambda op: op == "Attention") == forward
    assert _flops(fused, lambda op: op == "AttentionGrad") == 2.5 * forward
    assert sum(k["s"] for k in fused["kernels"]) < sum(k["s"] for k in plain["kernels"])


def test_a_bench_sized_causal_mask_is_a_constant_not_kernels(tmp_path):
    """At GPT-2 124M's bench size (batch 16 x seq 1024) the [16, 1, 1024, 1024] mask is 16 M
    elements, over the planner's general folding limit: it must still be folded (only attention
    reads it), or it costs kernels every step and, computed at run time, is never found causal,
    so the CUDA attention reads it and the flash kernels cannot run."""
    doc, _ = _roofline(tmp_path, "fuse_attention,autocast", batch=16, seq=1024)
    ops = {k["op"] for k in doc["kernels"]}
    assert "Attention" in ops and "AttentionGrad" in ops
    mask_ops = ops & {"Where", "Equal", "LessOrEqual", "And", "Expand"}
    assert not mask_ops, f"the causal mask is computed each step by {sorted(mask_ops)}"
