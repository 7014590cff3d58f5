"""Whether ortrain can train on CUDA here, and the message users see when it cannot.

`cuda_available(device=0)` probes the NVIDIA driver and that GPU, then loads ortrain's CUDA kernels (NVRTC
compiles them once per machine, then a disk cache serves them) and cuBLAS, both found in the
`nvidia/cu13/lib` folders of PyTorch's CUDA wheels. It answers False, with the reason, where any
of that is missing (no driver, a driver older than CUDA 13.0, no GPU, no NVRTC/cuBLAS). The CUDA
executor covers a growing subset of the CPU backend's ops; a model using others runs in PyTorch
with a warning naming them. doc/GPU-RUNS.md records what has run on a GPU.

`python -m ortrain.cuda warm [--arch sm_90 | auto]` compiles every kernel file for the node's
GPUs (or the named architecture) into that disk cache ahead of the first step, with no GPU
needed to compile: the Databricks init script runs it on every node, so that a fresh cluster's
first accelerated step does not wait for NVRTC.
"""
from __future__ import annotations

import argparse
import functools
import glob
import os
import shutil
import subprocess
import sys
import time

# what every CUDA refusal says besides the machine-specific reason
STATUS = "see doc/GPU-RUNS.md for what ortrain's CUDA backend runs"


def nvidia_lib_dirs() -> list[str]:
    """The `nvidia/*/lib` folders of the installed NVIDIA wheels (NVRTC, cuBLAS)."""
    dirs = []
    for root in sys.path:
        if root and os.path.isdir(os.path.join(root, "nvidia")):
            dirs += sorted(d for d in glob.glob(os.path.join(root, "nvidia", "*", "lib")) if os.path.isdir(d))
    return dirs


@functools.lru_cache(maxsize=None)
def _status(device: int) -> tuple[bool, str]:
    try:
        from ortrain import _ortrain
    except ImportError as e:  # a source tree without a built extension
        return False, f"the ortrain engine extension is not built: {e}"
    ok, why = _ortrain.cuda_status(nvidia_lib_dirs(), device=device)
    return bool(ok), str(why)


def cuda_available(device: int = 0) -> tuple[bool, str]:
    """(usable, what was found or why not) for GPU `device` (`cuda:<device>`). Never raises,
    whatever the machine (no driver, no GPU, old driver, no NVRTC); the answer is computed once
    per process and GPU."""
    return _status(int(device))


def unavailable_message(what: str, device: int = 0) -> str:
    """`what`: the CUDA backend is not available: <why>; <status>. Use the CPU."""
    _, why = cuda_available(device)
    return f"{what}: the CUDA backend is not available: {why}; {STATUS}. Use the CPU (device='cpu', model.cpu())"


def gpu_architectures() -> tuple[list[str], str]:
    """(the architectures of this machine's NVIDIA GPUs, e.g. ["sm_90"], deduplicated; or [] and
    why none), read with nvidia-smi: no CUDA context, no torch import."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "nvidia-smi is not on PATH (no NVIDIA driver here)"
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"nvidia-smi failed: {e}"
    if out.returncode != 0:
        return [], f"nvidia-smi failed (exit {out.returncode}): {(out.stderr or out.stdout).strip()[:300]}"
    archs = []
    for line in out.stdout.split():
        major, _, minor = line.strip().partition(".")
        if major.isdigit() and minor.isdigit() and f"sm_{major}{minor}" not in archs:
            archs.append(f"sm_{major}{minor}")
    return archs, "" if archs else f"nvidia-smi listed no GPU ({out.stdout.strip()[:200]!r})"


def warm_kernels(arch: str, out=sys.stdout) -> list[tuple[str, bool, float]]:
    """Compiles every CUDA kernel file for `arch` ("sm_90") into the engine's disk cache
    (ORTRAIN_CACHE_DIR, XDG_CACHE_HOME or ~/.cache, then ortrain/cuda) unless it is there
    already, printing a line per file to `out`; [(file, compiled now, milliseconds)]. Raises
    ortrain's EngineError with the engine's message (a bad architecture, no NVRTC, a cache folder
    that cannot be written)."""
    from ortrain import _ortrain

    start = time.perf_counter()
    folder, files = _ortrain.cuda_warm_kernels(arch, nvidia_lib_dirs())
    wall = time.perf_counter() - start
    print(f"ortrain: the CUDA kernel cache for {arch} in {folder}:", file=out)
    for name, compiled, ms in files:
        print(f"  {name:<44} {f'compiled in {ms / 1e3:.1f} s' if compiled else 'already in the cache'}", file=out)
    fresh = [ms for _, compiled, ms in files if compiled]
    print(f"ortrain: {len(files)} kernel files for {arch}: {len(fresh)} compiled ({sum(fresh) / 1e3:.1f} s of compiles in "
          f"{wall:.1f} s), {len(files) - len(fresh)} already cached", file=out)
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ortrain.cuda", description="ortrain's CUDA backend on this machine.")
    sub = ap.add_subparsers(dest="command", required=True)
    warm = sub.add_parser("warm", help="compile every CUDA kernel file into the disk cache ahead of the first step (no GPU "
                                       "needed to compile)")
    warm.add_argument("--arch", default="auto",
                      help="sm_XY (e.g. sm_80, sm_86, sm_90), several comma-separated, or auto (default): the "
                           "architectures of this machine's GPUs; with no GPU, auto warms nothing and succeeds")
    args = ap.parse_args(argv)
    if args.arch == "auto":
        archs, why = gpu_architectures()
        if not archs:
            print(f"ortrain: no NVIDIA GPU found ({why}): no CUDA kernels to warm", flush=True)
            return 0
    else:
        archs = [a.strip() for a in args.arch.split(",") if a.strip()]
        if not archs:
            ap.error("--arch names no architecture")
    try:
        for arch in archs:
            warm_kernels(arch)
    except Exception as e:  # the engine's message says what failed; keep the traceback out of init-script logs
        print(f"ortrain: warming the CUDA kernel cache failed: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
