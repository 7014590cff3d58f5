"""One benchmark worker: a process that trains one workload on one system, step by step, when the
orchestrator (bench/rounds.py) asks it to. It owns the user's training loop and its timing.

    python -m bench.worker '<json config>'     (started by bench/pool.py, not by hand)

Protocol: one JSON object a line. The worker writes {"event": "ready", ...} once its imports are
done, then answers each command read from stdin: {"cmd": "setup", "warmup": N} (build the model,
set up the system, run N untimed steps, the first timed on its own), {"cmd": "run", "steps": K}
(K timed steps), {"cmd": "finish"} (peak RSS; the worker exits). A failure answers
{"error": ..., "status": "failed" | "unsupported"} and the worker exits. The protocol has its own
file descriptor: anything torch, ortrain or Rust prints on stdout goes to stderr instead.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
import warnings


def _protocol_channel():
    """A private copy of stdout for the protocol; fd 1 then points at stderr."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return channel


def _status_mib(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _rss_mib() -> float:
    v = _status_mib("VmRSS")
    return float("nan") if v is None else v


def _peak_rss_mib() -> float:
    """This process's peak resident size: VmHWM, which exec resets (ru_maxrss keeps the peak of
    the process that forked it: a worker started from a big process would report that one's)."""
    v = _status_mib("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if v is None else v  # KiB on Linux


class Worker:
    def __init__(self, config: dict):
        import torch

        from bench import systems, workloads

        self.torch = torch
        self.systems = systems
        self.config = config
        self.workload = workloads.WORKLOADS[config["workload"]]
        self.system = config["system"]
        torch.set_num_threads(config["threads"])
        workloads.preload(self.workload)
        if self.system == "ortrain":
            import ortrain  # noqa: F401
        self.caught: list = []
        self.step_index = 0
        self.job = None
        self.prepared = None

    def versions(self) -> dict:
        out = {"torch": self.torch.__version__, "python": sys.version.split()[0]}
        if self.workload.needs_transformers:
            import transformers

            out["transformers"] = transformers.__version__
        if self.system == "ortrain":
            import ortrain

            out["ortrain"] = ortrain.__version__
            out["ortrain_path"] = os.path.dirname(ortrain.__file__)
        return out

    def step(self) -> tuple[float, float]:
        """One step of the user's loop: (milliseconds, loss). loss.item() is inside the timing, as a
        user logging the loss every batch has it."""
        job, p = self.job, self.prepared
        batch = job.batch(self.step_index)
        self.step_index += 1
        t0 = time.perf_counter()
        job.optimizer.zero_grad()
        with p.autocast():
            loss = job.forward_loss(p.model, batch)
        loss.backward()
        if job.clip is not None:
            self.torch.nn.utils.clip_grad_norm_(job.model.parameters(), job.clip)
        job.optimizer.step()
        value = loss.item()
        return (time.perf_counter() - t0) * 1e3, value

    def steps(self, n: int) -> dict:
        times, losses = [], []
        for _ in range(n):
            ms, loss = self.step()
            times.append(ms)
            losses.append(loss)
        self.prepared.check(self.caught)
        return {"step_ms": times, "losses": losses}

    def setup(self, warmup: int) -> dict:
        t0 = time.perf_counter()
        self.torch.manual_seed(self.config["seed"])
        self.job = self.workload.build(batch=self.config.get("batch"))
        built = time.perf_counter()
        self.prepared = self.systems.prepare(self.system, self.job.model, self.job.optimizer, self.workload.precision)
        self.torch.manual_seed(self.config["seed"])  # dropout masks: same stream start everywhere
        first = self.steps(1)
        rest = self.steps(max(warmup - 1, 0))
        return {"build_s": built - t0, "first_step_ms": first["step_ms"][0],
                "warmup_ms": first["step_ms"] + rest["step_ms"], "warmup_losses": first["losses"] + rest["losses"],
                "params": sum(p.numel() for p in self.job.model.parameters()), "notes": self.prepared.notes,
                "rss_after_setup_mib": _rss_mib()}

    def finish(self) -> dict:
        text = self.prepared.describe() if self.prepared else ""
        return {"peak_rss_mib": _peak_rss_mib(), "rss_mib": _rss_mib(), "describe": text,
                "warnings": sorted({f"{w.category.__name__}: {w.message}" for w in self.caught})}


def main() -> None:
    channel = _protocol_channel()

    def send(obj):
        channel.write(json.dumps(obj) + "\n")

    config = json.loads(sys.argv[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            worker = Worker(config)
            worker.caught = caught
            send({"event": "ready", "rss_after_import_mib": _rss_mib(), "versions": worker.versions()})
        except Exception as exc:  # noqa: BLE001
            send(_failure(exc))
            return
        for line in sys.stdin:
            msg = json.loads(line)
            try:
                if msg["cmd"] == "setup":
                    send(worker.setup(msg["warmup"]))
                elif msg["cmd"] == "run":
                    send(worker.steps(msg["steps"]))
                elif msg["cmd"] == "finish":
                    send(worker.finish())
                    return
                else:
                    raise ValueError(f"unknown command {msg['cmd']!r}")
            except Exception as exc:  # noqa: BLE001 - the orchestrator reports it as this system's row
                send(_failure(exc))
                return


def _failure(exc: BaseException) -> dict:
    from bench.systems import FellBack, Unsupported

    status = "unsupported" if isinstance(exc, Unsupported) else "failed"
    text = str(exc) if isinstance(exc, (FellBack, Unsupported)) else f"{type(exc).__name__}: {exc}"
    return {"error": text.strip(), "status": status, "traceback": traceback.format_exc()}


if __name__ == "__main__":
    main()
