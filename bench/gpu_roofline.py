"""A roofline model of a workload's CUDA train step, on any machine (no GPU needed): the step
list of the engine's plan (the same CUDA session bench.gpu_plan builds, with the passes named
in --passes), each step costed as the larger of its bytes over the GPU's memory bandwidth and its
FLOPs over its tensor-core (or CUDA-core) rate, each at an efficiency a good kernel reaches, plus
a launch cost per kernel. It prints the modelled time per op type, the step's total and the MFU
it would give, so that the next optimisation can be chosen before a GPU is lent; the lent GPU's
profile (bench.gpu_profile) then says how far the real kernels are from the model.

    python -m bench.gpu_roofline [--workload gpt2|tutorial] [--passes fuse_attention,autocast]
                                 [--gpu h100|h200] [--gemm-eff 0.65] [--attention-eff 0.35]
                                 [--bw-eff 0.8] [--launch-us 1.5] [--compile-ms 61.39] [--top 12]
                                 [--batch B] [--seq S] [--layers 12] [--embd 768] [--heads 12]
                                 [--vocab V] [--precision bf16] [--json PATH]

What the model counts (a lower bound on what the plan's kernels must move and compute):
- every step reads each input and writes each output once (views move nothing); a Gather reads
  the rows it gathers, not its whole table;
- matmuls (MatMul, FusedMatMul, Gemm, Linear, and MatMulGeluGrad, which also reads the GELU's
  input in its epilogue) do 2·M·N·K FLOPs at the tensor-core rate where
  their operands are 16-bit or the session multiplies f32 as bf16/fp16 (then the rounding of f32
  operands into 16-bit copies costs 6 bytes an element, as half_gemm.rs does), else at the
  plain f32 rate (TF32 is off by default);
- the fused attention does 4·B·H·T·S·D FLOPs forward and 2.5 times that backward, at
  --attention-eff, over the key tiles a causal mask leaves live (n(n+1)/2 of n² 64-wide tiles;
  --dense-masks counts all); its mask is read for those tiles only;
- LayerNormGrad is its kernels: the row statistics (recomputed from x where the forward's are
  not inputs), dx with the parameter gradients' per-block partials, and their reduction;
- the fused LM head (LinearCrossEntropy) is its kernels: the logits product, the row pass over
  the logits chunk (read f32, write G: 16-bit where only the bf16 products read it), and the
  dX and dW products reading G.
Not modelled: cache reuse between kernels, overlap of kernels, occupancy, the optimizer step
(PyTorch's, outside the plan) and the host.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict

from bench.gpu import TUTORIAL_LAYERS, TUTORIAL_WIDTH, train_flops
from bench.gpu_plan import add_model_args, model_config

BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
         "uint8": 1, "bool": 1}
# (dense 16-bit tensor-core FLOP/s, plain f32 FLOP/s, memory bytes/s): the SXM parts' data sheets
GPUS = {"h100": (989.4e12, 66.9e12, 3.35e12), "h200": (989.4e12, 66.9e12, 4.8e12)}
MATMULS = ("MatMul", "FusedMatMul", "Gemm", "Linear", "MatMulGeluGrad")
HALF = ("bfloat16", "float16")
TILE = 64


def _bytes(dtype: str, shape) -> int:
    return BYTES.get(dtype, 4) * math.prod(shape)


def _live_tiles(t: int, s: int, causal: bool) -> float:
    """The fraction of 64 × 64 score tiles a causal mask leaves live (all of them otherwise)."""
    if not causal:
        return 1.0
    n = math.ceil(max(t, s) / TILE)
    return (n * (n + 1) / 2) / (n * n)


def cost_steps(steps, step_inputs, precision: str, causal: bool = True):
    """Per step: (op type, node name, bytes, FLOPs, rate) where rate is "tc", "f32", "attn" or
    None (memory only); the fused LM head is split into its kernels (one row each)."""
    rows = []
    for (op, name, outs), (ins, view) in zip(steps, step_inputs):
        if view:
            continue
        in_b = [(_bytes(*t) if t else 0) for t in ins]
        out_b = [_bytes(dt, sh) for _, dt, sh in outs]
        if op in MATMULS:
            (a_dt, a), (b_dt, b) = ins[0], ins[1]
            o = outs[0][2]
            if op == "Linear":
                k = a[-1]
            else:
                m = o[-2] if len(o) >= 2 else 1
                k = a[-1] if len(a) < 2 or a[-2] == m else a[-2]
            flops = 2 * math.prod(o) * k
            extra = 0
            if a_dt in HALF and b_dt in HALF:
                rate = "tc"
            elif precision in ("bf16", "fp16") and a_dt == "float32":
                # both operands rounded into 16-bit copies first (read f32, write 16-bit: 1.5x
                # their bytes), then the gemm reads those (0.5x) instead of the f32 ones (1x)
                rate, extra = "tc", in_b[0] + in_b[1]
            else:
                rate = "f32"
            rows.append((op, name, sum(in_b) + sum(out_b) + extra, flops, rate))
        elif op in ("Attention", "AttentionGrad"):
            # Attention(Q, Kt, V, M?) and AttentionGrad(dO, Q, Kt, V, M?, O, LSE), LSE [B, H, T]:
            # layout BHSD (Q [B, H, T, D], Kt [B, H, D, S]), BSHD (Q [B, T, H, D], K [B, S, H, D])
            # or BS3HD (Q, K and V one tensor [B, T, 3·H·D], read once)
            qi = 0 if op == "Attention" else 1
            lse = outs[1][2] if op == "Attention" else ins[6][1]
            q, k = ins[qi][1], ins[qi + 1][1]
            packed = len(q) == 3
            if packed:
                (b, h, t), s = lse, lse[2]
                d = q[2] // (3 * h)
            elif list(q[:3]) == list(lse):
                (b, h, t, d), s = q, k[-1]
            else:
                (b, t, h, d), s = q, k[1]
            live = _live_tiles(t, s, causal)
            flops = 4 * b * h * t * s * d * (1.0 if op == "Attention" else 2.5) * live
            mask_at = 3 if op == "Attention" else 4
            moved = sum(in_b) + sum(out_b) - (2 * in_b[qi] if packed else 0)
            if len(in_b) > mask_at and in_b[mask_at]:
                moved -= in_b[mask_at] * (1 - live)
            rows.append((op, name, int(moved), flops, "attn"))
        elif op == "LinearCrossEntropy":
            rows.extend(_lm_head(name, ins, outs, precision))
        elif op == "LayerNormGrad":
            # backend/cuda/ops/norm.rs: the statistics (recomputed from x unless the forward's
            # are inputs 3 and 4), then dx from dy and x, the same kernel writing the parameter
            # gradients' f32 column partials (a row of dscale and one of dbias, and one of dx's
            # column sums where passes/layer_norm_grad_col_sum.rs asked for them as a 1-D last
            # output, for each of its 3 blocks an SM on these 132-SM GPUs), which the reduction
            # reads; the dx kernel also reads the residual gradient (input 5) and writes dx's
            # 16-bit copy (output 3) where passes/layer_norm_grad_sum.rs put them there
            x_b = in_b[1]
            n = ins[2][1][-1] if ins[2][1] else 1
            parts = 3 if any(len(o[2]) == 1 for o in outs[3:]) else 2
            partials = 3 * 132 * parts * n * 4
            if len(in_b) < 5 or not in_b[3]:
                rows.append((op + " stats", name, x_b, 0, None))
            rows.append((op, name, sum(in_b) + out_b[0] + sum(out_b[3:]) + partials, 0, None))
            rows.append((op + " params reduce", name, partials + sum(out_b[1:3]), 0, None))
        elif op == "Gather":
            rows.append((op, name, sum(in_b[1:]) + 2 * sum(out_b), 0, None))
        elif op == "GatherGrad":
            # backend/cuda/ops/gather.rs: dx zeroed, the indices as u32 keys with their positions,
            # a radix sort of 8 bits a pass (a count, a scan, a scatter of keys and positions;
            # axis 0 assumed, as an embedding's), then dy's rows summed into dx's rows in order
            # (a run of more than 32 by segments, whose sums a last kernel adds: random tokens
            # have no such runs, so that kernel only reads the keys); up to 32 indices no sort
            n_idx = math.prod(ins[1][1])
            dim = outs[0][2][0] if outs[0][2] else 1
            rows.append((op + " zero", name, out_b[0], 0, None))
            if n_idx <= 32:
                # gather_grad_small: no sort for a few indices (a select's one)
                rows.append((op + " rows", name, in_b[0] + min(out_b[0], in_b[0]), 0, None))
                continue
            rows.append((op + " keys", name, 16 * n_idx, 0, None))
            for _ in range(max(1, math.ceil(dim.bit_length() / 8))):
                rows.append((op + " sort count", name, 4 * n_idx, 0, None))
                rows.append((op + " sort scan", name, 8 * 256 * math.ceil(n_idx / 1024), 0, None))
                rows.append((op + " sort scatter", name, 16 * n_idx, 0, None))
            rows.append((op + " rows", name, in_b[0] + 8 * n_idx + min(out_b[0], in_b[0] // max(1, n_idx) * n_idx), 0, None))
            rows.append((op + " runs", name, 8 * n_idx, 0, None))
        else:
            rows.append((op, name, sum(in_b) + sum(out_b), 0, None))
    return rows


def _lm_head(name: str, ins, outs, precision: str):
    """LinearCrossEntropy's kernels (backend/cuda/ops/linear_cross_entropy.rs), chunk by chunk
    of the rows its scratch output holds: each chunk's logits product, row pass (which writes
    the 16-bit G itself in a bf16 session without a bias, else a rounding pass follows where the
    products are bf16), and dX and dW products (dW read and written again from the second chunk
    on)."""
    x_dt, x = ins[0]
    w = ins[1][1]
    k = x[-1]
    r = ins[3][1][0]
    n = math.prod(w) // k
    chunk = outs[4][2][0] if len(outs) > 4 and outs[4][2] else r
    half = precision in ("bf16", "fp16") or x_dt in HALF
    es = 2 if half else 4  # bytes of an operand element as the products read it
    g_es = 2 if half and precision != "fp16" else 4  # fp16 sessions multiply G at TF32
    rate = "tc" if half else "f32"
    out = []
    if half and x_dt == "float32":
        out.append(("LinearCrossEntropy round X, W", name, 6 * (r * k + n * k), 0, None))
    for c0 in range(0, r, chunk):
        rc = min(chunk, r - c0)
        e = rc * n
        logits16 = g_es == 2 and ins[2] is None  # bf16 logits, G made from them in place
        out.append(("LinearCrossEntropy logits", name, es * (rc * k + n * k) + (2 if logits16 else 4) * e, 2 * rc * k * n, rate))
        if logits16:
            # lce_rows_v16: the bf16 logits read, G written over them
            out.append(("LinearCrossEntropy rows", name, 4 * e + 8 * rc, 0, None))
        else:
            out.append(("LinearCrossEntropy rows", name, 8 * e + 8 * rc, 0, None))
            if g_es == 2:
                out.append(("LinearCrossEntropy round G", name, 6 * e, 0, None))
        out.append(("LinearCrossEntropy dX", name, g_es * e + es * n * k + 4 * rc * k, 2 * rc * k * n, rate))
        out.append(("LinearCrossEntropy dW", name, g_es * e + es * rc * k + (8 if c0 else 4) * n * k, 2 * rc * k * n, rate))
    return out


def model_time(rows, gpu: str, gemm_eff: float, attention_eff: float, bw_eff: float, launch_us: float):
    """Adds each row's modelled seconds: max(bytes / bandwidth, FLOPs / rate) + a launch."""
    tc, f32, bw = GPUS[gpu]
    rate = {"tc": tc * gemm_eff, "f32": f32 * gemm_eff, "attn": tc * attention_eff}
    out = []
    for op, name, moved, flops, kind in rows:
        mem_s = moved / (bw * bw_eff)
        flop_s = flops / rate[kind] if kind else 0.0
        out.append((op, name, moved, flops, kind, mem_s, flop_s, max(mem_s, flop_s) + launch_us * 1e-6))
    return out


def model_flops(cfg: dict, model) -> float:
    """bench.gpu's FLOPs of the workload's step (train_flops), for the MFU."""
    tokens = cfg["batch"] * cfg["seq"]
    if cfg["workload"] == "tutorial":
        return train_flops(model, [model.encoder.weight], TUTORIAL_LAYERS, TUTORIAL_WIDTH, cfg["seq"], tokens)
    return train_flops(model, [model.transformer.wpe.weight], cfg["layers"], cfg["embd"], cfg["seq"], tokens)


def _table(timed, total_flops: float, gpu: str, compile_ms: float | None, top: int) -> str:
    by = defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0, 0.0])
    for op, _, moved, flops, _, mem_s, flop_s, t in timed:
        r = by[op]
        r[0] += 1
        r[1] += moved
        r[2] += flops
        r[3] += mem_s
        r[4] += flop_s
        r[5] += t
    total = sum(r[5] for r in by.values())
    lines = [f"{'op':28s} {'kernels':>7s} {'GB':>8s} {'TFLOP':>7s} {'ms mem':>7s} {'ms math':>8s} {'ms':>7s} {'share':>6s}"]
    for op, r in sorted(by.items(), key=lambda kv: -kv[1][5]):
        lines.append(f"{op:28s} {r[0]:7d} {r[1] / 1e9:8.2f} {r[2] / 1e12:7.3f} {r[3] * 1e3:7.2f} {r[4] * 1e3:8.2f} "
                     f"{r[5] * 1e3:7.2f} {100 * r[5] / total:5.1f}%")
    mem_bound = sum(t for *_, mem_s, flop_s, t in timed if mem_s >= flop_s)
    lines.append(f"modelled step: {total * 1e3:.1f} ms over {len(timed)} kernels; memory-bound kernels "
                 f"{mem_bound * 1e3:.1f} ms ({100 * mem_bound / total:.0f}%); "
                 f"MFU at that time {100 * total_flops / total / GPUS[gpu][0]:.1f}% ({total_flops / 1e12:.2f} TFLOP a step)")
    if compile_ms:
        lines.append(f"torch.compile's measured {compile_ms:.2f} ms: 1.2x it is {compile_ms / 1.2:.1f} ms; "
                     f"the model is {compile_ms / (total * 1e3):.2f}x it")
    if top:
        lines.append(f"the {top} heaviest kernels:")
        for op, name, moved, flops, kind, mem_s, flop_s, t in sorted(timed, key=lambda r: -r[7])[:top]:
            lines.append(f"  {t * 1e3:6.3f} ms  {op:22s} {name[:60]:60s} {moved / 1e6:8.1f} MB {flops / 1e9:8.1f} GFLOP")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_roofline", description=__doc__.splitlines()[0])
    add_model_args(ap, ("fp32", "bf16", "fp16"))
    ap.add_argument("--passes", default=None,
                    help="opt-in engine passes (ORTRAIN_ENABLE_PASSES) for the plan; default: the environment's")
    ap.add_argument("--gpu", default="h100", choices=tuple(GPUS))
    ap.add_argument("--gemm-eff", type=float, default=0.65, help="share of the peak a matmul reaches")
    ap.add_argument("--attention-eff", type=float, default=0.35, help="share of the 16-bit peak the fused attention reaches")
    ap.add_argument("--bw-eff", type=float, default=0.8, help="share of the memory bandwidth a kernel reaches")
    ap.add_argument("--launch-us", type=float, default=1.5, help="cost of a kernel in a CUDA graph replay")
    ap.add_argument("--dense-masks", action="store_true", help="count every score tile (no causal skipping)")
    ap.add_argument("--compile-ms", type=float, default=None, help="torch.compile's measured ms/step, to compare")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", help="write every kernel's row here")
    a = ap.parse_args(argv)
    cfg = model_config(a)
    if a.passes is not None:
        # read when the session is built, so set before it is
        os.environ["ORTRAIN_ENABLE_PASSES"] = a.passes
    from bench.gpu_plan import cuda_session

    session, sigs, model = cuda_session(cfg)
    info = session.plan_info(sigs, True)
    rows = cost_steps(info["steps"], info["step_inputs"], a.precision, causal=not a.dense_masks)
    timed = model_time(rows, a.gpu, a.gemm_eff, a.attention_eff, a.bw_eff, a.launch_us)
    flops = model_flops(cfg, model)
    passes = ", ".join(f"{k} x{v}" for k, v in session.passes if v)
    print(f"{a.workload}: batch {a.batch} x seq {a.seq}, vocab {a.vocab}, {a.precision}; passes: {passes}")
    print(f"{a.gpu.upper()} model: matmuls at {a.gemm_eff:.0%} and the fused attention at {a.attention_eff:.0%} of "
          f"the peak, memory at {a.bw_eff:.0%} of {GPUS[a.gpu][2] / 1e12:.2f} TB/s, {a.launch_us} us a kernel")
    print(_table(timed, flops, a.gpu, a.compile_ms, a.top))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": cfg, "gpu": a.gpu, "passes": passes, "model_flops": flops,
                       "kernels": [dict(zip(("op", "node", "bytes", "flops", "rate", "mem_s", "math_s", "s"), r))
                                   for r in timed]}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
