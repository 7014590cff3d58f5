"""Another tenant on one core, for `python -m bench --busy-core CORE:DUTY`: a process pinned to
CORE spins for DUTY of every 4 ms and sleeps the rest, for the whole run, so that the table shows
how each system copes when one of its threads' cores is taken from time to time (as on a shared
cloud machine). A system whose threads split work into fixed halves waits for the slowed one at
every barrier; one whose threads take work as they become free loses only the cycles taken.

    python -m bench --workloads tutorial --busy-core 1:0.5
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time

PERIOD_S = 0.004


def parse(text: str) -> tuple[int, float]:
    """CORE:DUTY → (core, duty): a core this process may run on, a duty in (0, 1]."""
    usable = sorted(os.sched_getaffinity(0))
    try:
        core_text, duty_text = text.split(":")
        core, duty = int(core_text), float(duty_text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--busy-core takes CORE:DUTY (e.g. 1:0.5), got {text!r}") from None
    if core not in usable:
        raise argparse.ArgumentTypeError(f"--busy-core: core {core} is not one this process may use "
                                         f"({', '.join(map(str, usable))})")
    if not 0.0 < duty <= 1.0:
        raise argparse.ArgumentTypeError(f"--busy-core: duty {duty} must be in (0, 1]")
    return core, duty


@contextlib.contextmanager
def busy(core: int, duty: float):
    """Keeps `core` busy for `duty` of the time while the block runs; the process is stopped
    however the block ends."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-m", "bench.busy_core", str(core), str(duty)], cwd=repo,
                            stdin=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def spin(core: int, duty: float) -> None:
    os.sched_setaffinity(0, {core})
    while True:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < PERIOD_S * duty:
            pass
        if duty < 1.0:
            time.sleep(PERIOD_S * (1.0 - duty))


if __name__ == "__main__":
    spin(int(sys.argv[1]), float(sys.argv[2]))
