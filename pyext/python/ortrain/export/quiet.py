"""Silencing the exporters (BRIEF §3.12: quiet by default) without hiding their errors.

Owns: a context manager that swallows warnings, stdout/stderr prints and torch/onnxscript log
records produced while an exporter runs. Exceptions pass through untouched.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings

_LOGGERS = ("torch.onnx", "torch.__trace", "torch.export", "torch._dynamo", "torch._export", "torch.fx",
            "onnxscript", "onnx_ir", "transformers")


@contextlib.contextmanager
def quiet(enabled: bool = True):
    """Suppress exporter noise; `ORTRAIN_EXPORT_VERBOSE=1` (or enabled=False) shows it."""
    if not enabled or os.environ.get("ORTRAIN_EXPORT_VERBOSE") == "1":
        yield
        return
    saved = {}
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        saved[name] = logger.level
        logger.setLevel(logging.ERROR + 1)
    sink = io.StringIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with _fds_to_devnull(), contextlib.redirect_stdout(sink), \
                    contextlib.redirect_stderr(sink):
                yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def _fds_to_devnull():
    """The legacy exporter's C++ side prints whole TorchScript graphs to fd 2 on failure."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    saved = []
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        for fd in (1, 2):
            try:
                saved.append((fd, os.dup(fd)))
                os.dup2(devnull, fd)
            except OSError:
                pass
        yield
    finally:
        for fd, copy in saved:
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)
