"""Hugging Face's Trainer as its users run it, side by side: the `gpt2` workload's model
(GPT2LMHeadModel, 2 layers, n_embd 256, vocabulary 50,257, seq 128 x batch 4, dropout 0.1)
trained by `Trainer.train()` with its own AdamW (fused on the CPU), linear LR schedule,
`labels=` loss and gradient clipping at 1.0:

- eager: the model as it is;
- compile: `TrainingArguments(torch_compile=True)` (the Trainer compiles the model);
- ortrain: `ortrain.accelerate(model)` before the Trainer is made (the engine takes the
  Trainer's AdamW at its first step, ortrain/late_optimizer.py).

Each system runs in a fresh process of its own. A TrainerCallback times each step
(on_step_begin to on_step_end: forward, backward, clipping, optimizer and scheduler steps;
the Trainer's per-step logging calls `.item()` inside it). Medians over the timed steps after
the warm-up ones, ratios against eager and torch.compile, peak RSS and its growth over the
process after its imports.

    python -m bench.hf_trainer [--steps 20] [--warmup 3] [--systems eager,compile,ortrain] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VOCAB, SEQ, BATCH = 50257, 128, 4
SYSTEMS = ("eager", "compile", "ortrain")


def _child(system: str, steps: int, warmup: int) -> dict:
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from bench.worker import _peak_rss_mib, _rss_mib

    transformers.logging.set_verbosity_error()
    rss_after_import = _rss_mib()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_layer=2, n_embd=256, n_head=4, n_positions=SEQ, resid_pdrop=0.1,
                     embd_pdrop=0.1, attn_pdrop=0.1, attn_implementation="sdpa")
    model = GPT2LMHeadModel(cfg)
    if system == "ortrain":
        import ortrain

        ortrain.accelerate(model)
    total = steps + warmup
    ids = torch.randint(0, VOCAB, (total * BATCH, SEQ), generator=torch.Generator().manual_seed(1))

    class Texts(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    times: list = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append((time.perf_counter() - self.start) * 1e3)

    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=BATCH, max_steps=total,
                             logging_steps=1, report_to=[], save_strategy="no", learning_rate=1e-3, use_cpu=True,
                             seed=0, max_grad_norm=1.0, disable_tqdm=True, dataloader_num_workers=0,
                             torch_compile=system == "compile")
    trainer = Trainer(model=model, args=args, train_dataset=Texts(), callbacks=[Clock()])
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    out = {"system": system, "step_ms": times[warmup:], "first_step_ms": times[0], "losses": losses,
           "train_s": wall, "peak_rss_mib": _peak_rss_mib(), "rss_after_import_mib": rss_after_import}
    if system == "ortrain":
        import ortrain

        out["explain"] = ortrain.explain(model).splitlines()[0]
    return out


def _run_system(system: str, steps: int, warmup: int, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), ORTRAIN_EXPORT_CACHE_DIR=tempfile.mkdtemp())
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "bench.hf_trainer", "--child", system, "--steps", str(steps),
                           "--warmup", str(warmup)], capture_output=True, text=True, env=env, cwd=repo)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"system": system, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1],
                "stderr": proc.stderr[-3000:]}
    return json.loads(lines[-1])


def _table(results: dict) -> str:
    medians = {s: statistics.median(r["step_ms"]) for s, r in results.items() if "step_ms" in r}
    head = (f"== Hugging Face Trainer: GPT2LMHeadModel (2 layers, n_embd 256), vocab {VOCAB}, seq {SEQ} x batch "
            f"{BATCH}, AdamW (Trainer's), labels= loss, clip 1.0\n"
            f"{'system':8s} {'median ms':>10s} {'p10':>8s} {'p90':>8s} {'x eager':>8s} {'x compile':>9s} "
            f"{'first step s':>12s} {'peak RSS MiB':>12s} {'growth MiB':>10s} {'last loss':>9s}")
    rows = [head]
    for system, r in results.items():
        if "step_ms" not in r:
            rows.append(f"{system:8s} ERROR: {r['error']}")
            continue
        xs = sorted(r["step_ms"])
        p10, p90 = xs[int(0.1 * (len(xs) - 1))], xs[int(round(0.9 * (len(xs) - 1)))]
        med = medians[system]
        ratio = {ref: (f"{medians[ref] / med:.2f}" if ref in medians else "-") for ref in ("eager", "compile")}
        rows.append(f"{system:8s} {med:10.1f} {p10:8.1f} {p90:8.1f} {ratio['eager']:>8s} {ratio['compile']:>9s} "
                    f"{r['first_step_ms'] / 1e3:12.2f} {r['peak_rss_mib']:12.0f} "
                    f"{r['peak_rss_mib'] - r['rss_after_import_mib']:10.0f} {r['losses'][-1]:9.4f}")
        if "explain" in r:
            rows.append(f"         {r['explain']}")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hf_trainer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per system (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps per system (default 3)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of eager, compile, ortrain")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch/engine threads (default: all cores)")
    ap.add_argument("--json", help="write the raw per-step times here")
    ap.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.steps < 1 or a.warmup < 1:
        ap.error("--steps and --warmup must be at least 1")
    if a.child:
        print(json.dumps(_child(a.child, a.steps, a.warmup)))
        return 0
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"--systems: {', '.join(unknown)} not one of {', '.join(SYSTEMS)}")
    results = {}
    for system in systems:
        print(f"bench.hf_trainer: {system} ...", file=sys.stderr, flush=True)
        results[system] = _run_system(system, a.steps, a.warmup, a.threads)
    print(_table(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all("step_ms" in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
