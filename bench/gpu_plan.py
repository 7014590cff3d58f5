"""The planned GPU memory of a workload's train step, on any machine (no GPU needed): the model
and its fused loss are exported on the CPU at a small size, then sessions are built for CUDA
(`device="cuda"`: the CUDA pass pipeline) and their memory plans made for the benchmark's size.
Prints the planned arena with the default passes, without the LM-head fusion, and with the
opt-in attention fusion, plus the parameters' and the optimizer's bytes, against issue 6's
memory target (0.7x PyTorch eager's measured peak, bench.gpu's figure).

    python -m bench.gpu_plan [--workload gpt2|tutorial] [--batch B] [--seq S] [--layers 12]
                             [--embd 768] [--heads 12] [--vocab V] [--precision bf16]
                             [--eager-peak-gib G]

`gpt2` (the default) is bench.gpu's GPT-2 124M (batch 16, seq 1024, vocab 50257, eager 21.3
GiB); `tutorial` its tutorial model (batch 20, seq 35, vocab 28782, fp32, eager 0.44 GiB;
--layers/--embd/--heads do not apply). Each variant is a separate process (the pass selection
is read from the environment when a session is built). The runtime's own buffers (scratch,
cuBLAS's workspace) are not planned: bench.gpu measures them.
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


# per workload: batch, seq, vocab, precision, PyTorch eager's measured peak (GiB, bench.gpu on an H100)
DEFAULTS = {"gpt2": (16, 1024, 50257, "bf16", 21.3), "tutorial": (20, 35, 28782, "fp32", 0.44)}


def cuda_session(cfg: dict):
    """In this process: export the model at a small size with any sizes and build the fused loss
    graph's session for CUDA. Returns (session, the input signatures at the configured size,
    the model)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import torch
    from torch import nn

    import models
    import ortrain
    from ortrain import _ortrain
    from ortrain.engine.runner import _with_buffer_outputs

    vocab, seq, b = cfg["vocab"], cfg["seq"], cfg["batch"]
    if cfg["workload"] == "tutorial":
        # the tutorial's layout: ids [seq, batch], targets flattened
        model = models.tutorial_transformer(vocab, dropout=0.2, seed=0)[0]
        ortrain.accelerate(model, dynamic=True, strict=True)
        nn.functional.cross_entropy(model(torch.randint(0, vocab, (8, 2))).view(-1, vocab),
                                    torch.randint(0, vocab, (16,))).backward()
        sigs = [("int64", [seq, b]), ("int64", [seq * b])]
    else:
        model, _, _ = models.gpt2_small(vocab=vocab, n_layer=cfg["layers"], n_embd=cfg["embd"], n_head=cfg["heads"],
                                        n_positions=seq, dropout=0.0, batch=2, seq=64, seed=0,
                                        attn_implementation="sdpa")
        ortrain.accelerate(model, dynamic=True, strict=True)
        ids = torch.randint(0, vocab, (2, 64))
        logits = model(ids).logits
        nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1)).backward()
        sigs = [("int64", [b, seq]), ("int64", [b * (seq - 1)])]
    (runner,) = model.__dict__["_ortrain_state"].loss_runners.values()
    onnx_bytes, buffers = _with_buffer_outputs(runner.exported)
    session = _ortrain.Session(onnx_bytes, list(runner.exported.param_map), runner.trainable, [True] * (1 + len(buffers)),
                               matmul_precision=cfg["precision"], device="cuda")
    return session, sigs, model


def _plan(cfg: dict) -> dict:
    """The planned arena of cuda_session(cfg)'s train step, the parameters' bytes and the passes."""
    from ortrain import _ortrain

    session, sigs, model = cuda_session(cfg)
    arena = _ortrain.cuda_arena_bytes(session, sigs, True, None)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"arena": arena, "params": params, "passes": {k: v for k, v in session.passes if v}}


def add_model_args(ap: argparse.ArgumentParser, precisions=("fp32", "bf16")) -> None:
    """The workload and its sizes (None: the workload's DEFAULTS, set by model_config)."""
    ap.add_argument("--workload", default="gpt2", choices=tuple(DEFAULTS))
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--precision", default=None, choices=precisions)


def model_config(args) -> dict:
    """Fills the sizes left out from the workload's DEFAULTS; returns cuda_session's config."""
    for name, value in zip(("batch", "seq", "vocab", "precision", "eager_peak_gib"), DEFAULTS[args.workload]):
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    return {k: getattr(args, k) for k in ("workload", "batch", "seq", "layers", "embd", "heads", "vocab", "precision")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_plan", description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--eager-peak-gib", type=float, default=None,
                    help="PyTorch eager's measured peak at this size (bench.gpu, H100: 21.3 GiB for GPT-2 124M at "
                         "batch 16, 0.44 GiB for the tutorial)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cfg = model_config(args)
    if args.worker:
        print(json.dumps(_plan(json.loads(args.worker))))
        return 0
    gib = 2 ** 30
    results = {}
    model = ("the tutorial model (2 layers, emsize 200, 2 heads)" if args.workload == "tutorial" else
             f"GPT-2 {args.layers} layers, n_embd {args.embd}, {args.heads} heads")
    print(f"{model}, vocab {args.vocab}, batch {args.batch} x seq {args.seq}, matmuls {args.precision}; "
          "planned on the CPU for CUDA")
    print(f"{'variant':30s} {'arena GiB':>10s} {'+ params, grads, Adam GiB':>27s} {'x eager':>8s}  passes")
    for name, env in VARIANTS.items():
        proc = subprocess.run([sys.executable, "-m", "bench.gpu_plan", "--worker", json.dumps(cfg)],
                              env={**os.environ, **env}, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name:30s} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
            results[name] = {"error": proc.stderr[-2000:]}
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        total = r["arena"] + 4 * r["params"]  # parameters, gradients, two Adam(W) moments
        r["total"] = total
        results[name] = r
        passes = ", ".join(f"{k} x{v}" for k, v in r["passes"].items())
        print(f"{name:30s} {r['arena'] / gib:10.3f} {total / gib:27.3f} {total / gib / args.eager_peak_gib:8.2f}  {passes}")
    print(f"(issue 6's target: at most 0.7x eager's peak, {0.7 * args.eager_peak_gib:.1f} GiB; "
          "the planned arena is what torch.cuda allocates for the step, test_planned_arena_is_what_torch_cuda_allocates)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "eager_peak_gib": args.eager_peak_gib, "results": results}, f, indent=1)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
