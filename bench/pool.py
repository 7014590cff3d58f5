"""The orchestrator's handle on one worker process (bench/worker.py): start it with the thread
settings in its environment (and, for torch.compile, an empty inductor cache of its own, so its
first step is a cold compile as a user's first run is; for ortrain, likewise an empty export
disk cache, so its first step translates the model to ONNX as a user's first run does), send a command, wait for the answer with
a time limit, and turn a crash, a hang or an error answer into a `WorkerError` carrying the
worker's own stderr."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class WorkerError(Exception):
    def __init__(self, status: str, message: str, detail: str = ""):
        super().__init__(message)
        self.status = status  # "failed" | "unsupported"
        self.detail = detail  # traceback or stderr tail


class WorkerProcess:
    def __init__(self, workload: str, system: str, threads: int, seed: int, batch: int | None = None,
                 cache_dir: str | None = None):
        """`batch`: the workload's batch size (None: its own); `cache_dir`: a compile/export cache
        shared with other workers (None: an empty one of its own, removed with the worker)."""
        self.label = f"{workload}/{system}"
        env = dict(os.environ)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
            env[var] = str(threads)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
        env.setdefault("PYTHONUNBUFFERED", "1")
        cached = system in ("compile", "ortrain")
        self._cache = tempfile.TemporaryDirectory(prefix=f"bench-{system}-cache-") if cached and not cache_dir else None
        if cached:
            env["TORCHINDUCTOR_CACHE_DIR" if system == "compile" else "ORTRAIN_EXPORT_CACHE_DIR"] = \
                cache_dir or self._cache.name
        config = {"workload": workload, "system": system, "threads": threads, "seed": seed, "batch": batch}
        self._stderr = tempfile.TemporaryFile(mode="w+b", prefix="bench-worker-")
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.worker", json.dumps(config)], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        self._buffer = b""

    def request(self, command: dict, timeout: float) -> dict:
        try:
            self.proc.stdin.write((json.dumps(command) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the reply read below reports how the worker ended
        return self.reply(timeout)

    def reply(self, timeout: float) -> dict:
        """The next answer; WorkerError when it is an error, the worker dies or takes too long."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise WorkerError("failed", f"no answer within {timeout:.0f} s (killed)", self.stderr_tail())
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                code = self.proc.wait()
                raise WorkerError("failed", f"worker exited with code {code} ({_signal_name(code)})",
                                  self.stderr_tail())
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        answer = json.loads(line)
        if "error" in answer:
            self.close()
            raise WorkerError(answer["status"], answer["error"], answer.get("traceback", ""))
        return answer

    def stderr_tail(self, chars: int = 4000) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-chars:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._cache:
            self._cache.cleanup()
            self._cache = None

    def close(self, timeout: float = 30) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self._cleanup()


def _signal_name(code: int) -> str:
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return "crashed" if code else "exited early"
