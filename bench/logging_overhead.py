"""Overhead of ortrain's per-step MLflow logging on the step time of the tutorial model.

Runs the nn.Transformer tutorial step (emsize 200, nhid 200, 2 layers, 2 heads, bptt 35,
batch 20, Adam, clip 0.5; vocabulary from pydoc_data.topics) in one process, alternating blocks
of plain steps and steps under ortrain's step hooks + background logger (a real MLflow server:
$ORTRAIN_TRACKING_URI, else the embedded local one), and prints the median ms/step of both, their
ratio, and the directly measured cost of ortrain's per-step work.

    python bench/logging_overhead.py [--steps 40] [--block 5]
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch import nn


def model_and_data(vocab: int = 10001):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(200, 2, 200, 0.2)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Embedding(vocab, 200)
            self.transformer_encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.decoder = nn.Linear(200, vocab)

        def forward(self, src, mask):
            return self.decoder(self.transformer_encoder(self.encoder(src) * math.sqrt(200), mask))

    model = LM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mask = nn.Transformer.generate_square_subsequent_mask(35)
    data = torch.randint(0, vocab, (36, 20))
    return model, opt, mask, data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40, help="steps per variant")
    ap.add_argument("--block", type=int, default=5, help="steps per alternating block")
    args = ap.parse_args()

    from ortrain._runlog import Experiment, RunLog
    from ortrain._steps import StepRecorder

    model, opt, mask, data = model_and_data()
    crit = nn.CrossEntropyLoss()

    def step():
        out = model(data[:35], mask)
        loss = crit(out.view(-1, out.size(-1)), data[1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()

    for _ in range(3):
        step()  # warm-up
    exp = Experiment(None, "logging-overhead")
    run = RunLog(exp, run_name="overhead", tags={"ortrain.mode": "baseline"}, params={})
    run.start({"bench": "logging_overhead"})
    hook_cost = []

    def on_step(s):
        t = time.perf_counter()
        run.log_step(s)
        hook_cost.append((time.perf_counter() - t) * 1e3)

    plain, logged = [], []
    while len(plain) < args.steps:
        for _ in range(args.block):
            t = time.perf_counter()
            step()
            plain.append((time.perf_counter() - t) * 1e3)
        with StepRecorder([model], on_step):
            for _ in range(args.block):
                t = time.perf_counter()
                step()
                logged.append((time.perf_counter() - t) * 1e3)
    stats = run.end("FINISHED")
    p, l = statistics.median(plain), statistics.median(logged)
    print(f"plain  median {p:.1f} ms/step over {len(plain)} steps")
    print(f"logged median {l:.1f} ms/step over {len(logged)} steps (metrics sent: {stats['metrics_sent']})")
    print(f"ratio logged/plain = {l / p:.3f}; ortrain's per-step work (metrics + queueing): "
          f"median {statistics.median(hook_cost) * 1e3:.0f} µs")


if __name__ == "__main__":
    main()
