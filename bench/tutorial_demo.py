"""The demo: the PyTorch nn.Transformer tutorial model (emsize 200, nhid 200, 2 layers, 2 heads,
dropout 0.2, bptt 35, batch 20, Adam lr 1e-3, clip 0.5) trained from the same start in PyTorch
eager and in ortrain, on the same batches; prints ms/step (median) and loss for both.

    python bench/tutorial_demo.py [--steps 200]
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
import text_data  # noqa: E402


def train(model, opt, data, steps, ntokens, label):
    crit = torch.nn.CrossEntropyLoss()
    times, losses = [], []
    model.train()
    i = 0
    for step in range(steps):
        if i >= data.size(0) - 2:
            i = 0
        x, y = text_data.get_batch(data, i)
        i += x.size(0)
        t0 = time.perf_counter()
        out = model(x)
        loss = crit(out.view(-1, ntokens), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
        if (step + 1) % 50 == 0:
            print(f"  {label:8s} step {step + 1:4d}  {statistics.median(times[-50:]):7.1f} ms/step  loss {losses[-1]:.3f}", flush=True)
    return times, losses


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    import ortrain

    text, source = text_data.load_text()
    ids, vocab = text_data.tokenize(text)
    data = text_data.batchify(ids, 20)
    ntokens = len(vocab)
    torch.manual_seed(0)
    base, _, _ = models.tutorial_transformer(ntokens, dropout=0.2)
    print(f"data: {source}, {len(ids):,} tokens, vocabulary {ntokens:,}; model {sum(p.numel() for p in base.parameters()):,} parameters; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    results = {}
    for label in ("pytorch", "ortrain"):
        model = copy.deepcopy(base)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        if label == "ortrain":
            t0 = time.perf_counter()
            ortrain.accelerate(model, opt)
        torch.manual_seed(1)
        results[label] = train(model, opt, data, args.steps, ntokens, label)
        if label == "ortrain":
            print(ortrain.explain(model))
    print()
    print(f"{'system':8s} {'median ms/step':>15s} {'first step ms':>14s} {'final loss':>11s} {'ppl':>9s}")
    for label, (times, losses) in results.items():
        tail = losses[-20:]
        mean = sum(tail) / len(tail)
        print(f"{label:8s} {statistics.median(times[5:]):15.1f} {times[0]:14.1f} {mean:11.3f} {math.exp(mean):9.1f}")
    speed = statistics.median(results["pytorch"][0][5:]) / statistics.median(results["ortrain"][0][5:])
    print(f"speedup ortrain vs PyTorch eager: {speed:.2f}x (median step time; the loss is the mean of the last 20 steps)")


if __name__ == "__main__":
    main()
