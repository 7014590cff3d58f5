"""The main loops of the CUDA kernels, read from their machine code without a GPU. nvdisasm (the
pinned nvidia-cuda-nvdisasm wheel in .cuda-wheels/, or $NVDISASM) disassembles the sm_90 CUBINs
that the CI compile test keeps in target/cubins/sm_90/ (engine/tests/cuda_kernels.rs), and for
each kernel this prints its instruction count and every loop (the span of a backward branch)
that holds tensor-core products or at least --min-loop instructions: its instructions, its
HMMA (mma.sync), MUFU (exp2), SHFL (shuffles), LDL/STL (local memory: spills) and its most
frequent opcodes.

One pass of a flash attention kernel's main loop is one key tile (forward, dQ) or query tile
(dK/dV), so its instructions per HMMA say whether a warp is issue-bound there: an SM's four
schedulers issue one instruction a cycle each, and its tensor cores take about one and a half
cycles per m16n8k16 product through mma.sync, so a loop over about 6 instructions per HMMA
waits on issue, not on the tensor cores. The counts are static: a branch inside the loop (the
diagonal tile's mask, the dropout's extra Philox counter of a run not starting on one) counts
whether or not it runs.

    python -m bench.kernel_loops [--cubins DIR] [--kernel REGEX] [--compare DIR]
                                 [--min-loop 150] [--json PATH]

--compare DIR reads the same kernels from another folder of CUBINs (say, one kept from another
commit) and prints each loop's instructions there and the ratio, loops matched by their order.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CUBINS = os.path.join(REPO, "target", "cubins", "sm_90")
WHEEL_NVDISASM = os.path.join(REPO, ".cuda-wheels", "nvidia", "cu13", "bin", "nvdisasm")
TRACKED = ("HMMA", "MUFU", "SHFL", "LDL", "STL", "LDS", "LDSM", "LDGSTS", "BAR")


def nvdisasm() -> str:
    """The nvdisasm to run: $NVDISASM, the pinned wheel's, or one on PATH."""
    for path in (os.environ.get("NVDISASM"), WHEEL_NVDISASM, shutil.which("nvdisasm")):
        if path and os.path.isfile(path):
            if not os.access(path, os.X_OK):
                os.chmod(path, os.stat(path).st_mode | 0o111)  # pip --target may drop the mode bit
            return path
    raise SystemExit("bench.kernel_loops: nvdisasm not found: run `bash scripts/bootstrap.sh` (it installs "
                     "requirements-cuda.txt into .cuda-wheels/), or set NVDISASM")


def opcode(instruction: str) -> str:
    """The opcode of one SASS instruction without its predicate and modifiers ("HMMA")."""
    words = instruction.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def disassemble(cubin: str) -> dict[str, tuple[list[str], dict[str, int]]]:
    """Every kernel of a CUBIN: its instructions in order and its labels' instruction indices."""
    text = subprocess.run([nvdisasm(), "-c", cubin], capture_output=True, text=True, check=True).stdout
    kernels: dict[str, tuple[list[str], dict[str, int]]] = {}
    current, pending = None, []
    for line in text.splitlines():
        head = re.match(r"^//-+ \.text\.(\S+) -+", line)
        if head:
            current, pending = head.group(1), []
            kernels[current] = ([], {})
            continue
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        code = re.match(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if code and current:
            instructions, labels = kernels[current]
            for name in pending:
                labels[name] = len(instructions)
            pending = []
            instructions.append(code.group(1))
    return kernels


def loops(instructions: list[str], labels: dict[str, int]) -> list[tuple[int, int]]:
    """(first, last) instruction index of every backward branch's span, in order."""
    spans = set()
    for i, ins in enumerate(instructions):
        if opcode(ins) == "BRA":
            target = re.search(r"\((\.L_x_\d+)\)", ins)
            if target and labels.get(target.group(1), i + 1) <= i:
                spans.add((labels[target.group(1)], i))
    return sorted(spans)


def describe(cubin: str, pattern: str, min_loop: int) -> dict[str, dict]:
    """The kernels of `cubin` whose names match `pattern`: instruction counts and their loops."""
    out = {}
    for name, (instructions, labels) in disassemble(cubin).items():
        if not re.search(pattern, name):
            continue
        found = []
        for first, last in loops(instructions, labels):
            ops = collections.Counter(opcode(i) for i in instructions[first:last + 1])
            if ops["HMMA"] or last - first + 1 >= min_loop:
                found.append({"first": first, "instructions": last - first + 1,
                              **{op: ops[op] for op in TRACKED},
                              "top": ops.most_common(8)})
        out[name] = {"instructions": len(instructions), "loops": found}
    return out


def may_hold(cubin: str, pattern: str) -> bool:
    """Whether a name in the CUBIN's string tables matches `pattern` (a superset of its kernels':
    the files without one are not disassembled)."""
    with open(cubin, "rb") as f:
        names = re.findall(rb"[A-Za-z_][A-Za-z0-9_]{2,}", f.read())
    return any(re.search(pattern, n.decode()) for n in set(names))


def describe_all(folder: str, pattern: str, min_loop: int) -> dict[str, dict]:
    if not os.path.isdir(folder) or not any(f.endswith(".cubin") for f in os.listdir(folder)):
        raise SystemExit(f"bench.kernel_loops: no CUBINs in {folder}: the CI compile test keeps them there "
                         "(cargo test --release -p ortrain-engine --features cuda --test cuda_kernels every_kernel_file)")
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".cubin") and may_hold(os.path.join(folder, f), pattern):
            out.update(describe(os.path.join(folder, f), pattern, min_loop))
    return out


def report(kernels: dict[str, dict], before: dict[str, dict] | None) -> str:
    lines = []
    for name, k in sorted(kernels.items()):
        lines.append(f"{name}: {k['instructions']} instructions")
        old = (before or {}).get(name, {}).get("loops", [])
        for n, loop in enumerate(k["loops"]):
            per_mma = f", {loop['instructions'] / loop['HMMA']:.1f} a HMMA" if loop["HMMA"] else ""
            was = ""
            if n < len(old):
                was = f" (was {old[n]['instructions']}: {loop['instructions'] / old[n]['instructions']:.2f}x)"
            counts = " ".join(f"{op} {loop[op]}" for op in TRACKED if loop[op])
            top = ", ".join(f"{op} {c}" for op, c in loop["top"])
            lines.append(f"  loop {n + 1}: {loop['instructions']} instructions{was}{per_mma}; {counts}; most: {top}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kernel_loops", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cubins", default=DEFAULT_CUBINS, help="a folder of CUBINs (default target/cubins/sm_90)")
    ap.add_argument("--kernel", default="attention_flash", help="a regular expression the kernels' names must match")
    ap.add_argument("--compare", help="another folder of CUBINs to set each loop against")
    ap.add_argument("--min-loop", type=int, default=150, help="report loops without HMMA from this many instructions")
    ap.add_argument("--json", help="also write the counts here")
    args = ap.parse_args(argv)
    kernels = describe_all(args.cubins, args.kernel, args.min_loop)
    if not kernels:
        raise SystemExit(f"bench.kernel_loops: no kernel in {args.cubins} matches {args.kernel!r}")
    before = describe_all(args.compare, args.kernel, args.min_loop) if args.compare else None
    print(report(kernels, before))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernels": kernels, "compare": before}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
