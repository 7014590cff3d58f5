"""Runs one workload on every system, interleaved: all workers start (imports in parallel), then
one after the other builds its model and warms up (so each first step is timed alone), then R
rounds in which each worker in turn runs its share of the timed steps while the others wait on
their pipe. The order rotates each round, so machine noise hits every system alike. A worker
that fails becomes a row with its error; the others go on."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from bench.pool import WorkerError, WorkerProcess

READY_TIMEOUT_S = 300
SETUP_TIMEOUT_S = 1800  # torch.compile of a whole model on 2 busy cores
STEP_TIMEOUT_S = 120


@dataclass
class SystemRun:
    """Everything measured of one (workload, system); `status` "ok" | "failed" | "unsupported" | "skipped"."""

    system: str
    status: str = "ok"
    error: str | None = None
    error_detail: str = ""
    versions: dict = field(default_factory=dict)
    rss_after_import_mib: float | None = None
    setup: dict = field(default_factory=dict)
    rounds: list = field(default_factory=list)  # per round: {"step_ms": [...], "losses": [...]}
    finish: dict = field(default_factory=dict)

    @property
    def step_ms(self) -> list:
        return [t for r in self.rounds for t in r["step_ms"]]

    @property
    def losses(self) -> list:
        return [x for r in self.rounds for x in r["losses"]]


def split_steps(steps: int, rounds: int) -> list:
    rounds = max(1, min(rounds, steps))
    base, extra = divmod(steps, rounds)
    return [base + (1 if i < extra else 0) for i in range(rounds)]


def run_workload(workload: str, systems: list, *, steps: int, warmup: int, rounds: int, threads: int,
                 seed: int, skip: dict | None = None, log=print) -> dict:
    """{system: SystemRun}; `skip`: {system: reason} for systems not run (status "skipped")."""
    skip = skip or {}
    runs = {s: SystemRun(s, status="skipped", error=skip[s]) if s in skip else SystemRun(s) for s in systems}
    workers = {s: WorkerProcess(workload, s, threads, seed) for s in systems if s not in skip}
    alive = dict(workers)

    def attempt(system, what, call):
        try:
            return call()
        except WorkerError as err:
            run = runs[system]
            run.status, run.error, run.error_detail = err.status, f"{what}: {err}", err.detail
            log(f"  {workload}/{system}: {run.status} during {what}: {err}")
            alive.pop(system).kill()
            return None

    for s, w in workers.items():
        ready = attempt(s, "start", lambda: w.reply(READY_TIMEOUT_S))
        if ready:
            runs[s].versions = ready["versions"]
            runs[s].rss_after_import_mib = ready["rss_after_import_mib"]
    for s in list(alive):
        t0 = time.perf_counter()
        answer = attempt(s, "setup", lambda: alive[s].request({"cmd": "setup", "warmup": warmup}, SETUP_TIMEOUT_S))
        if answer:
            runs[s].setup = answer
            log(f"  {workload}/{s}: set up in {time.perf_counter() - t0:.1f} s, first step "
                f"{answer['first_step_ms'] / 1e3:.2f} s")
    for r, k in enumerate(split_steps(steps, rounds)):
        order = list(alive)
        order = order[r % len(order):] + order[:r % len(order)] if order else order
        for s in order:
            answer = attempt(s, f"round {r + 1}", lambda: alive[s].request({"cmd": "run", "steps": k},
                                                                              STEP_TIMEOUT_S * k + 60))
            if answer:
                runs[s].rounds.append(answer)
        if alive:
            log(f"  {workload}: round {r + 1} done ({', '.join(alive)})")
    for s in list(alive):
        answer = attempt(s, "finish", lambda: alive[s].request({"cmd": "finish"}, READY_TIMEOUT_S))
        if answer:
            runs[s].finish = answer
            alive.pop(s).close()
    return runs


def log_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
