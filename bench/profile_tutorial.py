"""The engine's per-op profile of the tutorial step (vocab 28782, seq 35 x batch 20, Adam, clip
0.5, dropout 0.2) on the user's own loop: median step time and `ortrain.explain(model,
profile=True)`. `--before` turns the graph passes and the fused loss off (the engine as it was
before them), for before/after comparisons in one build.

    python bench/profile_tutorial.py [--before] [--steps 25] [--precision bf16]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the bench package


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--before", action="store_true", help="passes off (ORTRAIN_DISABLE_PASSES=all), loss in PyTorch")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="accelerate(precision=...)")
    args = ap.parse_args()
    if args.before:
        os.environ["ORTRAIN_DISABLE_PASSES"] = "all"
    import torch

    import models
    import ortrain

    from bench.host_overhead import timed_step

    torch.set_num_threads(args.threads)
    vocab = 28782
    torch.manual_seed(0)
    model, _, _ = models.tutorial_transformer(vocab, dropout=0.2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = torch.nn.CrossEntropyLoss()
    ortrain.accelerate(model, opt, fuse_loss=not args.before, precision=args.precision)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (35, 20), generator=g)
    y = torch.randint(0, vocab, (700,), generator=g)
    times = []
    phases = {name: [] for name in ("zero_grad", "model(x)", "criterion", "backward", "clip_grad_norm_", "optimizer.step")}
    for step in range(args.steps):
        if step == 3:
            ortrain.reset_profile(model)
        t = timed_step(model, opt, crit, x, y, vocab)
        times.append((t[-1] - t[0]) * 1e3)
        if step >= 3:
            for name, a, b in zip(phases, t, t[1:]):
                phases[name].append((b - a) * 1e3)
    label = "before (passes off, loss in PyTorch)" if args.before else "after"
    print(f"{label}: median step {statistics.median(times[3:]):.1f} ms over {args.steps - 3} steps")
    # with the loss fused, the engine's forward runs inside criterion(): model(x) returns a lazy output
    print("  the loop's phases (medians, ms): "
          + ", ".join(f"{name} {statistics.median(v):.1f}" for name, v in phases.items()))
    print(ortrain.explain(model, profile=True))


if __name__ == "__main__":
    main()
