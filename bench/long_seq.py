"""GPT-2 at a long sequence on the CPU (Hugging Face GPT2LMHeadModel, sdpa attention, dropout
0.1 everywhere, vocabulary 50,257, shifted LM loss, AdamW): PyTorch eager and ortrain from the
same weights on the same batch in one process, median ms/step and their ratio, and the planned
peak arena of ortrain's graphs (`explain`). Where the attention's [T, S] scores dominate the
memory: compare the fused attention with `ORTRAIN_DISABLE_PASSES=fuse_attention`.

    python bench/long_seq.py [--seq 1024] [--layers 2] [--batch 2] [--steps 10] [--warmup 3]
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

VOCAB = 50257


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per system")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    import models
    import ortrain

    torch.set_num_threads(args.threads)
    base, _, _ = models.gpt2_small(vocab=VOCAB, n_layer=args.layers, n_embd=256, n_head=4, n_positions=args.seq, dropout=0.1,
                                   batch=args.batch, seq=args.seq, seed=0, attn_implementation="sdpa")
    ids = torch.randint(0, VOCAB, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    medians = {}
    for name in ("eager", "ortrain"):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if name == "ortrain":
            ortrain.accelerate(model, opt)
        times = []
        for _ in range(args.warmup + args.steps):
            t = time.perf_counter()
            logits = model(ids).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t)
        medians[name] = statistics.median(times[args.warmup:]) * 1e3
        if name == "ortrain":
            # "plan for inputs ...: peak arena X MiB" (the model's graph), "loss graph ...; peak
            # arena Y MiB" (the graph with the loss fused, which the steps above ran)
            arenas = [(line.strip().split(":")[0].split(" (")[0], m.group(1)) for line in ortrain.explain(model, ids).splitlines()
                      if (m := re.search(r"peak arena ([\d.]+ MiB)", line))]
    off = os.environ.get("ORTRAIN_DISABLE_PASSES", "")
    print(f"GPT-2 {args.layers} layers, seq {args.seq} x batch {args.batch}, dropout 0.1"
          f"{f', ORTRAIN_DISABLE_PASSES={off}' if off else ''}: eager {medians['eager']:.1f} ms, "
          f"ortrain {medians['ortrain']:.1f} ms ({medians['eager'] / medians['ortrain']:.2f}x eager), "
          f"medians of {args.steps} steps after {args.warmup}")
    for graph, arena in arenas:
        print(f"  {graph}: planned peak arena {arena}")


if __name__ == "__main__":
    main()
