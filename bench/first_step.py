"""Where the first step of an accelerated workload goes: export (torch.export capture, the
ONNX translation, ortrain's post-processing), engine session builds, planning, and the step
itself, each timed inclusively in this one fresh process (one line of JSON, or a table).

    python -m bench.first_step [--workload tutorial] [--threads 2] [--json] [--profile FILE]
    python -m bench.first_step --runs 3 [--warm]      # N fresh processes, medians per phase
    python -m bench.first_step --runs 5 --plain       # the first step as a user's, no wrappers

The user's loop is bench/worker.py's, the phases are found by wrapping the functions that do
them (the wrappers only read the clock); nested phases are included in their parents' times.
`--profile FILE` writes a cProfile of the first step instead of wrapping anything.
The wrappers and the profile need the export in this process (they set ORTRAIN_EXPORT_IN_CHILD=0) and import
the exporter's modules before the step, so their first step is shorter than a user's: `--plain`
wraps nothing and times the first step exactly as a user's runs (the export in a child process,
export/isolated.py); CPU seconds include the reaped child's.
Each process gets an empty export disk cache (ORTRAIN_EXPORT_CACHE_DIR: a user's first run, as
in `python -m bench`) unless the variable is set; `--runs N --warm` shares one cache folder that
an untimed run fills first (a user's later runs: the translation is read back).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.worker import _peak_rss_mib, _rss_mib

# (label, module, attribute path): wrapped if present; a missing one is skipped
_PHASES = (
    ("export_module", "ortrain.export", "export_module"),
    ("  torch.onnx.export (dynamo)", "ortrain.export.dynamo", "export"),
    ("    registry from torchlib", "torch.onnx._internal.exporter._registration", "ONNXRegistry.from_torchlib"),
    ("    registry, lazily signed (ortrain)", "ortrain.export.registry", "build"),
    ("    one trace, decomposed (ortrain)", "ortrain.export.capture", "capture_decomposed"),
    ("    torch.export capture", "torch.onnx._internal.exporter._capture_strategies",
     "TorchExportNonStrictStrategy.__call__"),
    ("    decompositions", "torch.onnx._internal.exporter._core", "_prepare_exported_program_for_export"),
    ("      decomposition table", "torch.onnx._internal.exporter._decomp", "create_onnx_friendly_decomposition_table"),
    ("      run_decompositions (retrace)", "torch.export", "ExportedProgram.run_decompositions"),
    ("      type promotion", "torch.onnx._internal.exporter._fx_passes", "insert_type_promotion_nodes"),
    ("    ONNX translation", "torch.onnx._internal.exporter._core", "_exported_program_to_onnx_program"),
    ("    opset conversion", "torch.onnx._internal.exporter._core", "onnxscript_apis.convert_version"),
    ("    IR -> ModelProto", "torch.onnx._internal.exporter._onnx_program", "ONNXProgram.model_proto.fget"),
    ("  post-processing: strip_prefix", "ortrain.export.graph", "strip_prefix"),
    ("  post-processing: fix_dropouts", "ortrain.export.graph", "fix_dropouts"),
    ("  post-processing: map_parameters", "ortrain.export.graph", "map_parameters"),
    ("  onnx.checker", "onnx.checker", "check_model"),
    ("ModelProto.SerializeToString / onnx.load_from_string", "onnx", "load_from_string"),
    ("strip_bound_weights", "ortrain.engine.runner", "strip_bound_weights"),
    ("engine Session build (import, passes, autodiff)", "ortrain.engine.runner", "_ortrain.Session"),
    ("runner.output_types (forward plan)", "ortrain.engine.runner", "Runner.output_types"),
    ("CrossEntropyRunner (graph edit + Session)", "ortrain.engine.cross_entropy", "CrossEntropyRunner.__init__"),
    ("engine call (plan + run, forward)", "ortrain.engine.function", "EngineFunction.forward"),
    ("engine backward (plan + run)", "ortrain.engine.function", "EngineFunction.backward"),
)


class Clock:
    """Wall time (perf_counter) and this process's CPU time (process_time, all its threads: less
    sensitive to other processes on a busy machine) per phase."""

    def __init__(self):
        self.total: dict = {}
        self.cpu: dict = {}
        self.calls: dict = {}

    def add(self, label, wall0, cpu0):
        self.total[label] = self.total.get(label, 0.0) + time.perf_counter() - wall0
        self.cpu[label] = self.cpu.get(label, 0.0) + time.process_time() - cpu0
        self.calls[label] = self.calls.get(label, 0) + 1

    def wrap(self, label, owner, attr):
        raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
        kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
        original = raw.__func__ if kind is not None else getattr(owner, attr)
        clock = self

        @functools.wraps(original)
        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                clock.add(label, t0, c0)

        if kind is not None:
            timed = kind(timed)
        setattr(owner, attr, timed)


def _resolve(module: str, path: str):
    """(owner, attribute name) for a dotted path under a module; properties by `.fget`."""
    obj = importlib.import_module(module)
    parts = path.split(".")
    if parts[-1] == "fget":
        cls = obj
        for p in parts[:-2]:
            cls = getattr(cls, p)
        prop = cls.__dict__[parts[-2]]
        return cls, parts[-2], prop
    for p in parts[:-1]:
        obj = getattr(obj, p)
    return obj, parts[-1], None


def install(clock: Clock) -> None:
    for label, module, path in _PHASES:
        try:
            owner, attr, prop = _resolve(module, path)
        except (ImportError, AttributeError, KeyError):
            continue
        if prop is not None:
            fget = prop.fget

            def timed_get(self, _f=fget, _label=label):
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    return _f(self)
                finally:
                    clock.add(_label, t0, c0)

            setattr(owner, attr, property(timed_get))
        elif hasattr(owner, attr):
            clock.wrap(label, owner, attr)
    # SerializeToString lives on the C message class: time it through the one place we call it
    import onnx

    clock.wrap("ModelProto.SerializeToString / onnx.load_from_string", onnx, "load_from_string")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workload", default="tutorial")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="one line of JSON instead of a table")
    ap.add_argument("--profile", help="write a cProfile of the first step here (no phase wrappers)")
    ap.add_argument("--preimport", action="store_true",
                    help="what-if: import torch.export's machinery (torch._dynamo, ...) before the first step")
    ap.add_argument("--plain", action="store_true",
                    help="no phase wrappers: the first step exactly as a user's (export in a child process)")
    ap.add_argument("--runs", type=int, default=0, help="run N fresh processes and print the medians")
    ap.add_argument("--warm", action="store_true", help="with --runs: one export disk cache, filled first")
    args = ap.parse_args()
    if args.runs:
        return _runs(args)
    if "ORTRAIN_EXPORT_CACHE_DIR" not in os.environ:
        os.environ["ORTRAIN_EXPORT_CACHE_DIR"] = tempfile.mkdtemp(prefix="first-step-cold-")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
        os.environ.setdefault(var, str(args.threads))
    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(args.threads)
    import ortrain

    from bench import workloads

    if args.preimport:
        import torch._dynamo  # noqa: F401
        import torch._functorch.aot_autograd  # noqa: F401
        import torch.export._trace  # noqa: F401
    t_import = time.perf_counter() - t_start
    clock = Clock()
    if not args.plain:
        os.environ["ORTRAIN_EXPORT_IN_CHILD"] = "0"  # the export runs where wrappers and cProfile see it
        if not args.profile:
            install(clock)
    workload = workloads.WORKLOADS[args.workload]
    torch.manual_seed(0)
    job = workload.build()
    ortrain.accelerate(job.model, job.optimizer)
    batch = job.batch(0)

    def step():
        job.optimizer.zero_grad()
        loss = job.forward_loss(job.model, batch)
        loss.backward()
        if job.clip is not None:
            torch.nn.utils.clip_grad_norm_(job.model.parameters(), job.clip)
        job.optimizer.step()
        return loss.item()

    rss_before = _rss_mib()
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0, c0 = time.perf_counter(), _cpu_s()
    loss = step()
    first, first_cpu = time.perf_counter() - t0, _cpu_s() - c0
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    peak = _peak_rss_mib()
    phases = {k: round(clock.total[k], 4) for k, _, _ in _PHASES if k in clock.total}
    phases_cpu = {k: round(clock.cpu[k], 4) for k, _, _ in _PHASES if k in clock.cpu}
    calls = dict(clock.calls)
    t1 = time.perf_counter()
    step()
    second = time.perf_counter() - t1
    state = job.model.__dict__["_ortrain_state"]
    exported = [r.exported for r in state.runners.values() if hasattr(r, "exported")]
    attempts = [a for e in exported for a in e.attempts]
    result = {"workload": args.workload, "attempts": attempts, "import_s": t_import, "first_step_s": first, "first_step_cpu_s": first_cpu, "second_step_s": second,
              "loss": loss, "rss_before_mib": rss_before, "peak_rss_growth_mib": peak - rss_before,
              "phases": phases, "phases_cpu": phases_cpu, "calls": calls}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.workload}: import {t_import:.2f} s, first step {first:.2f} s (CPU {first_cpu:.2f} s), "
          f"second step {second:.3f} s, "
          f"loss {loss:.4f}, exporter attempts {attempts}, RSS before {rss_before:.0f} MiB, peak during the first "
          f"step +{peak - rss_before:.0f} MiB")
    print("phases of the first step (inclusive), wall and CPU seconds:")
    for label, _, _ in _PHASES:
        if label in phases:
            print(f"  {label:<55s} {phases[label]:7.3f} {phases_cpu[label]:7.3f}  x{calls[label]}")


def _cpu_s() -> float:
    """CPU seconds of this process and of its reaped children (the export child)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _runs(args) -> None:
    """`args.runs` fresh processes of this script; the median of every number."""
    cmd = [sys.executable, "-m", "bench.first_step", "--json", "--workload", args.workload, "--threads", str(args.threads)]
    cmd += ["--preimport"] if args.preimport else []
    cmd += ["--plain"] if args.plain else []
    shared = tempfile.mkdtemp(prefix="first-step-warm-") if args.warm else None
    results = []
    for i in range(args.runs + (1 if args.warm else 0)):
        env = dict(os.environ)
        env["ORTRAIN_EXPORT_CACHE_DIR"] = shared or tempfile.mkdtemp(prefix="first-step-cold-")
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        if args.warm and i == 0:
            continue  # fills the cache
        results.append(result)
        print(f"run {len(results)}: first step {result['first_step_s']:.2f} s", file=sys.stderr)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    print(f"{args.workload}, {args.runs} fresh processes ({'warm' if args.warm else 'cold'} export disk cache"
          f"{', torch.export machinery imported before' if args.preimport else ''}"
          f"{', as a user runs it' if args.plain else ', export in this process with phase wrappers'}), "
          f"medians: import {med([r['import_s'] for r in results]):.2f} s, first step "
          f"{med([r['first_step_s'] for r in results]):.2f} s (runs: "
          f"{', '.join(format(r['first_step_s'], '.2f') for r in results)}; CPU "
          f"{med([r['first_step_cpu_s'] for r in results]):.2f} s), second step "
          f"{med([r['second_step_s'] for r in results]):.3f} s, peak RSS growth over the first step "
          f"{med([r['peak_rss_growth_mib'] for r in results]):.0f} MiB")
    print(f"  {'phase (inclusive; medians)':<55s} {'wall s':>7s} {'CPU s':>7s}")
    for label, _, _ in _PHASES:
        values = [r["phases"][label] for r in results if label in r["phases"]]
        cpu = [r["phases_cpu"][label] for r in results if label in r["phases_cpu"]]
        if values:
            print(f"  {label:<55s} {med(values):7.3f} {med(cpu):7.3f}")


if __name__ == "__main__":
    sys.exit(main())
