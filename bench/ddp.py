"""Data-parallel training, PyTorch eager vs torch.compile vs ortrain, in one torchrun run.

    python -m bench.ddp [--ranks 2] [--threads 1] [--steps 30] [--warmup 5] [--wrap ddp|fsdp]
                        [--systems eager,compile,ortrain] [--workload tutorial] [--json PATH]

Starts `--ranks` processes with torchrun (gloo, CPU; as Spark's TorchDistributor starts them
in local mode), each with `--threads` threads. Every rank trains the workload (bench/workloads.py)
with each system in turn, wrapped in DistributedDataParallel (`--wrap fsdp`: FSDP2's
fully_shard on each transformer layer and on the model, the optimizer over the shards; ortrain
accelerates the sharded model), from the same initial weights,
rank r on batches r, r + ranks, r + 2 ranks, ... of the workload's stream, so that the ranks
together train on what one process would. A step is the user's loop (zero_grad, forward + loss,
backward with DDP's all-reduce, clip_grad_norm_ where the workload clips, optimizer.step(),
loss.item()); rank 0 prints the median step time over the timed steps (the slowest rank's
time: DDP's all-reduce makes the ranks wait for each other), tokens per second over all ranks,
the ratios to eager and to torch.compile, and the final loss. Timings on shared machines drift
±10%: compare the ratios of one run, never absolute times across runs.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("eager", "compile", "ortrain")


#: the modules `--wrap fsdp` shards one by one (then the whole model): the workloads' layers
_LAYERS = ("TransformerEncoderLayer", "GPT2Block", "BertLayer")


def _wrap(model, optimizer, wrap: str):
    """(the model DDP or FSDP2 trains, its optimizer)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    if wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for m in list(model.modules()):
            if type(m).__name__ in _LAYERS:
                fully_shard(m)
        fully_shard(model)
        # fully_shard made new (DTensor) parameters: the optimizer is made again over them
        accepted = inspect.signature(type(optimizer)).parameters
        rebuilt = type(optimizer)(model.parameters(), **{k: v for k, v in optimizer.defaults.items() if k in accepted})
        return model, rebuilt
    with warnings.catch_warnings():
        # torch 2.15 deprecates the flag, but its replacement still syncs buffers at init
        warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
        # broadcast_buffers=False: the tutorial model's `pe` buffer is a transposed view, which
        # DDP's buffer broadcast cannot write into (eager DDP fails the same way); every rank
        # builds the same buffers and weights from the workload's seed
        return DDP(model, broadcast_buffers=False), optimizer


def _train(system: str, workload: str, steps: int, warmup: int, wrap: str) -> dict:
    """One system's run on this rank: per-step times (seconds) and losses."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench import systems as bench_systems
    from bench.workloads import WORKLOADS

    rank, size = dist.get_rank(), dist.get_world_size()
    w = WORKLOADS[workload]
    job = w.build()
    model = job.model
    # bf16: autocast around forward + loss for eager and compile, precision="bf16" for ortrain
    autocast = contextlib.nullcontext if system == "ortrain" else bench_systems._autocast(w.precision)
    optimizer = job.optimizer
    if system == "ortrain" and wrap == "ddp":
        import ortrain

        kwargs = {} if w.precision == "fp32" else {"precision": w.precision}
        ortrain.accelerate(model, optimizer, strict=True, **kwargs)
    model, optimizer = _wrap(model, optimizer, wrap)
    if system == "ortrain" and wrap == "fsdp":
        import ortrain

        kwargs = {} if w.precision == "fp32" else {"precision": w.precision}
        ortrain.accelerate(model, optimizer, strict=True, **kwargs)
    if system == "compile":
        model = torch.compile(model)
    times, losses = [], []
    for step in range(warmup + steps):
        batch = job.batch(step * size + rank)
        dist.barrier()  # every rank starts the step together: its time is the step's, not a wait
        t0 = time.perf_counter()
        optimizer.zero_grad()
        with autocast():
            loss = job.forward_loss(model, batch)
        loss.backward()
        if job.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), job.clip)
        optimizer.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    tokens = sum(t.numel() for t in job.batch(0)[:1])
    return {"times": times[warmup:], "first": times[0], "losses": losses, "tokens_per_rank": tokens}


def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "tests"))  # models.py
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    out = {}
    for system in args.systems.split(","):
        try:
            out[system] = _train(system, args.workload, args.steps, args.warmup, args.wrap)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            out[system] = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"}
        dist.barrier()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if dist.get_rank() == 0:
        Path(args.json).write_text(json.dumps({"args": vars(args), "ranks": gathered}))
    dist.destroy_process_group()


def _table(result: dict) -> str:
    args, ranks = result["args"], result["ranks"]
    rows, medians = [], {}
    for system in args["systems"].split(","):
        errors = [r[system]["error"] for r in ranks if "error" in r[system]]
        if errors:
            rows.append((system, None, errors[0]))
            continue
        # a step's time is its slowest rank's
        per_step = [max(r[system]["times"][k] for r in ranks) for k in range(len(ranks[0][system]["times"]))]
        medians[system] = statistics.median(per_step)
        rows.append((system, ranks[0][system], None))
    wrapper = "FSDP2 (fully_shard)" if args.get("wrap") == "fsdp" else "DistributedDataParallel"
    lines = [f"{wrapper}, {len(ranks)} ranks x {args['threads']} thread(s), gloo; workload "
             f"{args['workload']}; median of {args['steps']} steps after {args['warmup']} warm-up",
             f"{'system':<10} {'ms/step':>9} {'tokens/s':>10} {'vs eager':>9} {'vs compile':>11} {'first step s':>13} "
             f"{'last loss':>10}"]
    for system, r0, error in rows:
        if error:
            lines.append(f"{system:<10} {error}")
            continue
        m = medians[system]
        tokens = r0["tokens_per_rank"] * len(ranks)
        ratio = lambda base: f"{medians[base] / m:.2f}x" if base in medians else "-"  # noqa: E731
        lines.append(f"{system:<10} {m * 1e3:>9.1f} {tokens / m:>10,.0f} {ratio('eager'):>9} {ratio('compile'):>11} "
                     f"{r0['first']:>13.2f} {r0['losses'][-1]:>10.4f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="threads per rank")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--workload", default="tutorial")
    p.add_argument("--wrap", choices=("ddp", "fsdp"), default="ddp",
                   help="DistributedDataParallel, or FSDP2's fully_shard on each layer and the model")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [s for s in args.systems.split(",") if s not in SYSTEMS]
    if unknown:
        p.error(f"--systems: unknown {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    if args.worker:
        _worker(args)
        return 0
    if args.json is None:
        results = ROOT / "bench" / "results"
        results.mkdir(parents=True, exist_ok=True)
        args.json = str(results / f"ddp-{time.strftime('%Y%m%d-%H%M%S')}.json")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
           "-m", "bench.ddp", "--worker", "--threads", str(args.threads), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--systems", args.systems, "--workload", args.workload, "--wrap", args.wrap, "--json", args.json]
    run = subprocess.run(cmd, env=env, cwd=ROOT)
    if run.returncode != 0:
        print(f"bench.ddp: torchrun failed ({run.returncode})", file=sys.stderr)
        return run.returncode
    print(_table(json.loads(Path(args.json).read_text())))
    print(f"(raw times: {args.json})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
