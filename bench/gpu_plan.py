"""The planned GPU memory of a workload's train step, on any machine (no GPU needed): the model
and its fused loss are exported on the CPU at a small size, then sessions are built for CUDA
(`device="cuda"`: the CUDA pass pipeline) and their memory plans made for the benchmark's size.
Prints the planned arena with the default passes, without the LM-head fusion, and with the
opt-in attention fusion, plus the parameters' and the optimizer's bytes, against issue 6's
memory target (0.7x PyTorch eager's measured peak, bench.gpu's figure).

    python -m bench.gpu_plan [--batch 16] [--seq 1024] [--layers 12] [--embd 768] [--heads 12]
                             [--vocab 50257] [--precision bf16] [--eager-peak-gib 21.3]

The defaults are bench.gpu's GPT-2 124M. Each variant is a separate process (the pass
selection is read from the environment when a session is built).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# name -> environment (ORTRAIN_ENABLE_PASSES / ORTRAIN_DISABLE_PASSES)
VARIANTS = {
    "default passes": {},
    "without the LM-head fusion": {"ORTRAIN_DISABLE_PASSES": "fuse_linear_cross_entropy"},
    "with fuse_attention": {"ORTRAIN_ENABLE_PASSES": "fuse_attention"},
}


def _plan(cfg: dict) -> dict:
    """In this process: export GPT-2 at batch 2 x 64 with any sizes, build the fused loss
    graph's session for CUDA, and plan it at the configured size."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import torch
    from torch import nn

    import models
    import ortrain
    from ortrain import _ortrain
    from ortrain.engine.runner import _with_buffer_outputs

    vocab, seq = cfg["vocab"], cfg["seq"]
    model, _, _ = models.gpt2_small(vocab=vocab, n_layer=cfg["layers"], n_embd=cfg["embd"], n_head=cfg["heads"],
                                    n_positions=seq, dropout=0.0, batch=2, seq=64, seed=0, attn_implementation="sdpa")
    ortrain.accelerate(model, dynamic=True, strict=True)
    ids = torch.randint(0, vocab, (2, 64))
    logits = model(ids).logits
    nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1)).backward()
    (runner,) = model.__dict__["_ortrain_state"].loss_runners.values()
    onnx_bytes, buffers = _with_buffer_outputs(runner.exported)
    session = _ortrain.Session(onnx_bytes, list(runner.exported.param_map), runner.trainable, [True] * (1 + len(buffers)),
                               matmul_precision=cfg["precision"], device="cuda")
    b = cfg["batch"]
    arena = _ortrain.cuda_arena_bytes(session, [("int64", [b, seq]), ("int64", [b * (seq - 1)])], True, None)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"arena": arena, "params": params, "passes": {k: v for k, v in session.passes if v}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_plan", description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    ap.add_argument("--eager-peak-gib", type=float, default=21.3,
                    help="PyTorch eager's measured peak at this size (bench.gpu, H100: 21.3 GiB for GPT-2 124M, batch 16)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("batch", "seq", "layers", "embd", "heads", "vocab", "precision")}
    if args.worker:
        print(json.dumps(_plan(json.loads(args.worker))))
        return 0
    gib = 2 ** 30
    results = {}
    print(f"GPT-2 {args.layers} layers, n_embd {args.embd}, {args.heads} heads, vocab {args.vocab}, "
          f"batch {args.batch} x seq {args.seq}, matmuls {args.precision}; planned on the CPU for CUDA")
    print(f"{'variant':30s} {'arena GiB':>10s} {'+ params, grads, AdamW GiB':>27s} {'x eager':>8s}  passes")
    for name, env in VARIANTS.items():
        proc = subprocess.run([sys.executable, "-m", "bench.gpu_plan", "--worker", json.dumps(cfg)],
                              env={**os.environ, **env}, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name:30s} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
            results[name] = {"error": proc.stderr[-2000:]}
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        total = r["arena"] + 4 * r["params"]  # parameters, gradients, two AdamW moments
        r["total"] = total
        results[name] = r
        passes = ", ".join(f"{k} x{v}" for k, v in r["passes"].items())
        print(f"{name:30s} {r['arena'] / gib:10.2f} {total / gib:27.2f} {total / gib / args.eager_peak_gib:8.2f}  {passes}")
    print(f"(issue 6's target: at most 0.7x eager's peak, {0.7 * args.eager_peak_gib:.1f} GiB; "
          "the planned arena is what torch.cuda allocates for the step, test_planned_arena_is_what_torch_cuda_allocates)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "eager_peak_gib": args.eager_peak_gib, "results": results}, f, indent=1)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
