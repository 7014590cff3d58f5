"""fp32 vs bf16 on the tutorial step, side by side in one process: PyTorch eager fp32, PyTorch
autocast bf16, ortrain fp32 and ortrain bf16 (`accelerate(..., precision="bf16")`), each from the
same start on the same batches (the nn.Transformer tutorial model: emsize 200, nhid 200, 2
layers, 2 heads, dropout 0.2, bptt 35, batch 20, Adam lr 1e-3, clip 0.5). The systems take turns
in blocks of `--block` steps, so machine load drifts hit all four alike (turns of single steps
were slower for everyone: each runtime's idle threads spin for a while after its parallel
regions, PyTorch's OpenMP ones and the engine's rayon ones, and steal the other's cores); the
first two steps of each block are not timed. Prints the median ms/step of each system and the
mean loss of its last steps.

    python bench/tutorial_bf16.py [--steps 60] [--block 10] [--vocab 28782]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
import text_data  # noqa: E402

SYSTEMS = ("torch eager fp32", "torch autocast bf16", "ortrain fp32", "ortrain bf16")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--block", type=int, default=10, help="steps per turn")
    ap.add_argument("--vocab", type=int, default=0, help="cap the vocabulary (0: the text's own)")
    args = ap.parse_args()
    import ortrain
    from ortrain import _ortrain

    text, source = text_data.load_text()
    ids, vocab = text_data.tokenize(text)
    ntokens = len(vocab)
    if args.vocab:
        ids, ntokens = ids.clamp_max(args.vocab - 1), args.vocab
    data = text_data.batchify(ids, 20)
    torch.manual_seed(0)
    base, _, _ = models.tutorial_transformer(ntokens, dropout=0.2)
    print(f"data: {source}, vocabulary {ntokens:,}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"CPU bf16 matmuls: {_ortrain.cpu_bf16() or 'none (bf16 mode runs fp32)'}")
    crit = torch.nn.CrossEntropyLoss()
    runs = {}
    for name in SYSTEMS:
        model = copy.deepcopy(base).train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        if name.startswith("ortrain"):
            ortrain.accelerate(model, opt, precision=name.split()[-1])
        runs[name] = (model, opt, [], [])
    batches, i = [], 0
    for _ in range(args.steps):
        if i >= data.size(0) - 2:
            i = 0
        batches.append(text_data.get_batch(data, i))
        i += batches[-1][0].size(0)
    for start in range(0, args.steps, args.block):
        for name in SYSTEMS:
            model, opt, times, losses = runs[name]
            for k, (x, y) in enumerate(batches[start:start + args.block]):
                t0 = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name == "torch autocast bf16"):
                    loss = crit(model(x).view(-1, ntokens), y)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                if k >= 2:
                    times.append((time.perf_counter() - t0) * 1e3)
                losses.append(loss.item())
        print(f"  steps {start + 1:4d}-{start + args.block}: "
              + "  ".join(f"{n} {statistics.median(r[2][-(args.block - 2):]):6.1f}" for n, r in runs.items()), flush=True)
    print(ortrain.explain(runs["ortrain bf16"][0]))
    print()
    ref = statistics.median(runs["torch eager fp32"][2])
    print(f"{'system':22s} {'median ms/step':>15s} {'vs eager':>9s} {'last-10 loss':>13s}")
    for name, (_, _, times, losses) in runs.items():
        med = statistics.median(times)
        print(f"{name:22s} {med:15.1f} {ref / med:8.2f}x {sum(losses[-10:]) / 10:13.3f}")


if __name__ == "__main__":
    main()
