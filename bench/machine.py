"""What the numbers were measured on: CPU model and the instruction-set flags that matter for
the kernels (AVX-512, avx512_bf16, AMX), cores, memory, transparent huge pages, load average,
and the ortrain source commit. Read from /proc and git, without importing torch."""
from __future__ import annotations

import os
import platform
import subprocess

FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16")


def _cpuinfo() -> dict:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return {}
    info = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "flags") and key not in info:
            info[key] = value.strip()
    return info


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _mem_total_gib() -> float | None:
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    return None


def _thp() -> str | None:
    """The selected transparent-huge-pages mode ("always", "madvise", "never")."""
    text = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    if text and "[" in text:
        return text.split("[", 1)[1].split("]", 1)[0]
    return text


def git_commit(repo: str) -> dict:
    def git(*args):
        out = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=False)
        return out.stdout.strip() if out.returncode == 0 else None

    return {"commit": git("rev-parse", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def machine_info(repo: str) -> dict:
    cpu = _cpuinfo()
    flags = set(cpu.get("flags", "").split())
    return {
        "cpu_model": cpu.get("model name") or platform.processor() or "unknown",
        "cpu_flags": {f: f in flags for f in FLAGS},
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "mem_total_gib": _mem_total_gib(),
        "transparent_hugepages": _thp(),
        "loadavg_at_start": os.getloadavg(),
        "platform": platform.platform(),
        "repo": git_commit(repo),
    }


def describe(info: dict) -> str:
    """One line for the top of the printed report."""
    flags = ", ".join(f for f, on in info["cpu_flags"].items() if on and f.startswith(("avx512", "amx")))
    load = ", ".join(f"{x:.2f}" for x in info["loadavg_at_start"])
    repo = info["repo"]
    commit = (repo["commit"] or "?")[:12] + (" (dirty)" if repo["dirty"] else "")
    return (f"{info['cpu_model']}, {info['usable_cores']} cores [{flags or 'no AVX-512/AMX'}], "
            f"THP {info['transparent_hugepages']}, load average {load}; ortrain commit {commit}")
