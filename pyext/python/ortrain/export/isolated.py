"""The export run in a forked child process, so that what exporting leaves behind never enters
the training process: `export_isolated(module, args, kwargs, **options) -> ExportedGraph`.

An export imports onnxscript and torchlib (~43 MiB) and leaves trace objects and allocator caches
behind (~45 MiB): 82-87 MiB of the tutorial's peak memory growth, doc/EXPORT.md. A child made by
fork starts with this process's modules, model and inputs as they are (nothing is pickled or
re-imported: the fork itself takes milliseconds), runs `export_module`, sends the ExportedGraph
back pickled through a pipe and leaves with `os._exit` (no atexit handlers, no kernel sockets
touched). Its cyclic GC is off (a collection would write to every tracked object's page and copy
the whole heap) and torch runs single-threaded there (no OpenMP pool crosses a fork).

Where the child cannot be used, the export runs here, as before: not Linux; CUDA initialised
in this process (a forked child cannot use it); a torch.distributed process group initialised
(its communication threads may hold locks across the fork); a parameter, buffer or input not on the CPU;
exporter output asked for (`ORTRAIN_EXPORT_VERBOSE=1`, `quiet_logs=False`: the user is debugging
it); the torch.export programs kept for `check_parity` (export.dynamo.capture_programs);
`ORTRAIN_EXPORT_IN_CHILD=0`. It also runs here, with a warning naming the reason, when the
child fails for a reason that is not the export's own: fork refused, the child killed or dead,
its result not picklable, or no result within `ORTRAIN_EXPORT_CHILD_TIMEOUT` seconds (600). An
export that fails in the child (ExportError, a bad argument) is raised here as it was raised
there: exporting again would fail the same way.
"""
from __future__ import annotations

import gc
import os
import pickle
import select
import signal
import sys
import threading
import time
import warnings

import torch

from ortrain._warn import warn

DEFAULT_TIMEOUT_S = 600.0


def enabled() -> bool:
    return os.environ.get("ORTRAIN_EXPORT_IN_CHILD", "1") != "0"


def why_not_isolated(module: torch.nn.Module, args: tuple, kwargs: dict | None, quiet_logs: bool = True):
    """None when the export can run in a child, else the reason it runs in this process."""
    if not enabled():
        return "ORTRAIN_EXPORT_IN_CHILD=0"
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return f"no fork on {sys.platform}"
    if not quiet_logs or os.environ.get("ORTRAIN_EXPORT_VERBOSE") == "1":
        return "exporter output requested"
    from ortrain.export.dynamo import capturing_programs

    if capturing_programs():
        return "the torch.export programs are kept (ortrain.check_parity)"
    if torch.cuda.is_initialized():
        return "CUDA is initialised in this process"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # the process group's threads (gloo's, NCCL's) may hold a lock the child would wait on
        # forever: a DDP rank's export child was seen blocked on a futex from its start
        return "a torch.distributed process group is initialised in this process"
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [v for v in (*args, *(kwargs or {}).values()) if isinstance(v, torch.Tensor)]
    if any(t.device.type != "cpu" for t in tensors):
        return "a tensor is not on the CPU"
    return None


def export_isolated(module: torch.nn.Module, args=(), kwargs: dict | None = None, **options):
    """`export_module(module, args, kwargs, **options)`, run in a forked child where possible
    (module docstring); the returned graph's `in_child` says where it ran."""
    from ortrain.export import export_module

    if not isinstance(args, tuple):
        args = (args,)
    if why_not_isolated(module, args, kwargs, options.get("quiet_logs", True)) is not None:
        return export_module(module, args, kwargs, **options)
    outcome, payload = _run_in_child(lambda: export_module(module, args, kwargs, **options))
    if outcome == "ok":
        payload.in_child = True
        return payload
    if outcome == "raised":
        raise payload
    warn(f"ortrain: exporting in this process instead of a child process: {payload}")
    return export_module(module, args, kwargs, **options)


def _timeout_s() -> float:
    try:
        return float(os.environ.get("ORTRAIN_EXPORT_CHILD_TIMEOUT", DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S


def _run_in_child(work):
    """("ok", result) | ("raised", exception) | ("failed", reason): `work()` run in a forked
    child, its result or exception pickled back."""
    for stream in (sys.stdout, sys.stderr):  # else the child's copy of a pending buffer is printed too
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a stream that cannot flush has nothing to duplicate
            pass
    try:
        read_fd, write_fd = os.pipe()
    except OSError as exc:
        return "failed", f"no pipe ({exc})"
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns on fork in a threaded process; the child only runs the export
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError as exc:
        os.close(read_fd)
        os.close(write_fd)
        return "failed", f"fork refused ({exc})"
    if pid == 0:  # the child: never returns
        os.close(read_fd)
        _child(work, write_fd)
    os.close(write_fd)
    try:
        data, reason = _read_all(read_fd, pid, _timeout_s())
    except BaseException:  # KeyboardInterrupt while waiting: the child goes too
        _reap(pid, kill=True)
        raise
    finally:
        os.close(read_fd)
    if reason is not None:
        _reap(pid, kill=True)
        return "failed", reason
    try:
        outcome, payload = pickle.loads(data)
    except Exception as exc:  # noqa: BLE001 - a truncated or unreadable result: export here
        return "failed", f"the child's result could not be read ({_describe_status(_reap(pid, kill=False))}; {type(exc).__name__})"
    # the child is exiting (its address space takes tens of ms to go): reaped off this thread
    threading.Thread(target=_reap, args=(pid, False), name="ortrain-export-reaper", daemon=True).start()
    return outcome, payload


def _child(work, write_fd: int):
    code = 0
    try:
        gc.disable()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is the parent's to handle
        # the parent's streams may be a kernel's, with locks its (not forked) threads may hold
        sys.stdout = sys.stderr = open(os.devnull, "w")
        torch.set_num_threads(1)
        try:
            message = ("ok", work())
        except Exception as exc:  # noqa: BLE001 - the export's own failure, raised in the parent
            message = ("raised", exc)
        try:
            data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - an unpicklable result or exception
            kind = "result" if message[0] == "ok" else f"exception {type(message[1]).__name__}"
            data = pickle.dumps(("failed", f"its {kind} cannot be pickled ({type(exc).__name__}: {exc})"[:300]))
        view = memoryview(data)
        while view:
            view = view[os.write(write_fd, view):]
        # the parent reads EOF now, not after the kernel has torn this address space down
        os.close(write_fd)
    except BaseException:  # noqa: BLE001 - nothing may escape a forked child
        code = 1
    finally:
        os._exit(code)


def _read_all(fd: int, pid: int, timeout_s: float):
    """(bytes, None) once the child closed its end, or (b"", reason) on timeout."""
    chunks = []
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"", f"no result from the export child (pid {pid}) within {timeout_s:.0f} s " \
                        "(ORTRAIN_EXPORT_CHILD_TIMEOUT)"
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks), None
        chunks.append(chunk)


def _reap(pid: int, kill: bool):
    """The child's wait status (None if it was reaped elsewhere), SIGKILLed first if `kill`."""
    if kill:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return None


def _describe_status(status) -> str:
    if status is None:
        return "exit status unknown"
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"
