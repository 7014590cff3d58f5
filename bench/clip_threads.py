"""What torch's OpenMP workers cost the engine after clip_grad_norm_: the tutorial step (vocab
28782, seq 35 x batch 20, Adam, clip 0.5, dropout 0.2) on the user's loop, phase by phase, with
  engine   clip_grad_norm_ in the engine (what accelerate() does on the CPU),
  torch    torch's own clip_grad_norm_ (ORTRAIN_ENGINE_CLIP=0): its OpenMP workers then spin
           after the clip, on the cores the engine's optimizer step needs,
  passive  torch's clip with OMP_WAIT_POLICY=passive (workers sleep at once; it must be set
           before torch starts, so each configuration runs in its own process).
The configurations take turns, `--rounds` times; the table gives the median of their medians.

    python bench/clip_threads.py [--rounds 3] [--steps 30]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONFIGS = {
    "engine": {},
    "torch": {"ORTRAIN_ENGINE_CLIP": "0"},
    "passive": {"ORTRAIN_ENGINE_CLIP": "0", "OMP_WAIT_POLICY": "passive"},
}
PHASES = ("forward+backward", "clip", "optimizer step", "step")


def worker(steps: int) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import torch

    import models
    import ortrain

    torch.set_num_threads(2)
    vocab = 28782
    model, _, _ = models.tutorial_transformer(vocab, dropout=0.2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = torch.nn.CrossEntropyLoss()
    ortrain.accelerate(model, opt)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (35, 20), generator=g)
    y = torch.randint(0, vocab, (700,), generator=g)
    rows = []
    for step in range(steps + 5):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = crit(model(x).view(-1, vocab), y)
        loss.backward()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        t2 = time.perf_counter()
        opt.step()
        loss.item()
        t3 = time.perf_counter()
        if step >= 5:
            rows.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, (t3 - t0) * 1e3))
    print(json.dumps([statistics.median(c) for c in zip(*rows)]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.steps)
        return
    results: dict = {name: [] for name in CONFIGS}
    for r in range(args.rounds):
        for name, env in CONFIGS.items():
            out = subprocess.run([sys.executable, __file__, "--worker", "--steps", str(args.steps)],
                                 env={**os.environ, **env}, capture_output=True, text=True, check=True)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
    print(f"{'config':8} " + " ".join(f"{p:>16}" for p in PHASES) + "   (ms, median of per-round medians)")
    for name, runs in results.items():
        print(f"{name:8} " + " ".join(f"{statistics.median(c):16.1f}" for c in zip(*runs)))


if __name__ == "__main__":
    main()
