"""`python -m bench`: PyTorch eager, torch.compile and ortrain side by side on each workload, in
one run; prints a table per workload and writes the raw per-step times to a JSON file.

    python -m bench                              # all workloads, all systems, 60 timed steps each
    python -m bench --quick                      # CI: 1 warm-up + 2 timed steps, one round
    python -m bench --workloads tutorial,gpt2 --systems eager,ortrain --steps 100 --threads 2
    python -m bench --workloads tutorial --busy-core 1:0.5   # another tenant takes half of core 1

Run it from the repository root (ortrain importable, e.g. PYTHONPATH=pyext/python or the wheel
installed). Details and the last results: bench/README.md.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time

from bench import busy_core, machine, report
from bench.pool import REPO
from bench.rounds import log_stderr, run_workload
from bench.systems import SYSTEMS
from bench.workloads import WORKLOADS

QUICK = {"steps": 2, "warmup": 1, "rounds": 1}  # the output's shape, never its times: the fewest steps that give it
QUICK_COMPILE_WORKLOADS = ["tutorial"]  # a cold torch.compile takes 20-70 s a model on 2 cores


def _names(text: str, known, what: str) -> list:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown) or '(none given)'}; "
                                         f"known: {', '.join(known)}")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", type=lambda t: _names(t, WORKLOADS, "workload"), default=list(WORKLOADS),
                    help=f"comma list of {', '.join(WORKLOADS)} (default: all)")
    ap.add_argument("--systems", type=lambda t: _names(t, SYSTEMS, "system"), default=list(SYSTEMS),
                    help=f"comma list of {', '.join(SYSTEMS)} (default: all)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per system (default 60; --quick 2)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps before, the first reported as 'first step' (default 5; --quick 1)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="interleaved rounds the timed steps are split into (default 6; --quick 1)")
    ap.add_argument("--compile-workloads", type=lambda t: _names(t, WORKLOADS, "workload"), default=None,
                    help="workloads that torch.compile runs on; on the others its row reads SKIPPED "
                         f"(default: all; --quick: {', '.join(QUICK_COMPILE_WORKLOADS)})")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads for every system: torch.set_num_threads, OMP/MKL/RAYON_NUM_THREADS "
                         "(default: the usable cores)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the dropout masks (data and weights are fixed)")
    ap.add_argument("--json", default=None, help="where to write the results (default bench/results/<time>.json)")
    ap.add_argument("--busy-core", type=busy_core.parse, default=None, metavar="CORE:DUTY",
                    help="for the whole run, a process pinned to CORE spins for DUTY of every 4 ms, like "
                         "another tenant of a shared machine (bench/busy_core.py)")
    ap.add_argument("--quick", action="store_true", help="short CI mode: few steps, correctness of the output only")
    args = ap.parse_args(argv)
    for key, full in (("steps", 60), ("warmup", 5), ("rounds", 6)):
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else full)
    if args.compile_workloads is None:
        args.compile_workloads = QUICK_COMPILE_WORKLOADS if args.quick else list(WORKLOADS)
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1 or args.threads < 1:
        ap.error("--steps, --warmup, --rounds and --threads must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = datetime.datetime.now()
    path = args.json or os.path.join(REPO, "bench", "results", started.strftime("%Y%m%d-%H%M%S") + ".json")
    info = machine.machine_info(REPO)
    print(f"bench: {info and machine.describe(info)}")
    print(f"bench: {args.steps} timed steps in {args.rounds} round(s) after {args.warmup} warm-up, "
          f"{args.threads} threads; systems {', '.join(args.systems)}", flush=True)
    if args.busy_core:
        print(f"bench: core {args.busy_core[0]} busy {args.busy_core[1]:.0%} of the time with other work "
              "(--busy-core)", flush=True)
    doc = {"command": [sys.executable, "-m", "bench", *(argv if argv is not None else sys.argv[1:])],
           "started": started.isoformat(timespec="seconds"), "machine": info,
           "config": {k: v for k, v in vars(args).items() if k != "json"}, "workloads": {}}
    t0 = time.perf_counter()
    with busy_core.busy(*args.busy_core) if args.busy_core else contextlib.nullcontext():
        _run_workloads(args, doc, info, path, t0)
    doc["versions"] = _versions(doc)
    _write(path, doc, time.perf_counter() - t0)
    print(f"\nbench: {time.perf_counter() - t0:.0f} s; x eager / x compile = their median / this median "
          f"(> 1: faster); raw per-step times in {path}")
    return 0


def _run_workloads(args, doc: dict, info: dict, path: str, t0: float) -> None:
    for name in args.workloads:
        w = WORKLOADS[name]
        log_stderr(f"bench: {name} ...")
        load_start = os.getloadavg()[0]
        skip = {} if name in args.compile_workloads else {
            "compile": f"torch.compile runs on {', '.join(args.compile_workloads)} only (--compile-workloads)"}
        runs = run_workload(name, args.systems, steps=args.steps, warmup=args.warmup, rounds=args.rounds,
                            threads=args.threads, seed=args.seed, skip=skip, log=log_stderr)
        summaries = {s: report.summarize(r) for s, r in runs.items()}
        report.add_ratios(summaries)
        entry = report.workload_json(w.title, w.precision, runs, summaries)
        entry["loadavg_1min"] = {"start": load_start, "end": os.getloadavg()[0]}
        doc["workloads"][name] = entry
        print("\n" + report.table(name, w.title, entry["params"], runs, summaries), flush=True)
        print(f"(load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, "
              f"{info['usable_cores']} cores: above that, other work shared them)", flush=True)
        _write(path, doc, time.perf_counter() - t0)


def _versions(doc: dict) -> dict:
    out: dict = {}
    for w in doc["workloads"].values():
        for s in w["systems"].values():
            out.update(s["versions"])
    return out


def _write(path: str, doc: dict, wall_s: float) -> None:
    doc["wall_s"] = round(wall_s, 1)
    doc["machine"]["loadavg_at_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
