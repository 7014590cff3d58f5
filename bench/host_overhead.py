"""The host's share of a training step: the tutorial model's loop (forward, loss, backward,
clip_grad_norm_ 0.5, Adam) phase by phase, PyTorch eager and ortrain in one process, each phase
timed on the host as the user's code sees it (no synchronisation inside the step).

On the GPU the step is queued: a phase's host time is what the Python and the launches cost, and
`wall` (the step timed to a torch.cuda.synchronize() after it) against `host` (the same step's
Python, start to optimizer.step() returning) says whether the step waits on the host or on the
GPU. Issue 6 wants the tutorial at 3x eager on the GPU: that needs the host well under a third
of eager's step too. On the CPU the default model is shrunk (vocab 100, width 16: `--vocab`,
`--width`) so that the engine's compute is small and what is left is the Python around it.

    python -m bench.host_overhead [--device cpu|cuda] [--steps 300] [--vocab V] [--width W] [--profile N]

Prints one row per system: the median milliseconds of each phase, host, wall, and ortrain's
ratios to eager. `--profile N` then runs N more ortrain steps under cProfile and prints the
functions with the most own time, in microseconds a step: which of the host's calls (the
engine's, ortrain's Python, torch's) the step waits on. cProfile's own cost inflates functions
called many times; read it for where the time goes, the table above for how much there is.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

PHASES = ("zero_grad", "model", "loss", "backward", "clip", "step")


def _model(vocab: int, width: int, device: str):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import torch

    import models

    model, _, _ = models.tutorial_transformer(vocab, dropout=0.2, emsize=width, nhid=width)
    return model.to(device)


def timed_step(model, opt, crit, data, targets, vocab: int, sync=None) -> list:
    """One step of the tutorial's loop (zero_grad, model, criterion, backward, clip_grad_norm_
    0.5, step): time.perf_counter() at its start and after each of PHASES, then, with `sync`
    (called before the step and after it), once more after the closing sync."""
    import torch

    if sync:
        sync()
    t = [time.perf_counter()]
    opt.zero_grad(set_to_none=True)
    t.append(time.perf_counter())
    out = model(data)
    t.append(time.perf_counter())
    loss = crit(out.view(-1, vocab), targets)
    t.append(time.perf_counter())
    loss.backward()
    t.append(time.perf_counter())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    t.append(time.perf_counter())
    opt.step()
    t.append(time.perf_counter())
    if sync:
        sync()
        t.append(time.perf_counter())
    return t


def _measure(model, opt, data, targets, vocab: int, steps: int, warmup: int, cuda: bool) -> dict:
    import torch

    crit = torch.nn.CrossEntropyLoss()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for i in range(warmup + steps):
        t = timed_step(model, opt, crit, data, targets, vocab, sync)
        if i >= warmup:
            rows.append([b - a for a, b in zip(t, t[1:-1])] + [t[-2] - t[0], t[-1] - t[0]])
    return {name: statistics.median(col) * 1e3 for name, col in zip(PHASES + ("host", "wall"), zip(*rows))}


def _profile(model, opt, data, targets, vocab: int, steps: int, cuda: bool, top: int = 25) -> list:
    """(µs a step of own time, calls a step, function) of the `top` functions with the most own
    time over `steps` steps run under cProfile."""
    import cProfile
    import pstats

    import torch

    crit = torch.nn.CrossEntropyLoss()
    sync = torch.cuda.synchronize if cuda else None
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        timed_step(model, opt, crit, data, targets, vocab, sync)
    prof.disable()
    rows = []
    for (path, line, name), (_, calls, own, _, _) in pstats.Stats(prof).stats.items():
        short = name if path == "~" else f"{'/'.join(path.split('/')[-3:])}:{line}({name})"
        rows.append((own / steps * 1e6, calls / steps, short))
    return sorted(rows, reverse=True)[:top]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=None, help="default: 100 on the CPU, 28782 (the tutorial's) on the GPU")
    ap.add_argument("--width", type=int, default=None, help="emsize = nhid; default: 16 on the CPU, 200 on the GPU")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then N ortrain steps under cProfile: the functions with the most own time")
    args = ap.parse_args(argv)
    import torch

    import ortrain

    cuda = args.device == "cuda"
    vocab = args.vocab or (28782 if cuda else 100)
    width = args.width or (200 if cuda else 16)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, vocab, (35, 20), generator=g).to(args.device)
    targets = torch.randint(0, vocab, (700,), generator=g).to(args.device)
    results = {}
    for system in ("eager", "ortrain"):
        torch.manual_seed(0)
        model = _model(vocab, width, args.device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        if system == "ortrain":
            ortrain.accelerate(model, opt, device=args.device, strict=True)
        results[system] = _measure(model, opt, data, targets, vocab, args.steps, args.warmup, cuda)
    profiled = _profile(model, opt, data, targets, vocab, args.profile, cuda) if args.profile > 0 else []
    print(f"tutorial-shaped model, vocab {vocab}, width {width}, seq 35 x batch 20, Adam, clip 0.5, on {args.device}; "
          f"medians of {args.steps} steps, ms")
    cols = PHASES + ("host", "wall")
    print(f"{'system':<9}" + "".join(f"{c:>10}" for c in cols))
    for system, r in results.items():
        print(f"{system:<9}" + "".join(f"{r[c]:>10.3f}" for c in cols))
    e, o = results["eager"], results["ortrain"]
    print(f"{'eager/ort':<9}" + "".join(f"{e[c] / o[c]:>9.2f}x" if o[c] > 0 else f"{'-':>10}" for c in cols))
    if profiled:
        print(f"ortrain's step under cProfile ({args.profile} steps): own time by function")
        print(f"{'us/step':>9}{'calls/step':>12}  function")
        for us, calls, name in profiled:
            print(f"{us:>9.1f}{calls:>12.1f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
