"""`warn(message)`: a UserWarning attributed to the user's own line (a notebook cell, a script),
the first frame outside ortrain and torch, however deep in ortrain or torch.nn.Module's call
machinery it was raised."""
from __future__ import annotations

import os
import sys
import warnings

_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _library_dirs() -> tuple[str, ...]:
    dirs = [_OURS]
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None):
        dirs.append(os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    return tuple(dirs)


def user_stacklevel() -> int:
    """The `stacklevel` that makes warnings.warn, called by the caller of this function, name
    the first frame outside ortrain and torch (1: the caller itself, if no such frame)."""
    libraries = _library_dirs()
    frame = sys._getframe(1)  # the function about to call warnings.warn
    level = 1
    while frame is not None:
        if not os.path.abspath(frame.f_code.co_filename).startswith(libraries):
            return level
        frame = frame.f_back
        level += 1
    return 1


def warn(message: str) -> None:
    warnings.warn(message, stacklevel=user_stacklevel())


def first_line(exc: Exception) -> str:
    """The first line of an exception's message (its type's name if it has none), for a warning."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
