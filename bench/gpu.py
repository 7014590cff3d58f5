"""The GPU benchmark: PyTorch eager, torch.compile and ortrain on one NVIDIA GPU, in one run, with
ms/step, tokens/s, MFU and peak GPU memory (issue 6's targets).

    python -m bench.gpu [--workloads tutorial,gpt2-124m[,gpt2-124m-padded,llama-gqa]] [--systems eager,compile,ortrain[,ortrain-nographs]]
                        [--steps 50] [--warmup 10] [--gpt2-batch 16] [--gpt2-precision bf16|fp16]
                        [--worker-timeout 900] [--json PATH]

Each (workload, system) runs in its own process, one after another, so peak memory
(torch.cuda.max_memory_allocated, plus for ortrain the buffers its CUDA runtime holds outside
PyTorch's allocator: scratch, rounded gemm operands, cuBLAS's workspace) and torch.compile's
caches belong to that system alone. A step
is timed from its first line to a torch.cuda.synchronize() after optimizer.step(): what a user's
per-batch log sees. MFU counts the model FLOPs of a training step (6 per parameter per token for
the matmul weights plus 12·L·H·Q·T for attention, as nanoGPT/PaLM) against the GPU's dense peak
for the precision (tensor-core bf16 or fp16, or plain fp32 since TF32 is off). GPT-2 runs in
mixed precision: eager and torch.compile under torch.autocast (fp16 with a GradScaler), ortrain
with `precision=` the same (fp16 with the engine's dynamic loss scaler); so does llama-gqa, a
Llama-architecture model of 156M parameters with grouped-query attention (LLAMA_* below),
at half GPT-2's batch. `ortrain-nographs` is
ortrain with `cuda_graphs=False` (every kernel launched): what the CUDA graphs bring, in one run.
An ortrain system may name opt-in engine passes after `+` (`ortrain+fuse_attention+autocast`), and
passes to turn off as `+no_<pass>` (`ortrain+fuse_attention+autocast+no_recompute`): that row's
process runs with exactly those in ORTRAIN_ENABLE_PASSES and ORTRAIN_DISABLE_PASSES, so pass
variants compare in one run. `+no_flash_attention` is not a pass: it turns the FlashAttention-2-style
kernels off (ORTRAIN_FLASH_ATTENTION=0), so their rows time them against the older tensor-core ones;
`+flash_rows64` gives their forward and dQ kernels 64-row blocks (ORTRAIN_FLASH_ROWS=64) instead of
128, so its row times the two block sizes against each other.
A worker that gives no answer within --worker-timeout seconds is killed and its row reads failed;
the JSON file is rewritten after every row, so a run cut short keeps the rows it finished.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

SYSTEMS = ("eager", "compile", "ortrain")
OPTIONAL_SYSTEMS = ("ortrain-nographs",)


def split_system(name: str) -> tuple[str, list[str]]:
    """`ortrain+fuse_attention+autocast` -> ("ortrain", ["fuse_attention", "autocast"]); a pass
    written `no_recompute` is one to turn off."""
    base, *passes = name.split("+")
    return base, [p for p in passes if p]


# system parts that switch an engine kernel family rather than a pass: part -> (variable, value)
KERNEL_SWITCHES = {"no_flash_attention": ("ORTRAIN_FLASH_ATTENTION", "0"), "flash_rows64": ("ORTRAIN_FLASH_ROWS", "64")}


def pass_environment(passes: list[str]) -> dict:
    """ORTRAIN_ENABLE_PASSES / ORTRAIN_DISABLE_PASSES for a system's `+pass` and `+no_pass` parts,
    and the variables of its kernel switches (KERNEL_SWITCHES)."""
    switches = dict(KERNEL_SWITCHES[p] for p in passes if p in KERNEL_SWITCHES)
    passes = [p for p in passes if p not in KERNEL_SWITCHES]
    on = [p for p in passes if not p.startswith("no_")]
    off = [p[len("no_"):] for p in passes if p.startswith("no_")]
    return {"ORTRAIN_ENABLE_PASSES": ",".join(on), "ORTRAIN_DISABLE_PASSES": ",".join(off), **switches}
# dense peak FLOP/s by (device-name fragment, precision); TF32 stays off, so fp32 is the CUDA-core peak
PEAKS = {("H100", "bf16"): 989.4e12, ("H100", "fp16"): 989.4e12, ("H100", "fp32"): 66.9e12,
         ("H200", "bf16"): 989.4e12, ("H200", "fp16"): 989.4e12, ("H200", "fp32"): 66.9e12,
         ("A100", "bf16"): 312e12, ("A100", "fp16"): 312e12, ("A100", "fp32"): 19.5e12}


# the tutorial model's depth and width (tests/models.py: 2 layers, emsize 200)
TUTORIAL_LAYERS, TUTORIAL_WIDTH = 2, 200
# llama-gqa: a Llama-architecture model of 156M parameters (rotary embeddings, RMSNorm,
# SwiGLU, grouped-query attention: 16 query heads of 64 over 4 key/value heads), seq 1024, at
# half GPT-2's batch, bf16, AdamW, clip 1.0: the Llama family's attention (layout BHSD_K)
LLAMA_LAYERS, LLAMA_WIDTH, LLAMA_VOCAB = 8, 1024, 32000


def train_flops(model, lookup, layers: int, width: int, seq: int, tokens: int) -> float:
    """Model FLOPs of a training step (nanoGPT/PaLM): 6 per matmul weight per token, the
    `lookup` tables (embeddings that are only gathered) left out, plus 12·L·H·Q·T for attention."""
    n = sum(p.numel() for p in model.parameters()) - sum(t.numel() for t in lookup)
    return 6 * n * tokens + 12 * layers * width * seq * tokens


def _build(workload: str, gpt2_batch: int, gpt2_precision: str = "bf16", for_ortrain: bool = False):
    """(model, optimizer, batch(step), forward_loss(model, batch), clip, precision, tokens/step,
    FLOPs/step) on cuda. GPT-2's AdamW is PyTorch's fused one for eager and compile (their fastest
    step); for ortrain (`for_ortrain`) it is the plain AdamW, whose step the engine takes over with
    its own multi-tensor kernel (accelerate keeps a fused=True optimizer in PyTorch)."""
    import torch
    from torch import nn

    from bench import workloads

    dev = torch.device("cuda")
    if workload == "tutorial":
        job = workloads._build_tutorial()
        model = job.model.to(dev)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        batches = [tuple(t.to(dev) for t in job.batch(s)) for s in range(64)]
        seq, bsz = 35, 20
        tokens = seq * bsz
        lookup = [model.encoder.weight] if hasattr(model, "encoder") else []
        flops = train_flops(model, lookup, TUTORIAL_LAYERS, TUTORIAL_WIDTH, seq, tokens)
        return model, optimizer, lambda s: batches[s % len(batches)], job.forward_loss, job.clip, "fp32", tokens, flops
    if workload in ("gpt2-124m", "gpt2-124m-padded"):
        import models

        seq, bsz = 1024, gpt2_batch
        model, _, _ = models.gpt2_small(vocab=workloads.GPT2_VOCAB, n_layer=12, n_embd=768, n_head=12,
                                        n_positions=seq, dropout=0.0, batch=bsz, seq=seq, seed=0,
                                        attn_implementation="sdpa")
        model = model.to(dev)
        optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=not for_ortrain)
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randint(0, workloads.GPT2_VOCAB, (bsz, seq), generator=g).to(dev),) for _ in range(8)]
        criterion = nn.CrossEntropyLoss()
        if workload == "gpt2-124m-padded":
            batches = [(ids, *_padded(ids)) for (ids,) in batches]

        def forward_loss(m, b):
            if len(b) == 1:
                (ids,) = b
                logits = m(ids).logits
                return criterion(logits[:, :-1].reshape(-1, workloads.GPT2_VOCAB), ids[:, 1:].reshape(-1))
            ids, mask, targets = b
            logits = m(ids, attention_mask=mask).logits
            return criterion(logits[:, :-1].reshape(-1, workloads.GPT2_VOCAB), targets.reshape(-1))

        tokens = seq * bsz
        # wte counts: it is the tied LM head
        flops = train_flops(model, [model.transformer.wpe.weight], 12, 768, seq, tokens)
        return model, optimizer, lambda s: batches[s % len(batches)], forward_loss, None, gpt2_precision, tokens, flops
    if workload == "llama-gqa":
        import transformers

        seq, bsz = 1024, max(gpt2_batch // 2, 1)
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=LLAMA_WIDTH, intermediate_size=2816,
                                       num_hidden_layers=LLAMA_LAYERS, num_attention_heads=16, num_key_value_heads=4,
                                       max_position_embeddings=seq, use_cache=False, attn_implementation="sdpa")
        model = transformers.LlamaForCausalLM(cfg).to(dev)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=not for_ortrain)
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randint(0, LLAMA_VOCAB, (bsz, seq), generator=g).to(dev),) for _ in range(8)]
        criterion = nn.CrossEntropyLoss()

        def llama_loss(m, b):
            (ids,) = b
            logits = m(ids).logits
            return criterion(logits[:, :-1].reshape(-1, LLAMA_VOCAB), ids[:, 1:].reshape(-1))

        tokens = seq * bsz
        flops = train_flops(model, [model.model.embed_tokens.weight], LLAMA_LAYERS, LLAMA_WIDTH, seq, tokens)
        return model, optimizer, lambda s: batches[s % len(batches)], llama_loss, 1.0, gpt2_precision, tokens, flops
    raise SystemExit(f"unknown workload {workload!r}; known: tutorial, gpt2-124m, gpt2-124m-padded, llama-gqa")


def _padded(ids):
    """gpt2-124m-padded's attention_mask and targets for a batch of ids: as a collator of
    variable-length texts gives them, row r right-padded by (37·r) mod 200 positions, row 0
    left-padded by 100 (its first queries see no key); padded positions' targets ignored (-100)."""
    import torch

    bsz, seq = ids.shape
    mask = torch.ones_like(ids)
    for r in range(bsz):
        pad = (37 * r) % 200
        if pad:
            mask[r, seq - pad:] = 0
    mask[0, :100] = 0
    targets = torch.where(mask[:, 1:] == 1, ids[:, 1:], torch.full_like(ids[:, 1:], -100))
    return mask, targets


def _worker(cfg: dict) -> dict:
    import contextlib

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    system, passes = split_system(cfg["system"])
    model, optimizer, batch, forward_loss, clip, precision, tokens, flops = _build(
        cfg["workload"], cfg["gpt2_batch"], cfg.get("gpt2_precision", "bf16"), for_ortrain=system.startswith("ortrain"))
    if passes:
        # read when the engine builds a session, so set before accelerate
        os.environ.update(pass_environment(passes))
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    autocast = (lambda: torch.autocast("cuda", dtype=half)) if half is not None else contextlib.nullcontext
    # PyTorch's fp16 recipe scales the loss; ortrain's engine does it inside (accelerate's loss_scale)
    grad_scaler = torch.amp.GradScaler("cuda") if precision == "fp16" and not system.startswith("ortrain") else None
    if system == "compile":
        model = torch.compile(model)
    elif system in ("ortrain", "ortrain-nographs"):
        import ortrain

        try:
            # strict: a fallback to PyTorch is an error here, never a row timed as ortrain
            ortrain.accelerate(model, optimizer, device="cuda", strict=True, cuda_graphs=system == "ortrain",
                               **({"precision": precision} if precision != "fp32" else {}))
        except Exception as exc:  # noqa: BLE001 - reported as the row's status
            return {"status": "unsupported", "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
        autocast = contextlib.nullcontext
    model.train()

    def step(s):
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = forward_loss(model, batch(s))
        if grad_scaler is not None:
            grad_scaler.scale(loss).backward()
            if clip is not None:
                grad_scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            grad_scaler.step(optimizer)
            grad_scaler.update()
            return loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        return loss

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    losses = []  # every step's loss, read after the timed steps (no sync inside them)
    t0 = time.perf_counter()
    if system.startswith("ortrain"):
        from ortrain.errors import OrtrainError

        try:
            losses.append(step(0).detach())
        except OrtrainError as exc:
            return {"status": "unsupported", "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    else:
        losses.append(step(0).detach())
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for s in range(1, cfg["warmup"]):
        losses.append(step(s).detach())
    times = []
    for s in range(cfg["warmup"], cfg["warmup"] + cfg["steps"]):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(step(s).detach())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    name = torch.cuda.get_device_name()
    peak = next((v for (frag, p), v in PEAKS.items() if frag in name and p == precision), None)
    med = statistics.median(times)
    torch_peak = torch.cuda.max_memory_allocated()
    own = 0  # ortrain's runtime buffers live outside PyTorch's allocator: counted here, not hidden
    attention = []  # explain()'s lines on the fused attentions' kernels (flash or not, mask read or not)
    if system.startswith("ortrain"):
        from ortrain import _ortrain

        own = _ortrain.cuda_runtime_bytes()
        try:
            attention = [ln.strip() for ln in ortrain.explain(model).splitlines() if ln.strip().startswith("fused attention")]
        except Exception as exc:  # noqa: BLE001 - a row is never lost to its description
            attention = [f"fused attention: explain() failed: {type(exc).__name__}: {exc}"]
    return {"status": "ok", "device": name, "precision": precision, "tokens": tokens, "flops": flops,
            "median_ms": med * 1e3, "p10_ms": _q(times, 0.1) * 1e3, "p90_ms": _q(times, 0.9) * 1e3,
            "first_s": first, "tokens_per_s": tokens / med, "mfu": (flops / med / peak) if peak else None,
            "peak_mib": (torch_peak + own) / 2**20, "torch_peak_mib": torch_peak / 2**20, "runtime_mib": own / 2**20,
            "final_loss": float(losses[-1]), "losses": [float(x) for x in losses], "times": times, "attention": attention}


def _q(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _table(results: dict, workloads: list, systems: list) -> str:
    lines = []
    wd = max([16] + [len(s) for s in systems])
    for w in workloads:
        rows = results[w]
        eager = rows.get("eager", {}).get("median_ms") if rows.get("eager", {}).get("status") == "ok" else None
        comp = rows.get("compile", {}).get("median_ms") if rows.get("compile", {}).get("status") == "ok" else None
        lines.append(f"\n{w}")
        lines.append(f"{'system':<{wd}} {'ms/step':>9} {'p10':>8} {'p90':>8} {'tok/s':>10} {'MFU':>6} "
                     f"{'peak MiB':>9} {'first s':>8} {'vs eager':>9} {'vs compile':>10} {'loss':>8}")
        for s in systems:
            r = rows.get(s, {})
            if r.get("status") != "ok":
                lines.append(f"{s:<{wd}} {r.get('status', 'missing')}: {r.get('error', '')}")
                continue
            m = r["median_ms"]
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
            ve = f"{eager / m:.2f}x" if eager else "-"
            vc = f"{comp / m:.2f}x" if comp else "-"
            lines.append(f"{s:<{wd}} {m:>9.2f} {r['p10_ms']:>8.2f} {r['p90_ms']:>8.2f} {r['tokens_per_s']:>10.0f} "
                         f"{mfu:>6} {r['peak_mib']:>9.0f} {r['first_s']:>8.2f} {ve:>9} {vc:>10} {r['final_loss']:>8.4f}")
    return "\n".join(lines)


def _run_worker(cfg: dict, env: dict, cwd: str, timeout: float) -> dict:
    """One (workload, system) in its own process: its result, or a failed row saying why."""
    try:
        p = subprocess.run([sys.executable, "-m", "bench.gpu", "--worker", json.dumps(cfg)], env=env,
                           capture_output=True, text=True, cwd=cwd, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-2000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"status": "failed", "error": f"no answer in {timeout:.0f} s (--worker-timeout): {tail}"}
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("@@RESULT ")), None)
    if line:
        return json.loads(line[len("@@RESULT "):])
    return {"status": "failed", "error": f"worker exited {p.returncode}: {p.stderr[-2000:]}"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="tutorial,gpt2-124m")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--gpt2-batch", type=int, default=16)
    ap.add_argument("--gpt2-precision", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--worker-timeout", type=float, default=900.0,
                    help="seconds a (workload, system) process may take before its row reads failed")
    ap.add_argument("--json", default=None, help="where to write the raw results (rewritten after every row)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        try:
            out = _worker(json.loads(a.worker))
        except Exception as exc:  # noqa: BLE001
            out = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        print("@@RESULT " + json.dumps(out), flush=True)
        return 0
    workloads = a.workloads.split(",")
    systems = a.systems.split(",")
    unknown = [s for s in systems if split_system(s)[0] not in SYSTEMS + OPTIONAL_SYSTEMS
               or (split_system(s)[1] and not s.startswith("ortrain"))]
    if unknown:
        ap.error(f"--systems: {', '.join(unknown)} not among {', '.join(SYSTEMS + OPTIONAL_SYSTEMS)}"
                 " (ortrain systems may add opt-in passes after '+', e.g. ortrain+fuse_attention)")
    results: dict = {w: {} for w in workloads}
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), os.path.join(os.path.dirname(here), "tests"),
                                                       os.environ.get("PYTHONPATH", "")]))
    for w in workloads:
        for s in systems:
            cfg = {"workload": w, "system": s, "steps": a.steps, "warmup": a.warmup, "gpt2_batch": a.gpt2_batch,
                   "gpt2_precision": a.gpt2_precision}
            t0 = time.time()
            r = _run_worker(cfg, env, os.path.dirname(here), a.worker_timeout)
            if r.get("trace"):
                print(r["trace"], file=sys.stderr)
            results[w][s] = r
            print(f"{w}/{s}: {r.get('status')} {r.get('median_ms', '')} ({time.time() - t0:.0f} s)", flush=True)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(results, f)
    print(_table(results, workloads, systems))
    for w in workloads:
        for s in systems:
            losses = results[w][s].get("losses") or []
            if losses:
                print(f"{w}/{s} loss every 5 steps: " + " ".join(f"{x:.3f}" for x in losses[::5] + losses[-1:]))
            for line in results[w][s].get("attention") or []:
                print(f"{w}/{s} {line}")
    # "unsupported" is an answer (ortrain without a CUDA executor); "failed" is a broken row
    return 1 if any(r.get("status") == "failed" for rows in results.values() for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
