"""Where a GPU training step's time goes, for ortrain and PyTorch eager: torch.profiler (CUPTI)
records every kernel on the device, ortrain's NVRTC kernels and cuBLAS calls included.

    python -m bench.gpu_profile [--workload tutorial|gpt2-124m] [--system ortrain|eager] [--steps 5]

Prints the wall time per step, the GPU-busy time per step (sum of kernel times; the rest is the
host launching work or waiting), the number of kernels per step, and the kernels that take the
most GPU time.
"""
from __future__ import annotations

import argparse
import collections
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_profile")
    ap.add_argument("--workload", default="tutorial")
    ap.add_argument("--system", default="ortrain")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--gpt2-batch", type=int, default=16)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args(argv)
    from bench.gpu import _build

    torch.backends.cuda.matmul.allow_tf32 = False
    model, opt, batch, forward_loss, clip, precision, tokens, flops = _build(a.workload, a.gpt2_batch, for_ortrain=a.system == "ortrain")
    import contextlib

    autocast = contextlib.nullcontext
    if a.system == "ortrain":
        import ortrain

        # the same precision as bench/gpu.py gives the ortrain row
        ortrain.accelerate(model, opt, device="cuda", strict=True, **({"precision": precision} if precision != "fp32" else {}))
    elif precision == "bf16":
        autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731

    def step(s):
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = forward_loss(model, batch(s))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()

    for s in range(3):
        step(s)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for s in range(a.steps):
            step(s)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / a.steps
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    busy = sum(v[1] for v in by_name.values()) / 1e3 / a.steps
    print(f"{a.workload} / {a.system}: wall {wall * 1e3:.2f} ms/step, GPU busy {busy:.2f} ms/step "
          f"({100 * busy / (wall * 1e3):.0f}%), {len(kernels) / a.steps:.0f} kernels/step")
    print(f"{'kernel':<70} {'calls/step':>10} {'ms/step':>9} {'share':>6}")
    for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:a.top]:
        print(f"{name[:70]:<70} {n / a.steps:>10.1f} {us / 1e3 / a.steps:>9.3f} {100 * us / 1e3 / a.steps / busy:>5.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
