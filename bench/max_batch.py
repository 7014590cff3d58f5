"""The largest batch that fits a fixed memory budget, per system: each probe is a fresh worker
process (bench/worker.py) that builds the workload at one batch size, trains a few steps of the
user's loop and reports its peak resident memory (VmHWM); a batch fits when that peak is within
the budget. The search doubles the batch from the workload's own until a probe exceeds the
budget (or fails), then bisects between the last fit and the first miss.

    python -m bench.max_batch [--workload tutorial] [--budget-mib 2048] [--systems eager,ortrain]

The budget is on the whole process's peak RSS, as a container limit or the OOM killer sees it
(python, torch and the data included). Prints a table (largest batch, its peak RSS and growth
over the import baseline, ratio to eager) and writes the probes to a JSON file.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

from bench import machine
from bench.pool import REPO, WorkerError, WorkerProcess
from bench.rounds import READY_TIMEOUT_S, SETUP_TIMEOUT_S
from bench.workloads import WORKLOADS

SYSTEMS = ("eager", "compile", "ortrain")


def probe(workload: str, system: str, batch: int, *, steps: int, threads: int, cache_dir: str | None) -> dict:
    """One fresh worker at `batch`: {"batch", "peak_rss_mib", "growth_mib", "step_ms"} or, when it
    failed (out of memory included), {"batch", "error"}."""
    worker = WorkerProcess(workload, system, threads, seed=0, batch=batch, cache_dir=cache_dir)
    try:
        ready = worker.reply(READY_TIMEOUT_S)
        setup = worker.request({"cmd": "setup", "warmup": steps}, SETUP_TIMEOUT_S * max(1, batch // 20))
        done = worker.request({"cmd": "finish"}, READY_TIMEOUT_S)
    except WorkerError as err:
        worker.kill()
        return {"batch": batch, "error": f"{err.status}: {err}"}
    worker.close()
    times = sorted(setup["warmup_ms"][1:]) or setup["warmup_ms"]
    return {"batch": batch, "peak_rss_mib": done["peak_rss_mib"],
            "growth_mib": done["peak_rss_mib"] - ready["rss_after_import_mib"],
            "step_ms": times[len(times) // 2]}


def largest_fitting(run_probe, start: int, budget_mib: float, limit: int, log=print) -> tuple[dict | None, list]:
    """Doubling from `start`, then bisection: the probe of the largest batch ≤ `limit` whose peak
    RSS is within the budget (None when even `start` exceeds it), and every probe made."""
    probes = []

    def fits(batch):
        p = run_probe(batch)
        probes.append(p)
        ok = "error" not in p and p["peak_rss_mib"] <= budget_mib
        log(f"    batch {batch}: " + (p["error"] if "error" in p else
                                      f"peak {p['peak_rss_mib']:.0f} MiB ({'fits' if ok else 'over'})"))
        return ok, p

    ok, best = fits(start)
    if not ok:
        return None, probes
    lo, hi = start, None
    while hi is None and lo < limit:
        nxt = min(lo * 2, limit)
        ok, p = fits(nxt)
        if ok:
            lo, best = nxt, p
        else:
            hi = nxt
    # bisect to within 5% of the answer (or one sample)
    while hi is not None and hi - lo > max(1, lo // 20):
        mid = (lo + hi) // 2
        ok, p = fits(mid)
        if ok:
            lo, best = mid, p
        else:
            hi = mid
    return best, probes


def table(workload: str, budget_mib: float, results: dict) -> str:
    rows = [f"== {workload}: largest batch within a peak RSS of {budget_mib:.0f} MiB",
            f"{'system':8} {'batch':>6} {'x eager':>8} {'peak RSS MiB':>13} {'growth MiB':>11} {'step ms':>8}"]
    base = results.get("eager", {}).get("best")
    for system, r in results.items():
        b = r["best"]
        if b is None:
            rows.append(f"{system:8} {'-':>6}   (the workload's own batch does not fit: "
                        f"{r['probes'][0].get('error') or str(round(r['probes'][0]['peak_rss_mib'])) + ' MiB'})")
            continue
        ratio = f"{b['batch'] / base['batch']:.2f}" if base else "-"
        rows.append(f"{system:8} {b['batch']:>6} {ratio:>8} {b['peak_rss_mib']:>13.0f} {b['growth_mib']:>11.0f} "
                    f"{b['step_ms']:>8.0f}")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.max_batch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=list(WORKLOADS), default="tutorial")
    ap.add_argument("--systems", default="eager,ortrain", help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--budget-mib", type=float, default=2048.0, help="peak RSS budget of the whole process")
    ap.add_argument("--steps", type=int, default=4, help="steps per probe (RSS settles over the first few)")
    ap.add_argument("--max-batch", type=int, default=2048, help="the search stops here")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--json", default=None, help="where to write the probes (default bench/results/<time>-max-batch.json)")
    args = ap.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        ap.error(f"unknown system(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(SYSTEMS)}")
    if args.steps < 1 or args.budget_mib <= 0:
        ap.error("--steps must be at least 1 and --budget-mib positive")
    workload = WORKLOADS[args.workload]
    start = workload.default_batch
    if args.max_batch < start:
        ap.error(f"--max-batch must be at least the workload's own batch {start}")
    info = machine.machine_info(REPO)
    print(f"bench.max_batch: {info and machine.describe(info)}")
    print(f"bench.max_batch: {args.workload}, budget {args.budget_mib:.0f} MiB peak RSS, {args.steps} steps per probe, "
          f"{args.threads} threads", flush=True)
    t0 = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-max-batch-cache-") as cache:
        for system in systems:
            print(f"  {system}:", flush=True)
            # one cache for all of a system's probes: the first-step cost is not what this measures
            best, probes = largest_fitting(
                lambda b, s=system: probe(args.workload, s, b, steps=args.steps, threads=args.threads,
                                          cache_dir=os.path.join(cache, s)),
                start, args.budget_mib, args.max_batch, log=lambda m: print(m, flush=True))
            results[system] = {"best": best, "probes": probes}
    print("\n" + table(args.workload, args.budget_mib, results))
    path = args.json or os.path.join(REPO, "bench", "results",
                                     datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + "-max-batch.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"command": [sys.executable, "-m", "bench.max_batch", *(argv if argv is not None else sys.argv[1:])],
                   "machine": info, "config": vars(args), "results": results,
                   "wall_s": round(time.perf_counter() - t0, 1)}, f, indent=1)
    print(f"\nbench.max_batch: {time.perf_counter() - t0:.0f} s; probes in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
